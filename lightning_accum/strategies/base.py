"""The one package layer of every accumulation strategy: Lightning's hooks, each delegating to a composed part.

Every public strategy is ``(ExactAccumulation, <Lightning's strategy>)``: this class overrides every Lightning hook
the package changes, and its ``super()`` is the single-device, DDP or model-parallel strategy underneath. Lightning's
own loop stays; three hooks change what is computed: ``training_step`` (read the micro-batch once and prepare
``loss · w / c``), ``backward`` (back-propagate that tensor instead of ``loss / A``) and ``optimizer_step`` (the
closure closes the group inside the optimizer's step). With ``automatic_optimization = False`` every hook passes
through; a manual loop uses :meth:`ExactAccumulation.accumulate` and :meth:`ExactAccumulation.close_group`. The parts
and their jobs: docs/internals.md.

The strategies' constructors repeat the options of :class:`~lightning_accum.options.AccumulationOptions` one by one
on purpose: LightningCLI (jsonargparse) builds a strategy from the parameters its ``__init__`` declares, so options
hidden in ``**kwargs`` would vanish from ``--help`` and from config validation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any, ClassVar

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_accum.batch_schedule import BatchSchedule, as_schedule
from lightning_accum.core.adapter import EngineAdapter, NamedParameters, optimized_parameters
from lightning_accum.core.checkpoint import CHECKPOINT_KEY
from lightning_accum.core.closing import enabled_scaler
from lightning_accum.core.core import CLOSE_GROUP_DOC, AccumulationCore, CoreSeam
from lightning_accum.core.lifecycle import GroupState
from lightning_accum.engine import AccumulationEngine
from lightning_accum.ledger import GroupRecord
from lightning_accum.options import AccumulationOptions
from lightning_accum.slicing import MicrobatchSize, SlicingLog, SplitBatch
from lightning_accum.strategies.automatic import AutomaticSteps
from lightning_accum.strategies.checkpoint import TrainerCheckpoint
from lightning_accum.strategies.evaluation import ExactEvaluation
from lightning_accum.strategies.group_boundaries import GroupBoundaries
from lightning_accum.strategies.run import TrainerRun
from lightning_accum.strategies.scheduled_groups import ScheduledGroups
from lightning_accum.strategies.slicing import BatchSlicer
from lightning_accum.strategies.token_groups import TokenGroups
from lightning_accum.strategies.trainer_side import TrainerSide
from lightning_accum.token_batches import TokenBatches, TokenBatchSampler

__all__ = ["CHECKPOINT_KEY", "ExactAccumulation"]

_Path = str | Path  # what Lightning's checkpoint methods accept


class ExactAccumulation(Strategy, CoreSeam):
    """The public base of the accumulation strategies: every hook they change, and the interface callbacks and manual
    loops program against (``isinstance(trainer.strategy, ExactAccumulation)``; docs/internals.md, "The public seam").
    Listed first in a strategy's bases: ``super()`` is the single-device, DDP or model-parallel strategy."""

    #: The class of this strategy's :class:`~lightning_accum.core.adapter.EngineAdapter`.
    adapter_type: ClassVar[type[EngineAdapter]] = EngineAdapter
    #: The class of this strategy's :class:`~lightning_accum.strategies.trainer_side.TrainerSide`.
    side_type: ClassVar[type[TrainerSide]] = TrainerSide

    def _init_accumulation(
        self,
        options: AccumulationOptions,
        microbatch_size: MicrobatchSize = None,
        split_batch: SplitBatch | None = None,
        batch_schedule: BatchSchedule | Mapping[int, int] | str | None = None,
        token_batches: TokenBatches | None = None,
    ) -> None:
        """Set up the parts from the options the constructor validated (before Lightning's ``__init__``)."""
        self._core = AccumulationCore(self, self.adapter_type, options)
        self._core.parameters = self._parameters
        self._core.automatic = self._automatic  # the manual API is refused in automatic optimization
        self._side = self.side_type(self, self._core.adapter)
        self._slicer = BatchSlicer(microbatch_size, split_batch, self._side, options.normalize)
        self._steps = AutomaticSteps(self._core, self._slicer)
        self._evaluation = ExactEvaluation()
        self._scheduled = ScheduledGroups(as_schedule(batch_schedule))  # the groups' sizes under `batch_schedule=`
        self._groups = GroupBoundaries()  # where the fit's groups start and end
        self._tokens = TokenGroups(token_batches, self._scheduled)  # the training loader cut by tokens
        self._run = TrainerRun(  # what `setup` binds, what a fit starts with, and their end at `teardown`
            self, self._core, self._slicer, self._scheduled, self._tokens, self._groups, self._evaluation
        )
        self._checkpoints = TrainerCheckpoint(
            self, self._core, self._side, self._slicer, self._run.attached_trainer, self._scheduled
        )
        self._agreement: Callable[[Trainer], None] | None = None  # the adapter's, before each micro-batch of the fit

    # ------------------------------------------------------------------ the public interface

    @property
    def slicing(self) -> SlicingLog:
        """This rank's record of ``microbatch_size=``: the size in force, realized slice sizes, out-of-memory retries
        (see :class:`~lightning_accum.slicing.SlicingLog`)."""
        return self._slicer.log

    @property
    def batch_schedule(self) -> BatchSchedule | None:
        """The schedule of the global batch given as ``batch_schedule=``, or ``None``."""
        return self._scheduled.schedule

    @property
    def batch_stages(self) -> list[dict[str, int]]:
        """Per stage of :attr:`batch_schedule` the fit reached, in order: ``stage`` (its index), ``threshold``,
        ``samples_per_update`` (its batch; ``tokens_per_update`` too for a batch stated in tokens),
        ``accumulate_grad_batches`` (``A``, its latest group's micro-batches per replica: its batch over ``m × D``),
        and what its groups consumed: ``attempts``, ``updates`` (applied), ``samples``, ``tokens`` (over all
        replicas; a dropped partial group adds nothing). Checkpoints carry it: a fit resumed from one continues the
        record of the run that wrote it (see :mod:`~lightning_accum.strategies.scheduled_groups`). Empty without a
        schedule."""
        return [dict(stage) for stage in self._scheduled.stages]

    @property
    def token_batches(self) -> TokenBatches | None:
        """The :class:`~lightning_accum.TokenBatches` given as ``token_batches=``, or ``None``."""
        return self._tokens.options

    @property
    def token_sampler(self) -> TokenBatchSampler | None:
        """The training loader's :class:`~lightning_accum.TokenBatchSampler` under ``token_batches=`` (its plan:
        ``group_sizes()``, ``group_stats()``), else ``None``."""
        return self._tokens.sampler

    @property
    def evaluation_findings(self) -> dict[str, str | None]:
        """Per evaluated stage (``"validate"``, ``"test"``): why its exact loss (``accum/val_loss``,
        ``accum/test_loss``) was not logged, or ``None`` when it was; see
        :mod:`~lightning_accum.strategies.evaluation`."""
        return dict(self._evaluation.findings)

    @property
    def gradient_scaler(self) -> torch.amp.GradScaler | None:
        """The enabled GradScaler of the precision plugin, or ``None``."""
        return enabled_scaler(self.precision_plugin)

    @contextmanager
    def use_engine(self, engine: AccumulationEngine, slicing: bool = True) -> Iterator[AccumulationEngine]:
        """Run the strategy's hooks on ``engine`` (e.g. :meth:`AccumulationEngine.scratch`) inside the block, so
        the run's ledger, open group and pending resume are not touched. ``slicing=False``: a batch given to
        ``training_step`` in the block is run whole even with ``microbatch_size=`` (for a plain-autograd
        reference); with ``True`` it is cut as in the run (the slicing record is not touched either way)."""
        with self._core.aside(engine), self._slicer.aside(enabled=slicing):
            yield engine

    @contextmanager
    def one_batch_reference(self) -> Iterator[AccumulationEngine]:
        """Run the strategy's hooks inside the block as training *without* accumulation on this replica: on an
        :meth:`AccumulationEngine.unweighted` engine (``training_step`` returns the loss as it is, ``backward``
        back-propagates it), the batch not cut into slices, no gradient synchronisation over replicas, and
        ``trainer.accumulate_grad_batches`` reading 1 (code that divides its loss by it sees what that run would see).
        Everything is restored after the block; :class:`~lightning_accum.AccumulationCheck` computes its one-batch
        gradient this way."""
        trainer = self._trainer()
        accumulate = trainer.accumulate_grad_batches
        trainer.accumulate_grad_batches = 1
        try:
            with self.use_engine(AccumulationEngine.unweighted(), slicing=False) as engine, self.no_backward_sync():
                yield engine
        finally:
            trainer.accumulate_grad_batches = accumulate

    # ------------------------------------------------------------------ hooks of every micro-batch

    def _trainer(self) -> Trainer:
        """The Trainer running the strategy: the one accessor (the hot path reads ``self._run.trainer`` inline)."""
        trainer = self._run.attached_trainer()
        assert trainer is not None, "the strategy runs without a Trainer"
        return trainer

    def _automatic(self) -> bool:
        module = self.lightning_module
        return module is None or module.automatic_optimization

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        # The hooks of every micro-batch read the module and the Trainer inline: no package call on the hot path.
        module = self.lightning_module
        if module is not None and not module.automatic_optimization:
            if self._core.group.state is GroupState.LOADED:
                # A manual loop resumes at the micro-batch after the checkpoint, as a Fabric loop does: the group it
                # was written in is reopened there (position 0) and closed by the loop's own `close_group`.
                self._core.reopen(self._checkpoints.configuration(), 0, self._parameters())
            return super().training_step(*args, **kwargs)  # Lightning's behaviour; see `accumulate`
        trainer = self._run.trainer if self._run.trainer is not None else self._trainer()
        if self._agreement is not None and not self._core.checking:
            self._agreement(trainer)
        batch_idx = trainer.fit_loop.epoch_loop.batch_idx  # the index Lightning's hooks of this batch receive
        accumulate = trainer.accumulate_grad_batches
        core, groups = self._core, self._groups
        if core.group.state is GroupState.LOADED:
            position = groups.position(batch_idx, accumulate)  # the group's micro-batches Lightning ran already
            core.reopen(self._checkpoints.configuration(), position, self._parameters())
        engine = core.engine
        if core.group.state is GroupState.OPEN and groups.position(batch_idx, accumulate) == 0:
            _end_group_of_a_short_loader(core)
        if core.group.state is GroupState.IDLE:
            core.group.open()
        if self._slicer.enabled:
            position = groups.position(batch_idx, accumulate)
            return self._slicer.training_step(
                self, super().training_step, args, kwargs, batch_idx, accumulate, position
            )
        output = super().training_step(*args, **kwargs)
        # An output Lightning rejects (not a tensor, a mapping with "loss", or None) is read as "no loss"; Lightning
        # raises its own MisconfigurationException for it right after this hook. The micro-batch is read once here.
        # A = 1 (the batch not cut into slices, nothing carried in): the group's only micro-batch (c = w, no factor).
        sole = accumulate == 1 and core.group.carried is None
        engine.record(engine.read(output, args[0] if args else kwargs.get("batch")), accumulate, sole=sole)
        return output

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        if self._core.group.state is GroupState.REOPENED:  # a resumed group's gradient, added before its first backward
            self._core.install_carried()
        lightning_backward = super().backward
        module = self.lightning_module
        if module is not None and not module.automatic_optimization:
            # `manual_backward`: the tensor is back-propagated as given (the open group notes `accumulate`'s).
            return self._core.backward(  # type: ignore[no-any-return]
                closure_loss,
                lambda: lightning_backward(closure_loss, optimizer, *args, **kwargs),
                self._side.sync_blocked(),
            )
        engine = self._core.engine
        tensor = engine.take_backward_tensor()
        loss = tensor if tensor is not None else closure_loss
        if self._slicer.enabled:
            result = self._slicer.backward(
                self,
                loss,
                optimizer,
                lambda t: lightning_backward(t, optimizer, *args, **kwargs),
                synchronised=self._side.synchronises(self._trainer()),
                args=args,
                kwargs=kwargs,
                lightning_loss=closure_loss,
            )
        else:
            result = lightning_backward(loss, optimizer, *args, **kwargs)
        engine.backward_finished()
        return result

    # ------------------------------------------------------------------ the update

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        lightning_step = super().optimizer_step
        module = self.lightning_module
        if module is not None and not module.automatic_optimization:
            return self._core.optimizer_step(
                optimizer, closure, self.gradient_scaler, lambda: lightning_step(optimizer, closure, model, **kwargs)
            )
        # The group closes inside the optimizer's step, right after Lightning's closure (see `strategies/automatic`).
        trainer = self._run.trainer if self._run.trainer is not None else self._trainer()
        schedule = self._scheduled.schedule
        if schedule is not None and schedule.lr_scaling is not None:  # the stage's learning-rate factor
            with self._scheduled.scaled_lr(optimizer):
                return self._steps.optimizer_step(
                    self, optimizer, closure, trainer, lambda c: lightning_step(optimizer, c, model, **kwargs)
                )
        # Without a factor, no context: a `nullcontext` would add two calls to every update.
        return self._steps.optimizer_step(
            self, optimizer, closure, trainer, lambda c: lightning_step(optimizer, c, model, **kwargs)
        )

    # ------------------------------------------------------------------ manual optimization

    def close_group(self, optimizer: Optimizer | LightningOptimizer, group_size: int | None = None) -> GroupRecord:
        inner = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        return self._core.close_group(inner, self.lightning_module, self.gradient_scaler, group_size, self.optimizers)

    close_group.__doc__ = CLOSE_GROUP_DOC

    def no_backward_sync(self, enabled: bool = True) -> AbstractContextManager[Any]:
        """A block whose backward passes do not synchronize gradients over replicas (DDP's ``no_sync``).

        For manual loops: every micro-batch of a group but its last runs its forward and backward inside it, as
        Lightning does in automatic optimization; a no-op on one replica, or when ``enabled`` is False.
        """
        block = getattr(self, "block_backward_sync", None)  # ParallelStrategy's; one device has none
        if not enabled or block is None or self._core.adapter.data_parallel_size == 1:
            return nullcontext()
        return block()  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ evaluation

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().validation_step(*args, **kwargs)
        self._evaluation.step(output, args, kwargs, self._core.engine)
        return output

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().test_step(*args, **kwargs)
        self._evaluation.step(output, args, kwargs, self._core.engine)
        return output

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._evaluation.start("validate", self.lightning_module, self._core.engine, self._core.adapter)

    @override
    def on_test_start(self) -> None:
        super().on_test_start()
        self._evaluation.start("test", self.lightning_module, self._core.engine, self._core.adapter)

    @override
    def on_validation_end(self) -> None:
        self._evaluation.end()
        super().on_validation_end()

    @override
    def on_test_end(self) -> None:
        self._evaluation.end()
        super().on_test_end()

    # ------------------------------------------------------------------ data

    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        return self._run.training_loader(dataloader)  # global_order=, token_batches=

    # ------------------------------------------------------------------ checkpoints

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _Path, storage_options: Any | None = None) -> None:
        self._checkpoints.save(checkpoint, filepath, storage_options, super().save_checkpoint)

    @override
    def load_checkpoint(self, checkpoint_path: _Path, weights_only: bool | None = None) -> dict[str, Any]:
        return self._checkpoints.load(checkpoint_path, weights_only, super().load_checkpoint)

    def _parameters(self) -> NamedParameters:
        """The optimized parameters by name, in a fixed order (the same on every replica)."""
        module = self.lightning_module
        assert module is not None
        return optimized_parameters([module], self.optimizers)

    # ------------------------------------------------------------------ the run

    @override
    def setup(self, trainer: Trainer) -> None:
        self._side.setup(trainer)
        with self._run.configuring(trainer):
            super().setup(trainer)
        self._run.setup(trainer)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self._trainer()
        self._run.start_fit(trainer)
        self._side.on_train_start(trainer)
        self._agreement = self._side.microbatch_agreement()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        trainer = self._run.trainer if self._run.trainer is not None else self._trainer()
        groups = self._groups
        if trainer.accumulate_grad_batches != groups.accumulate:  # after the callbacks' and the module's hooks
            groups.written(trainer, batch_idx)  # taken at an epoch's first batch without a schedule, else refused
        if groups.sizer is not None and not 0 <= batch_idx - groups.first < groups.size:
            groups.begin(trainer, batch, batch_idx, self._core.group.loaded)  # a group starts: sized

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        self._core.engine.decisions.check_progress()  # no update applied is an error (every rank has the same ledger)

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._run.failed = True
        super().on_exception(exception)
        self._side.on_exception(exception)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if self._side.peers_lost is not None:
            return  # a replica is gone or unreachable: waiting for it would replace the user's error by a second one
        super().barrier(*args, **kwargs)  # type: ignore[safe-super]  # the Lightning strategy underneath defines it

    @override
    def teardown(self) -> None:
        self._run.end(self._core.checking)  # what the entry point made ends with it
        self._side.teardown()
        self._agreement = None
        super().teardown()


def _end_group_of_a_short_loader(core: AccumulationCore) -> None:
    """Lightning starts a group (and zeroes the gradient) while the previous one never reached an optimizer step: the
    loader yielded fewer batches than its length announced, so Lightning's epoch ended early."""
    lost = core.group.end("the training loader ended early")
    rank_zero_warn(
        f"lightning_accum: {lost} micro-batch(es) at the end of the previous epoch never reached an optimizer"
        " step: the training loader ended before the number of batches it announced (`len()`), and"
        " Lightning only steps on the batch it expects to be last. Their gradient is discarded and the"
        " ledger does not count them. Make the loader's length match what it yields."
    )
