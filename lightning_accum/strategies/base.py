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

import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any, ClassVar

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_accum.batch_schedule import BatchSchedule, as_schedule
from lightning_accum.carry import Carried
from lightning_accum.core.adapter import EngineAdapter, NamedParameters, optimized_parameters
from lightning_accum.core.checkpoint import CHECKPOINT_KEY
from lightning_accum.core.closing import enabled_scaler
from lightning_accum.core.core import CLOSE_GROUP_DOC, AccumulationCore, CoreSeam
from lightning_accum.core.lifecycle import GroupState
from lightning_accum.engine import AccumulationEngine
from lightning_accum.ledger import GroupRecord
from lightning_accum.options import AccumulationOptions
from lightning_accum.schedules import UpdateSchedules, bind_schedulers
from lightning_accum.slicing import MicrobatchSize, SlicingLog, SplitBatch
from lightning_accum.strategies.automatic import CLOSURE_EVALUATING, AutomaticSteps, reevaluation_message
from lightning_accum.strategies.checkpoint import TrainerCheckpoint
from lightning_accum.strategies.evaluation import ExactEvaluation
from lightning_accum.strategies.global_order import install_global_order
from lightning_accum.strategies.group_boundaries import GroupBoundaries, UnknownUpdates
from lightning_accum.strategies.precision_clipping import PrecisionClipping
from lightning_accum.strategies.scheduled_groups import ScheduledGroups
from lightning_accum.strategies.slicing import BatchSlicer
from lightning_accum.strategies.token_groups import TokenGroups
from lightning_accum.strategies.trainer_side import TrainerSide
from lightning_accum.token_batches import TokenBatches, TokenBatchSampler

__all__ = ["CHECKPOINT_KEY", "ExactAccumulation"]

_Path = str | Path  # what Lightning's checkpoint methods accept


class ExactAccumulation(Strategy, CoreSeam):
    """The public base of the accumulation strategies: every hook they change, and the interface callbacks use.

    Listed first in a strategy's bases so that its hooks wrap the Lightning strategy's own methods (``super()`` is the
    single-device, DDP or model-parallel strategy). Callbacks and user code program against this class:
    ``isinstance(trainer.strategy, ExactAccumulation)``, then :attr:`ledger`, :attr:`data_parallel_replicas`,
    :attr:`tensor_parallel_size`, :attr:`slicing`, :meth:`add_group_listener` / :meth:`remove_group_listener`,
    :meth:`reduce_sum`, :attr:`gradient_scaler`, :meth:`use_engine` and :meth:`one_batch_reference`; manual loops use
    :meth:`accumulate`, :meth:`close_group` and :meth:`no_backward_sync`. What differs per engine is the strategy's
    core's adapter, of the class it names in :attr:`adapter_type` (see :mod:`~lightning_accum.core.adapter`), and what
    only a Trainer asks of an engine its :attr:`side_type` (see :mod:`~lightning_accum.strategies.trainer_side`).
    """

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
        if microbatch_size is not None and options.normalize == "batches":
            raise ValueError(
                f"`microbatch_size={microbatch_size!r}` cannot be combined with `normalize='batches'`: a loader batch"
                " cut into slices must keep its weight, but 'batches' would weigh every slice 1. Use"
                " `normalize='samples'` (a mean loss over samples), 'tokens' (report `num_tokens`), or 'auto'."
            )
        self._core = AccumulationCore(self, self.adapter_type, options)
        self._core.parameters = self._parameters
        self._core.automatic = self._automatic  # the manual API is refused in automatic optimization
        self._slicer = BatchSlicer(microbatch_size, split_batch)
        self._steps = AutomaticSteps()
        self._evaluation = ExactEvaluation()
        self._side = self.side_type(self, self._core.adapter)
        self._scheduled = ScheduledGroups(as_schedule(batch_schedule))  # the groups' sizes under `batch_schedule=`
        self._groups = GroupBoundaries()  # where the fit's groups start and end
        self._tokens = TokenGroups(token_batches, self._scheduled)  # the training loader cut by tokens
        self._checkpoints = TrainerCheckpoint(
            self, self._core, self._side, self._slicer, self._attached_trainer, self._scheduled
        )
        self._trainer_ref: Trainer | None = None  # set in `setup`: the hooks of every micro-batch read it
        self._agreement: Callable[[Trainer], None] | None = None  # the adapter's, before each micro-batch of the fit
        self._aside = False  # inside `use_engine`: the hooks run for a check, not for the run
        self._failed = False  # the entry point running raised (Lightning called `on_exception`)
        self._sync_blocked = False  # inside a `block_backward_sync` that blocks FSDP2's reduction (model parallel)
        self._clipping = PrecisionClipping()  # the precision plugin's clip methods, for the run

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
        saved = self._aside
        self._aside = True
        with self._core.aside(engine), self._slicer.aside(enabled=slicing):
            try:
                yield engine
            finally:
                self._aside = saved

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

    def agree_slice_count(self, count: int, num_samples: int) -> int:
        """The slicer's: see :meth:`~lightning_accum.strategies.trainer_side.TrainerSide.agree_slice_count`."""
        return self._side.agree_slice_count(count, num_samples)

    def before_forward_retry(self) -> None:
        """The slicer's: see :meth:`~lightning_accum.strategies.trainer_side.TrainerSide.before_forward_retry`."""
        self._side.before_forward_retry()

    # ------------------------------------------------------------------ hooks of every micro-batch

    def _trainer(self) -> Trainer:
        """The Trainer running the strategy: the one accessor (the hot path reads ``_trainer_ref`` inline)."""
        trainer = self._attached_trainer()
        assert trainer is not None, "the strategy runs without a Trainer"
        return trainer

    def _attached_trainer(self) -> Trainer | None:
        """The Trainer running the strategy (set at ``setup``; before it, the module's), or ``None`` (a module
        connected to the strategy without a Trainer, as Lightning's own strategies allow for ``save_checkpoint``)."""
        if self._trainer_ref is not None:
            return self._trainer_ref
        module = self.lightning_module
        try:
            return module.trainer if module is not None else None
        except RuntimeError:  # "... is not attached to a `Trainer`"
            return None

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
        trainer = self._trainer_ref if self._trainer_ref is not None else self._trainer()
        if self._agreement is not None and not self._aside:
            self._agreement(trainer)
        batch_idx = trainer.fit_loop.epoch_loop.batch_idx  # the index Lightning's hooks of this batch receive
        accumulate = trainer.accumulate_grad_batches
        core, groups = self._core, self._groups
        if core.group.state is GroupState.LOADED:
            position = groups.position(batch_idx, accumulate)  # the group's micro-batches Lightning ran already
            core.reopen(self._checkpoints.configuration(), position, self._parameters())
        engine = core.engine
        if core.group.state is GroupState.OPEN and groups.position(batch_idx, accumulate) == 0:
            # Lightning starts a group (and zeroes the gradient) while the previous one never reached an optimizer
            # step: the loader yielded fewer batches than its length announced, so Lightning's epoch ended early.
            lost = core.group.end("the training loader ended early")
            rank_zero_warn(
                f"lightning_accum: {lost} micro-batch(es) at the end of the previous epoch never reached an optimizer"
                " step: the training loader ended before the number of batches it announced (`len()`), and"
                " Lightning only steps on the batch it expects to be last. Their gradient is discarded and the"
                " ledger does not count them. Make the loader's length match what it yields."
            )
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
                self._gradient_sync_blocked(),
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
        schedule = self._scheduled.schedule
        if schedule is not None and schedule.lr_scaling is not None:  # the stage's learning-rate factor
            with self._scheduled.scaled_lr(optimizer):
                return self._automatic_step(optimizer, closure, lambda c: lightning_step(optimizer, c, model, **kwargs))
        # Without a factor, no context: a `nullcontext` would add two calls to every update.
        return self._automatic_step(optimizer, closure, lambda c: lightning_step(optimizer, c, model, **kwargs))

    def _automatic_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], lightning_step: Callable[[Callable[..., Any]], Any]
    ) -> Any:
        # The group closes inside the optimizer's step, right after Lightning's closure (see `strategies/automatic`).
        trainer = self._trainer_ref if self._trainer_ref is not None else self._trainer()
        return self._steps.optimizer_step(
            self, self._core.closing, optimizer, closure, trainer, self._before_close, lightning_step
        )

    def _before_close(self) -> Carried | None:
        """What a group's close needs first, after Lightning's closure: the gradient of a resumed group whose
        remaining micro-batches had no backward, and a last slice's batch that Lightning did not put back; then the
        group closes in the lifecycle, which hands the close what a checkpoint carried into it."""
        if self._core.group.state is GroupState.REOPENED:
            self._core.install_carried()
        if self._slicer.enabled:
            self._slicer.install_pending()
        return self._core.group.close()

    # ------------------------------------------------------------------ manual optimization

    def close_group(self, optimizer: Optimizer | LightningOptimizer, group_size: int | None = None) -> GroupRecord:
        inner = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        return self._core.close_group(inner, self.lightning_module, self.gradient_scaler, group_size, self.optimizers)

    close_group.__doc__ = CLOSE_GROUP_DOC

    def _gradient_sync_blocked(self) -> bool:
        """Whether a backward run now leaves its gradient uncombined: inside DDP's ``no_sync`` (however it was
        entered: :meth:`no_backward_sync`, Lightning's ``block_backward_sync``, ``self.trainer.model.no_sync()``), or
        inside a ``block_backward_sync`` that holds FSDP2's reduction."""
        model = self.model
        if isinstance(model, DistributedDataParallel):
            return not model.require_backward_grad_sync  # DDP's own flag, False inside `no_sync`
        return self._sync_blocked

    def no_backward_sync(self, enabled: bool = True) -> AbstractContextManager[Any]:
        """A block whose backward passes do not synchronize gradients over replicas (DDP's ``no_sync``).

        For manual loops: every micro-batch of a group but its last runs its forward and backward inside it, as
        Lightning does in automatic optimization; a no-op on one replica, or when ``enabled`` is False.
        """
        block = getattr(self, "block_backward_sync", None)  # ParallelStrategy's; one device has none
        if not enabled or block is None or self.data_parallel_replicas == 1:
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
        tokens = self._tokens.options is not None  # implies `global_order=True`
        if not (tokens or self._core.engine.options.global_order):
            return dataloader
        trainer = self._trainer()
        if trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        layout = getattr(self, "distributed_sampler_kwargs", None)
        if tokens:
            return self._tokens.install(dataloader, trainer, layout)
        return install_global_order(dataloader, trainer, layout)

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
        # In `configure_optimizers` under a schedule or token batches, Lightning's count of updates is wrong: refused.
        given = self._tokens.accumulate = trainer.accumulate_grad_batches
        if trainer.state.fn == TrainerFn.FITTING and self._scheduled.schedule is not None:
            trainer.accumulate_grad_batches = UnknownUpdates()  # type: ignore[assignment]
        elif trainer.state.fn == TrainerFn.FITTING and self._tokens.options is not None:
            trainer.accumulate_grad_batches = UnknownUpdates(self._tokens.refusal)  # type: ignore[assignment]
        try:
            super().setup(trainer)
        finally:
            trainer.accumulate_grad_batches = given
        manual = trainer.lightning_module is not None and not trainer.lightning_module.automatic_optimization
        refuse = self._core.refuse_clipping if manual else None  # automatic optimization clips after the close only
        self._clipping.install(self.precision_plugin, self._core.adapter, refuse)
        self._trainer_ref = trainer
        self._slicer.reset()
        self._core.engine.bind(self.root_device, self._core.adapter.replicas())
        self._core.closing.rank = self._core.adapter.shard_rank()
        bind_schedulers(self.lr_scheduler_configs, self._core.engine)  # AxisLR counts what each applied update consumed
        module = trainer.lightning_module
        if module.automatic_optimization:  # in manual optimization the user steps the schedulers
            self._core.closing.schedules = UpdateSchedules(module, self.lr_scheduler_configs)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self._trainer()
        _check_supported(self, trainer)
        sizer = self._scheduled.start(trainer, self._core, self._slicer.split_batch)
        self._groups.install(trainer, self._tokens.start(trainer) or sizer)
        self.add_group_listener(self._scheduled.on_group)
        _warn_of_slashes_in_checkpoint_names(trainer)
        self._side.on_train_start(trainer)
        self._agreement = self._side.microbatch_agreement()
        if trainer.lightning_module.automatic_optimization and self._tokens.options is None:
            batches, accumulate = trainer.num_training_batches, trainer.accumulate_grad_batches
            self._core.engine.decisions.warn_short_epoch(batches, accumulate, self._core.engine.warn)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        trainer = self._trainer_ref if self._trainer_ref is not None else self._trainer()
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
        self._failed = True
        super().on_exception(exception)
        self._side.on_exception(exception)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if self._side.peers_lost is not None:
            return  # a replica is gone or unreachable: waiting for it would replace the user's error by a second one
        super().barrier(*args, **kwargs)  # type: ignore[safe-super]  # the Lightning strategy underneath defines it

    @override
    def teardown(self) -> None:
        # What one entry point made ends with it: a group the fit left open (it stopped inside it: an exception, a
        # stop requested mid-group) and a checkpoint's group not yet reopened never reach a later fit. After an
        # exception the exception tells why (a warning turned into an error would replace it).
        say = None if self._aside else rank_zero_info if self._failed else rank_zero_warn
        self._core.end(
            "the fit stopped",
            say,
            " A checkpoint written before the stop (OnExceptionCheckpoint, a SIGTERM checkpoint) carries them, and"
            " `trainer.fit(..., ckpt_path=...)` from it finishes the group exactly.",
        )
        self._failed = False
        self._side.teardown()
        self._clipping.release()
        self.remove_group_listener(self._scheduled.on_group)
        self._scheduled.forget_resume()
        self._groups.release(self._trainer_ref)
        self._evaluation.end()
        self._slicer.reset()
        self._trainer_ref = None
        self._agreement = None
        super().teardown()


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


def _check_supported(strategy: ExactAccumulation, trainer: Trainer) -> None:
    """Refuse what accumulation cannot work with: a strategy that accumulates itself, slices in a manual loop, a
    closure-re-evaluating optimizer at ``A > 1``."""
    if getattr(strategy, "handles_gradient_accumulation", False):
        raise RuntimeError(
            f"{type(strategy).__name__} cannot work on a strategy that handles gradient accumulation itself"
            " (`handles_gradient_accumulation=True`, e.g. DeepSpeed). Use strategy='accum' or 'accum_ddp'."
        )
    if strategy._slicer.enabled and not trainer.lightning_module.automatic_optimization:
        raise ValueError(
            f"`microbatch_size={strategy.slicing.configured!r}` cuts the loader's batch inside Lightning's"
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
