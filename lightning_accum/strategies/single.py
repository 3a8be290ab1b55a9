"""Exact gradient accumulation on one device: strategy string ``"accum"``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from typing_extensions import override

from lightning_accum.batch_schedule import BatchSchedule
from lightning_accum.core.core import given_device, one_device_property
from lightning_accum.options import AccumulationOptions, Normalize, OnNonfinite, PartialGroup, ScheduleOn, TokenCounter
from lightning_accum.strategies.base import ExactAccumulation
from lightning_accum.token_batches import TokenBatches

__all__ = ["AccumulationStrategy"]


class AccumulationStrategy(ExactAccumulation, SingleDeviceStrategy):
    """Exact gradient accumulation on one device (strategy string ``"accum"``).

    Each micro-batch is weighted by its count of units, so the update applied after
    ``accumulate_grad_batches`` micro-batches is the gradient of ``Σ w·loss / Σ w`` over the whole group,
    whatever the micro-batch sizes. ``training_step`` returns the micro-batch's *mean* loss, alone or in
    a dict with ``"num_tokens"`` (supervised tokens) and/or ``"num_samples"``.

    Args:
        count_tokens: ``batch -> int | Tensor``: the micro-batch's supervised tokens where ``training_step`` reports
            none (on the command line an import path, e.g. ``lightning_accum.causal_lm_tokens``).
        normalize, partial_group, schedule_on, on_nonfinite, max_consecutive_skips, global_order: The options of exact
            accumulation, documented once in :class:`~lightning_accum.options.AccumulationOptions`.
        device: The device; by default the one the Trainer's accelerator selects.
        microbatch_size: ``None`` (default), an int, or ``"auto"``: run each loader batch as exact slices (see
            :class:`~lightning_accum.strategies.slicing.BatchSlicer` and ``docs/howto.md``).
        split_batch: ``(batch, start, stop) -> batch`` for a batch type the strategy cannot slice itself.
        batch_schedule: The global batch by tokens, samples or updates: a :class:`~lightning_accum.BatchSchedule`, or
            its stages (a dict or Megatron's string form, on tokens); each group's size is set at its start (see
            :mod:`~lightning_accum.strategies.scheduled_groups`). Leave ``accumulate_grad_batches`` unset with it.
        token_batches: The training loader's micro-batches cut by tokens, each group the examples of the loader's
            ``batch_size`` × ``accumulate_grad_batches`` × ``D`` (a :class:`~lightning_accum.TokenBatches`).
        **kwargs: Passed to :class:`~lightning.pytorch.strategies.SingleDeviceStrategy`.

    ``trainer.global_step`` keeps Lightning's meaning (attempts; docs/concepts.md); applied updates are in
    :attr:`ledger`.

    Example:
        >>> import lightning as L
        >>> import lightning_accum
        >>> trainer = L.Trainer(strategy="accum", accumulate_grad_batches=4, accelerator="cpu", logger=False,
        ...                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        >>> type(trainer.strategy).__name__, trainer.strategy.engine.options.partial_group
        ('AccumulationStrategy', 'rescale')
    """

    strategy_name = "accum"

    def __init__(
        self,
        device: str | torch.device | None = None,
        *,
        normalize: Normalize = "auto",
        count_tokens: TokenCounter | None = None,
        partial_group: PartialGroup = "rescale",
        schedule_on: ScheduleOn = "applied",
        on_nonfinite: OnNonfinite = "skip",
        max_consecutive_skips: int | None = 100,
        global_order: bool = False,
        microbatch_size: int | Literal["auto"] | None = None,
        split_batch: Callable[[Any, int, int], Any] | None = None,
        batch_schedule: BatchSchedule | dict[int, int] | str | None = None,
        token_batches: TokenBatches | None = None,
        **kwargs: Any,
    ) -> None:
        options = AccumulationOptions.pick(locals())  # the options declared above, one by one for LightningCLI
        self._init_accumulation(options, microbatch_size, split_batch, batch_schedule, token_batches)
        super().__init__(device=given_device(self, device), **kwargs)

    parallel_devices = one_device_property("the Trainer")

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("accum", cls, description="Exact gradient accumulation on one device", override=True)
