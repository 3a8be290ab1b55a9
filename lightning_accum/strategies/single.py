"""Exact gradient accumulation on one device: strategy string ``"accum"``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from typing_extensions import override

from lightning_accum.microbatch import Count
from lightning_accum.strategies.base import ExactAccumulation

__all__ = ["AccumulationStrategy"]


class AccumulationStrategy(ExactAccumulation, SingleDeviceStrategy):
    """Exact gradient accumulation on one device (strategy string ``"accum"``).

    Each micro-batch is weighted by its count of units, so the update applied after
    ``accumulate_grad_batches`` micro-batches is the gradient of ``Σ w·loss / Σ w`` over the whole group,
    whatever the micro-batch sizes. ``training_step`` returns the micro-batch's *mean* loss, alone or in
    a dict with ``"num_tokens"`` (supervised tokens) and/or ``"num_samples"``.

    Args:
        normalize: Unit each micro-batch is weighted by: ``"auto"`` (tokens if reported, else samples,
            else batches), ``"tokens"``, ``"samples"`` or ``"batches"``. The unit used is logged once and
            kept in ``ledger.normalization``.
        count_tokens: Optional ``batch -> int | Tensor``, used when ``training_step`` returns no ``num_tokens``.
        partial_group: ``"rescale"`` (update a partial final group with its real denominator) or ``"drop"``
            (no update for it; its micro-batches, samples and tokens are recorded in the ledger).
        schedule_on: ``"applied"`` (default): step-interval LR schedulers advance once per applied update
            (every ``frequency``-th applied update), never on a skipped one or per micro-batch;
            ``"attempted"``: once per attempt, skipped ones included.
        on_nonfinite: Without a GradScaler (fp32, bf16): ``"skip"`` (default) makes no update when the
            group's gradient holds a NaN/Inf (counted as ``"nonfinite"``, one warning naming the update),
            ``"raise"`` stops with an error naming the update and the first offending parameter,
            ``"ignore"`` keeps Lightning's behaviour (update anyway). With a GradScaler, its own check
            decides and skipped updates are counted as ``"overflow"``.
        max_consecutive_skips: Stop with an error after this many consecutive skipped updates (a loss that
            is NaN in every group would otherwise spin forever); ``None`` never stops.
        device: The device; by default the one the Trainer's accelerator selects.
        microbatch_size: ``None`` (default): the loader's batch is one micro-batch, as in Lightning. An int: each
            loader batch (still Lightning's batch for ``accumulate_grad_batches``, ``global_step`` and the hooks) is
            run as consecutive slices of at most that many samples (the fewest, as even as possible), forward and
            backward each, gradients synchronised only on the group's last slice: the same update, exactly, with lower
            peak activation memory. ``"auto"``:
            the whole batch, and after an out-of-memory error in a slice's forward or backward, that slice again at
            half the size (kept for the rest of the run); see ``docs/howto.md``.
        split_batch: ``(batch, start, stop) -> batch``: samples ``start:stop`` of a batch type the strategy cannot
            cut itself (by default every tensor whose leading dimension is the batch's sample count is sliced).
        **kwargs: Passed to :class:`~lightning.pytorch.strategies.SingleDeviceStrategy`.

    ``trainer.global_step`` keeps Lightning's meaning (one per optimizer-step call: attempts, so
    ``max_steps`` behaves as users expect; a dropped partial group is counted too); the exact counts of
    attempted, applied and skipped updates are in :attr:`ledger` (``ledger.updates_applied``).

    Example:
        >>> import lightning as L
        >>> import lightning_accum
        >>> trainer = L.Trainer(strategy="accum", accumulate_grad_batches=4, accelerator="cpu", logger=False,
        ...                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        >>> type(trainer.strategy).__name__, trainer.strategy.engine.partial_group
        ('AccumulationStrategy', 'rescale')
    """

    strategy_name = "accum"

    def __init__(
        self,
        normalize: str = "auto",
        count_tokens: Callable[[Any], Count] | None = None,
        partial_group: str = "rescale",
        schedule_on: str = "applied",
        on_nonfinite: str = "skip",
        max_consecutive_skips: int | None = 100,
        device: str | torch.device | None = None,
        microbatch_size: int | Literal["auto"] | None = None,
        split_batch: Callable[[Any, int, int], Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self._init_engine(
            normalize,
            count_tokens,
            partial_group,
            schedule_on,
            on_nonfinite,
            max_consecutive_skips,
            microbatch_size,
            split_batch,
        )
        super().__init__(device=device if device is not None else "cpu", **kwargs)
        self._device_given = device is not None

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        """The device chosen by the Trainer when none was given (read by Lightning's accelerator connector)."""
        return [self.root_device] if self._device_given else None

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        if not devices:
            return
        if len(devices) > 1:
            raise ValueError(
                f"strategy='accum' runs on one device, but the Trainer selected {len(devices)} devices. Use"
                " strategy='accum_ddp' (or 'accum_ddp_spawn') for several devices, or pass `devices=1`."
            )
        self._root_device = torch.device(devices[0])
        self._device_given = True

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("accum", cls, description="Exact gradient accumulation on one device", override=True)
