"""What a Trainer entry point starts on an accumulation strategy's parts, and ends with it: :class:`TrainerRun`."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_accum.core.core import AccumulationCore
from lightning_accum.schedules import UpdateSchedules, bind_schedulers
from lightning_accum.strategies.automatic import CLOSURE_EVALUATING, reevaluation_message
from lightning_accum.strategies.evaluation import ExactEvaluation
from lightning_accum.strategies.global_order import install_global_order
from lightning_accum.strategies.group_boundaries import GroupBoundaries, UnknownUpdates
from lightning_accum.strategies.precision_clipping import PrecisionClipping
from lightning_accum.strategies.scheduled_groups import ScheduledGroups
from lightning_accum.strategies.slicing import BatchSlicer
from lightning_accum.strategies.token_groups import TokenGroups

__all__ = ["TrainerRun"]


class TrainerRun:
    """The run hooks' work on the parts of ``strategy`` (read: Lightning's public members): what ``setup`` binds, what
    a fit starts with, and the end of both at ``teardown``, after an exception too (docs/internals.md)."""

    def __init__(
        self,
        strategy: Any,
        core: AccumulationCore,
        slicer: BatchSlicer,
        scheduled: ScheduledGroups,
        tokens: TokenGroups,
        groups: GroupBoundaries,
        evaluation: ExactEvaluation,
    ) -> None:
        self.strategy, self.core, self.slicer = strategy, core, slicer
        self.scheduled, self.tokens, self.groups, self.evaluation = scheduled, tokens, groups, evaluation
        self.clipping = PrecisionClipping()  # the precision plugin's clip methods, for the run
        #: The Trainer of the entry point running (``setup`` to ``teardown``): the hooks of every micro-batch read it.
        self.trainer: Trainer | None = None
        #: The entry point running raised (Lightning called the strategy's ``on_exception``).
        self.failed = False

    def attached_trainer(self) -> Trainer | None:
        """The Trainer running the strategy (set at ``setup``; before it, the module's), or ``None`` (a module
        connected to the strategy without a Trainer, as Lightning's own strategies allow for ``save_checkpoint``)."""
        if self.trainer is not None:
            return self.trainer
        module = self.strategy.lightning_module
        try:
            return module.trainer if module is not None else None
        except RuntimeError:  # "... is not attached to a `Trainer`"
            return None

    @contextmanager
    def configuring(self, trainer: Trainer) -> Iterator[None]:
        """Around Lightning's ``setup``: under a schedule or token batches Lightning's count of updates is wrong, and
        reading it in ``configure_optimizers`` is refused (``UnknownUpdates``)."""
        given = self.tokens.accumulate = trainer.accumulate_grad_batches
        if trainer.state.fn == TrainerFn.FITTING and self.scheduled.schedule is not None:
            trainer.accumulate_grad_batches = UnknownUpdates()  # type: ignore[assignment]
        elif trainer.state.fn == TrainerFn.FITTING and self.tokens.options is not None:
            trainer.accumulate_grad_batches = UnknownUpdates(self.tokens.refusal)  # type: ignore[assignment]
        try:
            yield
        finally:
            trainer.accumulate_grad_batches = given

    def training_loader(self, loader: Any) -> Any:
        """What ``process_dataloader`` hands Lightning: the training loader re-created under ``global_order=`` or
        ``token_batches=`` (which implies it), any other as it is."""
        tokens = self.tokens.options is not None
        if not (tokens or self.core.engine.options.global_order):
            return loader
        trainer = self.attached_trainer()
        assert trainer is not None, "the strategy runs without a Trainer"
        if trainer.state.stage != RunningStage.TRAINING:
            return loader
        layout = getattr(self.strategy, "distributed_sampler_kwargs", None)
        if tokens:
            return self.tokens.install(loader, trainer, layout)
        return install_global_order(loader, trainer, layout)

    def setup(self, trainer: Trainer) -> None:
        """After Lightning's ``setup``: the parts bound for the entry point."""
        strategy, core, module = self.strategy, self.core, trainer.lightning_module
        self.trainer = trainer
        refuse = None if module.automatic_optimization else core.refuse_clipping  # automatic: clipped after the close
        self.clipping.install(strategy.precision_plugin, core.adapter, refuse)
        self.slicer.reset()
        core.bind(strategy.root_device)
        bind_schedulers(strategy.lr_scheduler_configs, core.engine)  # AxisLR counts what each applied update consumed
        if module.automatic_optimization:  # in manual optimization the user steps the schedulers
            core.closing.schedules = UpdateSchedules(module, strategy.lr_scheduler_configs)

    def start_fit(self, trainer: Trainer) -> None:
        """At the fit's start: what accumulation cannot run with refused, the fit's groups placed, warnings said."""
        _check_supported(self.strategy, self.slicer, trainer)
        sizer = self.scheduled.start(trainer, self.core, self.slicer.split_batch)
        self.groups.install(trainer, self.tokens.start(trainer) or sizer)
        self.core.engine.decisions.add_listener(self.scheduled.on_group)
        _warn_of_slashes_in_checkpoint_names(trainer)
        if trainer.lightning_module.automatic_optimization and self.tokens.options is None:
            engine = self.core.engine
            engine.decisions.warn_short_epoch(
                trainer.num_training_batches, trainer.accumulate_grad_batches, engine.warn
            )

    def end(self, aside: bool) -> None:
        """What the entry point made ends with it, a group it left open included (said, unless ``aside``: the hooks ran
        for a check; after an exception as info, the exception telling why)."""
        say = None if aside else rank_zero_info if self.failed else rank_zero_warn
        self.core.end(
            "the fit stopped",
            say,
            " A checkpoint written before the stop (OnExceptionCheckpoint, a SIGTERM checkpoint) carries them, and"
            " `trainer.fit(..., ckpt_path=...)` from it finishes the group exactly.",
        )
        self.failed = False
        self.clipping.release()
        self.core.engine.decisions.remove_listener(self.scheduled.on_group)
        self.scheduled.forget_resume()
        self.groups.release(self.trainer)
        self.evaluation.end()
        self.slicer.reset()
        self.trainer = None


def _warn_of_slashes_in_checkpoint_names(trainer: Trainer) -> None:
    """A ``ModelCheckpoint`` whose ``filename`` names a package key (``{accum/val_loss:.4f}``) with Lightning's default
    ``auto_insert_metric_name=True`` writes ``accum/val_loss=...`` into the file name: a sub-folder per checkpoint,
    left empty after top-k eviction, and no ``*.ckpt`` where a script looks for them. Said once, with the recipe."""
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint) or not callback.filename or not callback.auto_insert_metric_name:
            continue
        keys = re.findall(r"\{\s*(accum/[\w/]+)", callback.filename)
        if keys:
            rank_zero_warn(
                f"ModelCheckpoint(filename={callback.filename!r}) inserts the metric's name `{keys[0]}` into each file"
                f" name, and its `/` makes a sub-folder per checkpoint (left empty when top-k removes the file). Pass"
                f" `auto_insert_metric_name=False` and name the value yourself, e.g."
                f" `filename='epoch={{epoch}}-val_loss={{{keys[0]}:.4f}}'`, for flat `*.ckpt` files."
            )


def _check_supported(strategy: Any, slicer: BatchSlicer, trainer: Trainer) -> None:
    """Refuse what accumulation cannot work with: a strategy that accumulates itself, slices in a manual loop, a
    closure-re-evaluating optimizer at ``A > 1``."""
    if getattr(strategy, "handles_gradient_accumulation", False):
        raise RuntimeError(
            f"{type(strategy).__name__} cannot work on a strategy that handles gradient accumulation itself"
            " (`handles_gradient_accumulation=True`, e.g. DeepSpeed). Use strategy='accum' or 'accum_ddp'."
        )
    if slicer.enabled and not trainer.lightning_module.automatic_optimization:
        raise ValueError(
            f"`microbatch_size={slicer.log.configured!r}` cuts the loader's batch inside Lightning's"
            " automatic optimization, but this LightningModule sets `automatic_optimization = False`. In a"
            " manual loop, cut the batch yourself and report every slice with `strategy.accumulate(...)`, or"
            " pass `microbatch_size=None`."
        )
    accumulate = trainer.accumulate_grad_batches
    if not trainer.lightning_module.automatic_optimization or accumulate == 1:
        return
    for optimizer in trainer.optimizers:
        if isinstance(optimizer, CLOSURE_EVALUATING):
            raise ValueError(reevaluation_message(type(optimizer).__name__, accumulate))
