"""A learning-rate schedule on tokens, samples, documents or applied updates, not on Lightning's batch index."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from lightning_accum.ledger import AXES, AccumulationLedger, GroupRecord
from lightning_accum.options import validate_choice

if TYPE_CHECKING:
    from lightning_accum.engine import AccumulationEngine

__all__ = [
    "REPORTED_AXES",
    "AxisLR",
    "WarmupCosine",
    "WarmupLinear",
    "warmup_cosine",
    "warmup_linear",
]

#: The axes whose counts a step must report (the others every run has).
REPORTED_AXES = ("tokens", "documents")


def group_count(record: GroupRecord, axis: str) -> int:
    return 1 if axis == "updates" else int(getattr(record, axis))


def no_counts_error(who: str, axis: str) -> RuntimeError:
    """The error for an axis of :data:`REPORTED_AXES` whose counts the run does not report."""
    if axis == "tokens":
        return RuntimeError(
            f"{who}(axis='tokens') needs token counts, but the run reports none. Return `{{'loss': loss,"
            " 'num_tokens': lightning_accum.supervised_tokens(labels, shift=True)}` from `training_step`"
            " (shift=False when the labels are already aligned with the logits), pass `count_tokens=` to the strategy"
            f" (e.g. `lightning_accum.causal_lm_tokens`), or use `{who}(axis='samples')`."
        )
    return RuntimeError(
        f"{who}(axis='documents') needs document counts, but the run reports none. Return"
        " `lightning_accum.document_mean_loss(logits, labels, position_ids=...)` from `training_step` (it reports"
        f" `num_documents`), or use `{who}(axis='tokens')` or `{who}(axis='samples')`."
    )


def check_counts_reported(who: str, axis: str, ledger: AccumulationLedger) -> bool:
    """Raise :func:`no_counts_error` where the ledger lacks counts of ``axis``; whether the run weighs by ``axis``."""
    if axis not in REPORTED_AXES:
        return True
    if getattr(ledger, axis) == 0 and ledger.normalization != axis:
        raise no_counts_error(who, axis)
    return ledger.normalization == axis


class _WarmupDecay:
    """``lr_lambda`` that rises linearly from 0 to 1 over ``warmup``, then decays to ``min_ratio`` at ``total``."""

    def __init__(self, warmup: int, total: int, min_ratio: float = 0.0) -> None:
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"`warmup` must be an int >= 0 (a count on the schedule's axis); got {warmup!r}.")
        if isinstance(total, bool) or not isinstance(total, int) or total <= 0 or total < warmup:
            raise ValueError(
                f"`total` must be a positive int >= `warmup` ({warmup!r}), the count at which the decay ends; got"
                f" {total!r}. Pass the run's budget on the schedule's axis."
            )
        if not 0.0 <= float(min_ratio) <= 1.0:
            raise ValueError(
                f"`min_ratio` must be in [0, 1] (the final rate as a fraction of the base); got {min_ratio!r}."
            )
        self.warmup, self.total, self.min_ratio = warmup, total, float(min_ratio)

    def decay(self, progress: float) -> float:
        raise NotImplementedError

    def __call__(self, count: int) -> float:
        if count < self.warmup:
            return count / self.warmup
        if self.total == self.warmup:
            return self.min_ratio
        progress = min(1.0, (count - self.warmup) / (self.total - self.warmup))
        return self.min_ratio + (1.0 - self.min_ratio) * self.decay(progress)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(warmup={self.warmup}, total={self.total}, min_ratio={self.min_ratio})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and repr(other) == repr(self)

    def __hash__(self) -> int:
        return hash(repr(self))


class WarmupCosine(_WarmupDecay):
    """The ``lr_lambda`` of :func:`warmup_cosine`."""

    def decay(self, progress: float) -> float:
        return 0.5 * (1.0 + math.cos(math.pi * progress))


class WarmupLinear(_WarmupDecay):
    """The ``lr_lambda`` of :func:`warmup_linear`."""

    def decay(self, progress: float) -> float:
        return 1.0 - progress


def warmup_cosine(warmup: int, total: int, min_ratio: float = 0.0) -> WarmupCosine:
    """An ``lr_lambda``: linear warm-up from 0 over ``warmup``, cosine decay to ``min_ratio`` at ``total``, flat after.

    Raises:
        ValueError: ``warmup`` is not an int ≥ 0, ``total`` not an int ≥ ``warmup`` and > 0, or ``min_ratio`` not in
            [0, 1].

    Example:
        >>> schedule = warmup_cosine(warmup=100, total=1100, min_ratio=0.1)
        >>> [round(schedule(n), 3) for n in (0, 50, 100, 600, 1100, 5000)]
        [0.0, 0.5, 1.0, 0.55, 0.1, 0.1]
    """
    return WarmupCosine(warmup, total, min_ratio)


def warmup_linear(warmup: int, total: int, min_ratio: float = 0.0) -> WarmupLinear:
    """An ``lr_lambda``: linear warm-up from 0 over ``warmup``, linear decay to ``min_ratio`` at ``total``, flat after.

    Raises:
        ValueError: As :func:`warmup_cosine`.

    Example:
        >>> schedule = warmup_linear(warmup=100, total=1100)
        >>> [round(schedule(n), 3) for n in (0, 50, 100, 600, 1100, 5000)]
        [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    """
    return WarmupLinear(warmup, total, min_ratio)


class AxisLR(LRScheduler):
    """Learning rate ``base_lr × lr_lambda(n)``, ``n`` the count on ``axis`` the applied updates so far consumed.

    Args:
        optimizer: The optimizer; each parameter group's ``lr`` at construction is its ``base_lr``.
        axis: ``"tokens"``, ``"samples"``, ``"documents"`` or ``"updates"`` (applied updates).
        lr_lambda: ``count -> factor``, e.g. :func:`warmup_cosine`; picklable when the run spawns processes.
        last_epoch: As for every torch scheduler; leave at ``-1``.

    Raises:
        ValueError: For an unknown ``axis``.
        TypeError: For an ``lr_lambda`` that is not callable.
        RuntimeError: When stepped without an accumulation strategy, or when the run reports no counts of ``axis``.

    Example:
        >>> import torch
        >>> optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        >>> scheduler = AxisLR(optimizer, axis="tokens", lr_lambda=warmup_linear(warmup=1000, total=3000))
        >>> scheduler.consumed, optimizer.param_groups[0]["lr"]  # the first update runs at lr_lambda(0)
        (0, 0.0)
    """

    def __init__(
        self,
        optimizer: Optimizer,
        axis: str = "tokens",
        *,
        lr_lambda: Callable[[int], float],
        last_epoch: int = -1,
    ) -> None:
        self.axis = validate_choice("axis", axis, AXES)
        if not callable(lr_lambda):
            raise TypeError(
                f"`lr_lambda` must be callable (count -> factor), e.g. `lightning_accum.warmup_cosine(warmup, total)`;"
                f" got {type(lr_lambda).__name__}."
            )
        self.lr_lambda = lr_lambda
        #: The count on :attr:`axis` the applied updates so far consumed (summed over replicas).
        self.consumed = 0
        self._engine: AccumulationEngine | None = None
        super().__init__(optimizer, last_epoch)

    def bind(self, engine: AccumulationEngine) -> None:
        """Count what every applied update of ``engine``'s groups consumed."""
        if self._engine is not None and self._engine is not engine:
            self._engine.decisions.remove_listener(self._on_group)
        self._engine = engine
        engine.decisions.add_listener(self._on_group)

    def _on_group(self, record: GroupRecord, batch_samples: Sequence[int]) -> None:
        if record.dropped or not record.applied:
            return
        count = group_count(record, self.axis)
        if count == 0 and self._engine is not None:
            check_counts_reported("AxisLR", self.axis, self._engine.ledger)
        self.consumed += count

    def get_lr(self) -> list[float]:  # type: ignore[override]
        factor = float(self.lr_lambda(self.consumed))
        return [float(base) * factor for base in self.base_lrs]

    def step(self, epoch: int | None = None) -> None:
        # torch's constructor steps once (`_step_count` is 0 then) to set the first rate: lr_lambda(0).
        if self._engine is None and getattr(self, "_step_count", 0) > 0:
            raise RuntimeError(
                "AxisLR needs an accumulation strategy to count what each update consumed, but it was stepped without"
                " one. In a Trainer: `Trainer(strategy='accum')` on one device or `strategy='accum_ddp'` (or"
                " 'accum_ddp_spawn') on several. In a Fabric loop: `L.Fabric(strategy='accum')` (or 'accum_ddp'), then"
                " `fabric.setup(model, optimizer, scheduler=axis_lr)` or `axis_lr.bind(fabric.strategy.engine)`."
            )
        super().step(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Plain data (loadable with ``weights_only=True``)."""
        return {
            "axis": self.axis,
            "consumed": self.consumed,
            "base_lrs": list(self.base_lrs),
            "last_epoch": self.last_epoch,
            "_step_count": self._step_count,
            "_last_lr": list(self._last_lr),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; ``ValueError`` when its ``axis`` is not this scheduler's."""
        saved_axis = state_dict.get("axis", self.axis)
        if saved_axis != self.axis:
            raise ValueError(
                f"This AxisLR runs on axis={self.axis!r}, but the checkpoint's was saved on axis={saved_axis!r}."
                " Resume with the same `axis`, or start the schedule afresh (no `ckpt_path`)."
            )
        self.consumed = int(state_dict.get("consumed", 0))
        self.base_lrs = [float(x) for x in state_dict.get("base_lrs", self.base_lrs)]
        self.last_epoch = int(state_dict.get("last_epoch", self.last_epoch))
        self._step_count = int(state_dict.get("_step_count", self._step_count))
        self._last_lr = [float(x) for x in state_dict.get("_last_lr", self._last_lr)]
