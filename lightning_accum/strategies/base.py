"""The base every accumulation strategy shares: Lightning's hooks adapted to one :class:`AccumulationEngine`.

Lightning's own loop stays (zero_grad at a group's start, ``no_sync`` on non-final micro-batches, the precision
plugin's unscale, clipping and step); three strategy hooks change:

* ``training_step``: read the micro-batch's loss and unit count and prepare ``loss · w / c``;
* ``backward``: back-propagate that tensor instead of Lightning's ``loss / A``;
* ``optimizer_step``: after the group's last backward, reduce the group's counters once, rescale the
  gradient by ``c · D / W`` (before unscale and clipping), then update, skip or drop.

``trainer.global_step`` keeps Lightning's meaning (optimizer-step calls, a dropped partial group
included); exact counts are in :attr:`ExactAccumulation.ledger`.

Checkpoints hold the ledger and ``c`` under the key ``"lightning_accum"``; one written inside a group also
carries that group (its counters and its gradient summed over replicas), so a run resumed from it closes the
group exactly; what cannot be carried is reported when writing and when resuming.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_accum.axis_lr import bind_schedulers
from lightning_accum.decision import GroupOutcome
from lightning_accum.engine import AccumulationEngine, GroupListener, Replicas
from lightning_accum.gradients import scaler_skipped, summed_gradients
from lightning_accum.group import group_position
from lightning_accum.ledger import AccumulationLedger
from lightning_accum.microbatch import Count
from lightning_accum.schedules import release_schedulers, take_over_schedulers

__all__ = ["CHECKPOINT_KEY", "ExactAccumulation"]

#: Key of the strategy's state in checkpoints written through the strategy.
CHECKPOINT_KEY = "lightning_accum"

_Path = str | Path  # what Lightning's checkpoint methods accept


class ExactAccumulation(Strategy):
    """The public base of the accumulation strategies: the hooks they share and the interface callbacks use.

    Listed first in a strategy's bases so that its overrides wrap the Lightning strategy's own methods
    (``super()`` is the single-device or DDP strategy in the method resolution order). Callbacks and user code
    program against this class: ``isinstance(trainer.strategy, ExactAccumulation)``, then :attr:`ledger`,
    :attr:`data_parallel_replicas`, :meth:`add_group_listener` / :meth:`remove_group_listener`,
    :meth:`reduce_sum`, :attr:`gradient_scaler` and :meth:`use_engine`.
    """

    _engine: AccumulationEngine

    def _init_engine(
        self,
        normalize: str,
        count_tokens: Callable[[Any], Count] | None,
        partial_group: str,
        schedule_on: str,
        on_nonfinite: str,
        max_consecutive_skips: int | None,
    ) -> None:
        self._engine = AccumulationEngine(
            normalize=normalize,
            count_tokens=count_tokens,
            partial_group=partial_group,
            schedule_on=schedule_on,
            on_nonfinite=on_nonfinite,
            max_consecutive_skips=max_consecutive_skips,
        )
        self._engine.bind(info=rank_zero_info, warn=rank_zero_warn)
        self._scheduled: list[Any] = []
        self._resumed_group: dict[str, Any] | None = None
        self._trainer_ref: Trainer | None = None  # set in `setup`: the hooks of every micro-batch read it

    # ------------------------------------------------------------------ the public interface

    @property
    def ledger(self) -> AccumulationLedger:
        """Exact global counters of the run (identical on every rank); see :class:`AccumulationLedger`."""
        return self._engine.ledger

    @property
    def engine(self) -> AccumulationEngine:
        """The object that does the arithmetic and holds the options given to the strategy."""
        return self._engine

    @property
    def data_parallel_replicas(self) -> int:
        """``D``: the number of replicas that see different data and whose gradients are averaged."""
        return 1

    def reduce_sum(self, tensor: Tensor) -> Tensor:
        """Sum ``tensor`` in place over the data-parallel replicas (a collective when ``D > 1``); return it."""
        return tensor

    @property
    def gradient_scaler(self) -> torch.amp.GradScaler | None:
        """The enabled GradScaler of the precision plugin, or ``None``."""
        scaler = getattr(self.precision_plugin, "scaler", None)
        return scaler if isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled() else None

    def add_group_listener(self, listener: GroupListener) -> None:
        """Call ``listener(record, batch_samples)`` after every closed group; see
        :meth:`AccumulationEngine.add_listener`."""
        self._engine.add_listener(listener)

    def remove_group_listener(self, listener: GroupListener) -> None:
        """Stop calling ``listener``."""
        self._engine.remove_listener(listener)

    @contextmanager
    def use_engine(self, engine: AccumulationEngine) -> Iterator[AccumulationEngine]:
        """Run the strategy's hooks on ``engine`` (e.g. :meth:`AccumulationEngine.scratch`) inside the block, so
        the run's ledger, open group and pending resume are not touched."""
        real, resumed = self._engine, self._resumed_group
        self._engine, self._resumed_group = engine, None
        try:
            yield engine
        finally:
            self._engine, self._resumed_group = real, resumed

    # ------------------------------------------------------------------ hooks

    def _trainer(self) -> Trainer:
        if self._trainer_ref is not None:
            return self._trainer_ref
        module = self.lightning_module
        assert module is not None
        return module.trainer

    def _check_supported(self, trainer: Trainer) -> None:
        module = trainer.lightning_module
        if not module.automatic_optimization:
            raise RuntimeError(
                f"{type(self).__name__} supports automatic optimization only, but "
                f"`{type(module).__name__}.automatic_optimization` is False. With manual optimization you own the"
                " accumulation loop: use a Lightning strategy such as 'auto' or 'ddp', or switch to automatic"
                " optimization to get exact accumulation."
            )
        if getattr(self, "handles_gradient_accumulation", False):
            raise RuntimeError(
                f"{type(self).__name__} cannot work on a strategy that handles gradient accumulation itself"
                " (`handles_gradient_accumulation=True`, e.g. DeepSpeed). Use strategy='accum' or 'accum_ddp'."
            )

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        trainer = self._trainer()
        batch_idx = trainer.fit_loop.epoch_loop.batch_idx  # the index Lightning's hooks of this batch receive
        if self._resumed_group is not None or (
            self._engine.microbatches_in_group and group_position(batch_idx, trainer.accumulate_grad_batches) == 0
        ):
            self._check_group_start(trainer, batch_idx)
        output = super().training_step(*args, **kwargs)
        batch = args[0] if args else kwargs.get("batch")
        self._engine.add_microbatch(output, batch, accumulate=trainer.accumulate_grad_batches)
        return output

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        tensor = self._engine.take_backward_tensor()
        result = super().backward(tensor if tensor is not None else closure_loss, optimizer, *args, **kwargs)
        self._engine.backward_finished()
        return result

    def _gradients(self, optimizer: Optimizer) -> list[Tensor]:
        return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]

    def _first_nonfinite_name(self, optimizer: Optimizer) -> str:
        module = self.lightning_module
        names = {id(p): name for name, p in module.named_parameters()} if module is not None else {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
                    return f"`{names.get(id(p), 'unnamed parameter')}` (shape {tuple(p.shape)})"
        return "none found after the reduction"

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        # Lightning calls this once per group, on its last micro-batch; the closure runs that micro-batch's
        # training_step and backward. Running it first lets the group close before unscale and clipping.
        closure_result = closure()
        trainer = self._trainer()
        scaler = self.gradient_scaler
        # The engine rescales the gradient by c·D/W on the device and, without a GradScaler (which finds
        # non-finite gradients itself: skip reason "overflow"), checks it for NaN/Inf in the same pass.
        outcome = self._engine.close_group(
            accumulate=trainer.accumulate_grad_batches,
            ends_epoch=bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch),
            gradients=self._gradients(optimizer),
            check_gradients=scaler is None and self._engine.on_nonfinite != "ignore",
            describe_nonfinite=lambda: self._first_nonfinite_name(optimizer),
        )
        if outcome.action != "apply":
            optimizer.zero_grad(set_to_none=True)
            self._finish(outcome, applied=False)
            return closure_result

        # GradScaler's `_scale` (private) is read on the device before and after its update: the skip is known
        # from one host read per update, for every optimizer, fused ones included (see docs: private names).
        scale_before = scaler._scale.clone() if scaler is not None and scaler._scale is not None else None
        output = super().optimizer_step(optimizer, lambda: closure_result, model, **kwargs)
        if scale_before is None or scaler is None or scaler._scale is None:
            self._finish(outcome, applied=True)
            return output
        before, after = torch.stack([scale_before, scaler._scale.to(scale_before)]).tolist()
        outcome.record.grad_scale = before
        self._finish(outcome, applied=not scaler_skipped(before, after), skip_reason="overflow")
        return output

    def _finish(self, outcome: GroupOutcome, applied: bool, skip_reason: str | None = None) -> None:
        record = self._engine.finish_group(outcome, applied=applied, skip_reason=skip_reason)
        module = self.lightning_module
        if module is None:
            return
        for config in self._scheduled:
            if self._engine.schedule_due(record, config.frequency):
                config.scheduler.advance(lambda scheduler: module.lr_scheduler_step(scheduler, None))

    @override
    def setup(self, trainer: Trainer) -> None:
        super().setup(trainer)
        self._trainer_ref = trainer
        self._engine.bind(self.root_device, Replicas(self.data_parallel_replicas, self.reduce_sum))
        bind_schedulers(self.lr_scheduler_configs, self._engine)  # AxisLR counts what each applied update consumed
        self._scheduled = take_over_schedulers(self.lr_scheduler_configs)

    @override
    def teardown(self) -> None:
        release_schedulers(self.lr_scheduler_configs)
        self._scheduled = []
        self._trainer_ref = None
        super().teardown()

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self._trainer()
        self._check_supported(trainer)
        self._engine.warn_short_epoch(trainer.num_training_batches, trainer.accumulate_grad_batches)

    # ------------------------------------------------------------------ checkpoints

    def _group_parameters(self) -> list[tuple[str, Tensor]]:
        """The optimized parameters by name, in a fixed order (the same on every replica)."""
        module = self.lightning_module
        assert module is not None
        optimized = {
            id(p) for optimizer in self.optimizers for group in optimizer.param_groups for p in group["params"]
        }
        return [(name, p) for name, p in module.named_parameters() if id(p) in optimized]

    def _open_group_gradients(self) -> dict[str, Tensor] | None:
        """The open group's gradient summed over replicas, by parameter name, for a checkpoint written inside a
        group (a collective: every replica calls it); ``None`` where the strategy cannot carry it (it says why)."""
        reduce = self.reduce_sum if self.data_parallel_replicas > 1 else None
        return summed_gradients(self._group_parameters(), reduce)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _Path, storage_options: Any | None = None) -> None:
        state = self._engine.state_dict()
        open_microbatches = self._engine.microbatches_in_group
        state["open_group_microbatches"] = open_microbatches
        if open_microbatches:
            # Written inside a group (OnExceptionCheckpoint, SIGTERM, a time-based or hand-written checkpoint):
            # carry the group's counters and its accumulated gradient, so that a run resumed from this file
            # finishes the group exactly (see `_check_group_start`). Every replica takes part (collectives).
            group = self._engine.open_group_state()
            gradients = self._open_group_gradients()
            if gradients is not None and group["consistent"]:
                group["gradients"] = gradients
            elif gradients is not None:
                rank_zero_warn(
                    "lightning_accum: this checkpoint is written while a micro-batch's backward had not completed;"
                    f" the open group's {open_microbatches} micro-batch(es) cannot be carried exactly and a run resumed"
                    " from it will say how many of them are lost."
                )
            state["open_group"] = group
            progress = self._trainer().fit_loop.epoch_loop.batch_progress.current
            if progress.ready > getattr(progress, "processed", progress.ready):
                rank_zero_warn(
                    f"lightning_accum: this checkpoint is written while micro-batch {progress.ready} of the epoch was"
                    " running. Lightning runs it again on resume, but a training loader that saves its position"
                    " (`state_dict`) already counts it as consumed, so it then delivers the next batch: that"
                    " micro-batch's examples are skipped (Lightning's behaviour, not this strategy's)."
                )
        checkpoint[CHECKPOINT_KEY] = state
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _Path, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint: dict[str, Any] = super().load_checkpoint(checkpoint_path, weights_only)
        if CHECKPOINT_KEY in checkpoint:
            state = checkpoint[CHECKPOINT_KEY]
            self._engine.load_state_dict(state)
            # Checked against the loop's position at the first micro-batch of the resumed run.
            self._resumed_group = dict(state.get("open_group") or {"microbatches": 0})
        return checkpoint

    def _check_group_start(self, trainer: Trainer, batch_idx: int) -> None:
        """At the first micro-batch after a resume, reopen the group the checkpoint carries; at a group's first
        micro-batch, discard a group Lightning never stepped. Runs in ``training_step``, before Lightning zeroes the
        gradient at a group's start (no hook of its own on every micro-batch)."""
        if self._resumed_group is not None:
            group, self._resumed_group = self._resumed_group, None
            self._reopen_group(group, batch_idx)
        if self._engine.microbatches_in_group and group_position(batch_idx, trainer.accumulate_grad_batches) == 0:
            # Lightning starts a group (and zeroes the gradient) while the previous one never reached an optimizer
            # step: the loader yielded fewer batches than its length announced, so Lightning's epoch ended early.
            lost = self._engine.discard_open_group()
            rank_zero_warn(
                f"lightning_accum: {lost} micro-batch(es) at the end of the previous epoch never reached an optimizer"
                " step: the training loader ended before the number of batches it announced (`len()`), and Lightning"
                " only steps on the batch it expects to be last. Their gradient is discarded and the ledger does not"
                " count them. Make the loader's length match what it yields."
            )

    def _reopen_group(self, group: dict[str, Any], batch_idx: int) -> None:
        """Finish, exactly, the group a checkpoint was written in; or say which micro-batches are lost."""
        carried = int(group["microbatches"])
        position = group_position(batch_idx, self._trainer().accumulate_grad_batches)  # ran by Lightning already
        if position == 0 and carried == 0:
            return
        if position == carried and "gradients" in group:
            holder = self.is_global_zero  # one replica carries the sums and the gradient; DDP adds the others'
            self._engine.resume_open_group(group, holds_sums=holder)
            gradients: dict[str, Tensor] = group["gradients"]
            for name, p in self._group_parameters():
                saved = gradients.get(name) if holder else None
                p.grad = saved.to(device=p.device, dtype=p.dtype, copy=True) if saved is not None else None
            rank_zero_info(
                f"lightning_accum: resumed inside an accumulation group; its first {carried} micro-batch(es) come from"
                " the checkpoint (gradient and counters), so the group closes exactly."
            )
            return
        self._engine.note_missing_microbatches(position)
        reason = " without a consistent gradient" if carried and "gradients" not in group else ""
        rank_zero_warn(
            f"lightning_accum: resumed at micro-batch {position + 1} of an accumulation group, but the checkpoint"
            f" carries {carried} micro-batch(es) of that group{reason}, so none are carried over. The first {position}"
            " micro-batch(es) of the group, which Lightning does not run again, are not in its update (normalized by"
            " what remains). Checkpoints written between micro-batches (on_train_batch_end, OnExceptionCheckpoint"
            " after a failed hook there, SIGTERM) or at update boundaries resume exactly."
        )
