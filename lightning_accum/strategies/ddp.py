"""Exact gradient accumulation across data-parallel replicas: ``"accum_ddp"`` and its launch variants."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from torch import Tensor
from typing_extensions import override

from lightning_accum._worker_exit import close_process_group
from lightning_accum.microbatch import Count
from lightning_accum.strategies.base import CHECKPOINT_KEY, ExactAccumulation

__all__ = ["DDPAccumulationStrategy"]


class _LedgerReturningLauncher(_MultiProcessingLauncher):
    """Spawn/fork launcher that also brings rank zero's ledger back to the main process, and closes the process
    group in each worker before it exits (see :mod:`lightning_accum._worker_exit`)."""

    @override
    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        super()._wrapping_function(*args, **kwargs)
        close_process_group(self._strategy)

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


class DDPAccumulationStrategy(ExactAccumulation, DDPStrategy):
    """Exact gradient accumulation across data-parallel replicas (``"accum_ddp"`` and variants).

    DDP averages the replicas' gradients, so the gradient is rescaled by ``c · D / W_global`` once per
    update, with ``W_global`` the units of the whole group on all replicas, from one fused all-reduce of
    a small float64 vector. Lightning's ``no_sync`` stays on non-final micro-batches (forward included).

    Args:
        normalize: See :class:`AccumulationStrategy`.
        count_tokens: See :class:`AccumulationStrategy`.
        partial_group: See :class:`AccumulationStrategy`.
        schedule_on: See :class:`AccumulationStrategy`.
        on_nonfinite: See :class:`AccumulationStrategy`.
        max_consecutive_skips: See :class:`AccumulationStrategy`.
        **kwargs: Passed to :class:`~lightning.pytorch.strategies.DDPStrategy` (``start_method``,
            ``find_unused_parameters``, ``process_group_backend``, ...).

    An overflow or non-finite gradient on one replica reaches all of them (DDP averages the gradients before
    they are checked, so every replica checks the same values), and every replica takes the same decision.
    ``trainer.global_step`` counts attempts, as in Lightning; applied updates are in :attr:`ledger`.

    ``D`` is the world size: every process is one data replica (tensor or pipeline parallelism is not
    part of this strategy).

    Example:
        >>> import lightning as L
        >>> import lightning_accum
        >>> trainer = L.Trainer(strategy="accum_ddp_spawn", devices=2, accelerator="cpu", logger=False,
        ...                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        >>> type(trainer.strategy).__name__, trainer.strategy.data_parallel_replicas
        ('DDPAccumulationStrategy', 2)
    """

    strategy_name = "accum_ddp"

    def __init__(
        self,
        normalize: str = "auto",
        count_tokens: Callable[[Any], Count] | None = None,
        partial_group: str = "rescale",
        schedule_on: str = "applied",
        on_nonfinite: str = "skip",
        max_consecutive_skips: int | None = 100,
        **kwargs: Any,
    ) -> None:
        self._init_engine(normalize, count_tokens, partial_group, schedule_on, on_nonfinite, max_consecutive_skips)
        super().__init__(**kwargs)

    @property
    @override
    def data_parallel_replicas(self) -> int:
        return self.num_nodes * self.num_processes

    @override
    def reduce_sum(self, tensor: Tensor) -> Tensor:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
        return tensor

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        text = str(exception).lower()
        if isinstance(exception, RuntimeError) and ("timed out" in text or "timeout" in text):
            # Every rank, not rank zero only: the rank that ran out of data may be the only one left to say so.
            warnings.warn(
                "lightning_accum: a collective timed out. If replicas ran out of training data at different"
                " micro-batches of the same accumulation group (an unevenly sharded iterable dataset), their"
                " collectives paired up wrongly before the group could close and be checked: shard the data"
                " evenly (drop the remainder). The wait is bounded by the strategy's `timeout=`.",
                UserWarning,
                stacklevel=1,
            )

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if isinstance(self._launcher, _MultiProcessingLauncher) and self._start_method != "popen":
            self._launcher = _LedgerReturningLauncher(self, start_method=self._start_method)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, options in (
            ("accum_ddp", {"start_method": "popen"}),
            ("accum_ddp_spawn", {"start_method": "spawn"}),
            ("accum_ddp_fork", {"start_method": "fork"}),
            ("accum_ddp_notebook", {"start_method": "fork"}),
            ("accum_ddp_find_unused_parameters_true", {"start_method": "popen", "find_unused_parameters": True}),
        ):
            strategy_registry.register(
                name, cls, description=f"Exact gradient accumulation with DDP ({options})", override=True, **options
            )
