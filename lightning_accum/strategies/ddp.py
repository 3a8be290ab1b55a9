"""Exact gradient accumulation across data-parallel replicas: ``"accum_ddp"`` and its launch variants."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.trainer.states import TrainerStatus
from torch.utils.data import IterableDataset
from typing_extensions import override

from lightning_accum._worker_exit import ClosingWorkers, launcher_configuration
from lightning_accum.batch_schedule import BatchSchedule
from lightning_accum.core.adapter import EngineAdapter, collective_failure
from lightning_accum.core.ddp import DDPAdapter, register_ddp_strings
from lightning_accum.core.entry import CHECKPOINT_KEY
from lightning_accum.options import AccumulationOptions, Normalize, OnNonfinite, PartialGroup, ScheduleOn, TokenCounter
from lightning_accum.strategies.base import ExactAccumulation
from lightning_accum.strategies.trainer_side import TrainerSide, ends_group_by_position
from lightning_accum.token_batches import TokenBatches

__all__ = ["DDPAccumulationStrategy", "DDPTrainerSide"]


class _LedgerReturningLauncher(ClosingWorkers, _MultiProcessingLauncher):
    """Spawn/fork launcher that also brings rank zero's ledger back to the main process, and closes the process
    group in each worker before it exits (see :mod:`lightning_accum._worker_exit`)."""

    @override
    def launch(self, function: Callable[..., Any], *args: Any, trainer: Trainer | None = None, **kwargs: Any) -> Any:
        side: DDPTrainerSide = self._strategy._side  # type: ignore[attr-defined]  # the strategy is ours
        side.workers_failed = False
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        except BaseException:
            # This process's model is the one `fit` was given, untrained: the training state lived in the workers.
            side.workers_failed = True
            raise

    @override
    def get_extra_results(self, trainer: Trainer) -> dict[str, Any]:
        extra = super().get_extra_results(trainer)
        extra[CHECKPOINT_KEY] = trainer.strategy.engine.state_dict()  # type: ignore[attr-defined]
        return extra

    @override
    def update_main_process_results(self, trainer: Trainer, extra: dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)
        if CHECKPOINT_KEY in extra:
            trainer.strategy.engine.load_state_dict(extra[CHECKPOINT_KEY])  # type: ignore[attr-defined]


class DDPTrainerSide(TrainerSide):
    """DDP's Trainer-only side (see :class:`~lightning_accum.strategies.trainer_side.TrainerSide`): DDP's own
    synchronisation flag, lost peers, data that ends on some replicas only, and a launch whose workers failed."""

    def __init__(self, strategy: Any, adapter: EngineAdapter) -> None:
        super().__init__(strategy, adapter)
        #: ``check_data_ends=`` of the strategy (see :class:`DDPAccumulationStrategy`).
        self.check_data_ends = True
        #: Set in the main process of a spawn/fork launch whose workers failed (by the launcher).
        self.workers_failed = False
        self._peers_lost: str | None = None  # why the replicas cannot be reached, once a collective failed
        self._checking_data_ends = False
        self._flag_group: Any = None  # a CPU (gloo) group for the data-end flag when the backend is not gloo
        self._trainer: Any = None

    @override
    def synchronises(self, trainer: Any) -> bool:
        # DDP's own state at backward time (Lightning's `no_sync` sets it off on a group's non-final batches).
        model = getattr(self.strategy, "model", None)
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return bool(model.require_backward_grad_sync)
        return super().synchronises(trainer)

    @override
    def sync_blocked(self) -> bool:
        # DDP's own flag, False inside `no_sync` however it was entered (`no_backward_sync`, Lightning's
        # `block_backward_sync`, `self.trainer.model.no_sync()`).
        model = self.strategy.model
        return isinstance(model, torch.nn.parallel.DistributedDataParallel) and not model.require_backward_grad_sync

    @override
    def before_forward_retry(self) -> None:
        # DDP's wrapper broadcasts rank zero's buffers at the start of a forward that follows a synchronised one
        # (`require_forward_param_sync`); the failed attempt already did, and a second broadcast on this rank alone
        # would pair with another collective on the others. The attribute is DDP's own (listed in docs/internals.md).
        model = self.strategy.model
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model.require_forward_param_sync = False

    # ------------------------------------------------------------------ faults

    @property
    @override
    def peers_lost(self) -> str | None:
        return self._peers_lost

    @override
    def may_write_checkpoint(self, filepath: Any) -> bool:
        if not self.workers_failed:
            return True
        # Lightning's exception checkpoint, called in the main process after a worker died (ProcessExitedException
        # on top): this process's copy of the model was never trained. Lightning's own strategies write it; here a
        # surviving worker's exception checkpoint, written before the launcher stopped it, is left as it is.
        warnings.warn(
            f"lightning_accum: no checkpoint written to {str(filepath)!r} from the main process of this"
            f" {self.strategy._start_method} launch: a worker failed, and this process holds the model as it was before"
            " `fit` (the training state lived in the workers). A surviving worker's exception checkpoint, if"
            " one was written there, is the state to resume from.",
            UserWarning,
            stacklevel=3,
        )
        return False

    @override
    def collectives_failed(self, trainer: Any) -> str | None:
        if self._peers_lost is not None:
            return self._peers_lost
        if trainer is None or trainer.state.status != TrainerStatus.INTERRUPTED:
            return None
        # Inside Lightning's `on_exception` (OnExceptionCheckpoint): the exception being handled says whether the
        # replicas can still be reached. No collective is tried to find out (it would wait for a dead peer).
        return self.peers_lost_in(sys.exc_info()[1])

    @override
    def on_exception(self, exception: BaseException) -> None:
        self.peers_lost_in(exception)

    @override
    def peers_lost_in(self, error: BaseException | None) -> str | None:
        # Whether the micro-batch that was running synchronises gradients in its backward, by Lightning's grouping
        # (DDP's own flag is reset when Lightning's `no_sync` exits on the exception).
        synchronising = (
            self._trainer is not None and self.adapter.data_parallel_size > 1 and ends_group_by_position(self._trainer)
        )
        failure = collective_failure(error, synchronising)
        if failure is None or self._peers_lost is not None:
            return failure
        self._peers_lost = failure
        # Every rank, not rank zero only: the rank that ran out of data may be the only one left to say so.
        warnings.warn(
            f"lightning_accum: a collective failed ({failure}). Either a replica died (its own log shows why; an"
            " OnExceptionCheckpoint on this rank wrote what it holds, without the open group's gradient), or the"
            " replicas' collectives paired up wrongly: replicas that run different numbers of batches per epoch"
            " (an unevenly sharded dataset) are detected with an error on every rank for iterable datasets, not for"
            " a map-style dataset whose sampler or length differs between ranks. The wait is bounded by the"
            " strategy's `timeout=`.",
            UserWarning,
            stacklevel=1,
        )
        return failure

    # ------------------------------------------------------------------ the run

    @override
    def setup(self, trainer: Any) -> None:
        self._trainer = trainer

    @override
    def on_train_start(self, trainer: Any) -> None:
        self._peers_lost = None
        self._checking_data_ends = (
            self.check_data_ends
            and trainer.train_dataloader is not None
            and _reads_iterable_data(trainer.train_dataloader)
            and self.adapter.data_parallel_size > 1
        )
        if self._checking_data_ends and torch.distributed.get_backend() != "gloo" and self._flag_group is None:
            # The flag is a host value: summed on the CPU, it never waits for the device (every rank runs this).
            self._flag_group = torch.distributed.new_group(backend="gloo")

    @override
    def teardown(self) -> None:
        self._checking_data_ends = False
        self._trainer = None

    @override
    def microbatch_agreement(self) -> Callable[[Any], None] | None:
        return self._agree_on_data_end if self._checking_data_ends else None

    def _agree_on_data_end(self, trainer: Any) -> None:
        """At every micro-batch that does not end a group in Lightning's grouping (at its last, the group's own
        all-reduce carries the flag): one all-reduce of "this replica's data ends here", so that data ending inside a
        group on some replicas only is an error on every replica at once. Every replica runs it at the same batch
        indices, so these collectives pair up until the first batch where one replica's data ends: the one checked."""
        epoch_loop = trainer.fit_loop.epoch_loop
        batch_idx = epoch_loop.batch_idx
        if (
            epoch_loop._accumulated_batches_reached()
        ):  # Lightning's grouping (the strategy's boundaries where they vary)
            return
        ends = bool(epoch_loop.batch_progress.is_last_batch)
        flag = torch.tensor([1 if ends else 0], dtype=torch.int64)  # on the CPU: no device synchronisation
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.SUM, group=self._flag_group)
        ended = int(flag.item())
        replicas = self.adapter.data_parallel_size
        if 0 < ended < replicas:
            raise RuntimeError(
                f"The training data of {ended} of {replicas} replicas ended at batch {batch_idx}"
                f" of the epoch, inside an accumulation group of {trainer.accumulate_grad_batches} micro-batches,"
                f" while the others have more batches (this replica's data {'ended' if ends else 'goes on'})."
                " Replicas must see the same number of batches per epoch, or the others would wait in a collective"
                " until the timeout: shard the iterable dataset evenly (drop the remainder)."
            )


class DDPAccumulationStrategy(ExactAccumulation, DDPStrategy):
    """Exact gradient accumulation across data-parallel replicas (``"accum_ddp"`` and variants).

    DDP averages the replicas' gradients, so the gradient is rescaled by ``c · D / W_global`` once per
    update, with ``W_global`` the units of the whole group on all replicas, from one fused all-reduce of
    a small float64 vector. Lightning's ``no_sync`` stays on non-final micro-batches (forward included).

    Args:
        count_tokens: ``batch -> int | Tensor``: the micro-batch's supervised tokens where ``training_step`` reports
            none (on the command line an import path, e.g. ``lightning_accum.causal_lm_tokens``).
        normalize, partial_group, schedule_on, on_nonfinite, max_consecutive_skips, global_order: The options of exact
            accumulation, documented once in :class:`~lightning_accum.options.AccumulationOptions`.
        check_data_ends: With an iterable training dataset: before each micro-batch that does not end a group, agree
            over the replicas whether any replica's data ends there, so that data ending inside a group on some
            replicas only is an error on every rank instead of a wait until the timeout (one all-reduce of one
            number on the CPU per such micro-batch; docs/reliability.md). ``False`` turns it off for data you know to
            be sharded evenly. Map-style data is never checked this way (its sampler gives every rank one length).
        microbatch_size, split_batch, batch_schedule, token_batches: Exact slices of each loader batch, the global
            batch by tokens, samples or updates, micro-batches cut by tokens: see :class:`AccumulationStrategy`.
        **kwargs: Passed to :class:`~lightning.pytorch.strategies.DDPStrategy` (``start_method``,
            ``find_unused_parameters``, ``process_group_backend``, ...).

    ``D`` is the world size: every process is one data replica. Every replica checks the same averaged gradient for
    NaN/Inf, so all take the same decision. What differs from one device is the core's
    :class:`~lightning_accum.core.ddp.DDPAdapter` and this door's :class:`DDPTrainerSide`.

    Example:
        >>> import lightning as L
        >>> import lightning_accum
        >>> trainer = L.Trainer(strategy="accum_ddp_spawn", devices=2, accelerator="cpu", logger=False,
        ...                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        >>> type(trainer.strategy).__name__, trainer.strategy.data_parallel_replicas
        ('DDPAccumulationStrategy', 2)
    """

    strategy_name = "accum_ddp"
    adapter_type = DDPAdapter
    side_type = DDPTrainerSide
    _side: DDPTrainerSide

    def __init__(
        self,
        *,
        normalize: Normalize = "auto",
        count_tokens: TokenCounter | None = None,
        partial_group: PartialGroup = "rescale",
        schedule_on: ScheduleOn = "applied",
        on_nonfinite: OnNonfinite = "skip",
        max_consecutive_skips: int | None = 100,
        global_order: bool = False,
        check_data_ends: bool = True,
        microbatch_size: int | Literal["auto"] | None = None,
        split_batch: Callable[[Any, int, int], Any] | None = None,
        batch_schedule: BatchSchedule | dict[int, int] | str | None = None,
        token_batches: TokenBatches | None = None,
        ddp_comm_state: Any = None,  # DDPStrategy's, typed `object`: LightningCLI's --help fails on it (jsonargparse)
        **kwargs: Any,
    ) -> None:
        options = AccumulationOptions.pick(locals())  # the options declared above, one by one for LightningCLI
        self._init_accumulation(options, microbatch_size, split_batch, batch_schedule, token_batches)
        super().__init__(ddp_comm_state=ddp_comm_state, **kwargs)
        self.check_data_ends = check_data_ends

    @property
    def check_data_ends(self) -> bool:
        """See ``check_data_ends=`` above."""
        return self._side.check_data_ends

    @check_data_ends.setter
    def check_data_ends(self, value: bool) -> None:
        self._side.check_data_ends = bool(value)

    _configure_launcher = launcher_configuration(DDPStrategy, _MultiProcessingLauncher, _LedgerReturningLauncher)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_ddp_strings(strategy_registry, cls, "")


def _reads_iterable_data(loaders: Any) -> bool:
    """Whether a loader in ``loaders`` (nested in dicts, lists and tuples) reads an iterable dataset (whose per-rank
    length nothing makes equal) or has no length."""
    if isinstance(loaders, dict):
        return _reads_iterable_data(list(loaders.values()))
    if isinstance(loaders, list | tuple):
        return any(_reads_iterable_data(item) for item in loaders)
    dataset = getattr(loaders, "dataset", None)
    return isinstance(dataset, IterableDataset) or not hasattr(loaders, "__len__")
