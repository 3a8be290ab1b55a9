"""The ledger: exact global counters (Python ints, summed over replicas) of what a run consumed and updated."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

__all__ = ["AXES", "COUNTERS", "SKIP_REASONS", "AccumulationLedger", "GroupRecord"]

#: The axes a run can be measured on (logging, budgets, schedules), and the ledger counter each one reads.
AXES: dict[str, str] = {
    "tokens": "tokens",
    "samples": "samples",
    "updates": "updates_applied",
    "documents": "documents",
}

#: Reasons an attempted update can be skipped, in the order they are checked.
SKIP_REASONS: tuple[str, ...] = ("empty", "nonfinite", "overflow")


@dataclass
class GroupRecord:
    """The record of one closed accumulation group.

    Attributes:
        loss: ``Σ w·loss / Σ w`` over all replicas (``nan`` without any unit).
        tokens: Supervised tokens, summed over replicas (0 when not reported).
        samples: Samples, summed over replicas.
        microbatches: Micro-batches, summed over replicas.
        applied: Whether the parameters were updated.
        skip_reason: ``None`` when applied or dropped, else one of :data:`SKIP_REASONS`.
        grad_scale: The GradScaler scale used, ``None`` without a scaler.
        dropped: Whether it was a partial final group dropped by ``partial_group="drop"``.
        documents: Documents with a supervised token, summed over replicas (0 when not reported).

    Example:
        >>> record = GroupRecord(loss=3.5, tokens=2048, samples=2, microbatches=2, applied=True)
        >>> record.skip_reason is None
        True
    """

    loss: float
    tokens: int
    samples: int
    microbatches: int
    applied: bool
    skip_reason: str | None = None
    grad_scale: float | None = None
    dropped: bool = False
    documents: int = 0


@dataclass
class AccumulationLedger:
    """Exact global counters of a run, kept by the accumulation strategies as ``trainer.strategy.ledger``.

    ``microbatches``, ``samples``, ``tokens`` and ``documents`` count what attempted updates consumed (skipped ones
    included); the ``dropped_*`` counters what dropped partial groups held. Its state loads with ``weights_only=True``.

    Example:
        >>> ledger = AccumulationLedger()
        >>> restored = AccumulationLedger()
        >>> restored.load_state_dict(ledger.state_dict())
        >>> restored == ledger
        True
    """

    microbatches: int = 0
    updates_attempted: int = 0
    updates_applied: int = 0
    updates_skipped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SKIP_REASONS, 0))
    samples: int = 0
    tokens: int = 0
    partial_groups: int = 0
    dropped_microbatches: int = 0
    dropped_samples: int = 0
    dropped_tokens: int = 0
    documents: int = 0
    dropped_documents: int = 0
    #: The unit micro-batches are weighted by (``"tokens"``, ``"samples"``, ``"batches"`` or ``"documents"``), once
    #: decided.
    normalization: str | None = None
    last_group: GroupRecord | None = None

    @property
    def skipped_total(self) -> int:
        """All skipped attempts, whatever the reason."""
        return sum(self.updates_skipped.values())

    def record(self, group: GroupRecord) -> None:
        """Add a closed group to the counters and make it :attr:`last_group`."""
        self.last_group = group
        if group.dropped:
            self.dropped_microbatches += group.microbatches
            self.dropped_samples += group.samples
            self.dropped_tokens += group.tokens
            self.dropped_documents += group.documents
            return
        self.updates_attempted += 1
        self.microbatches += group.microbatches
        self.samples += group.samples
        self.tokens += group.tokens
        self.documents += group.documents
        if group.applied:
            self.updates_applied += 1
        elif group.skip_reason is not None:
            self.updates_skipped[group.skip_reason] = self.updates_skipped.get(group.skip_reason, 0) + 1

    def state_dict(self) -> dict[str, Any]:
        """The ledger as plain Python data (ints, floats, strings, ``None`` and dicts)."""
        return asdict(self)  # dicts copied, the last group's record as a dict

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`; keys a state lacks are read with defaults."""
        fresh = AccumulationLedger()
        for name in COUNTERS:
            setattr(self, name, int(state.get(name, getattr(fresh, name))))
        skipped = {str(k): int(v) for k, v in state.get("updates_skipped", {}).items()}
        self.updates_skipped = {**fresh.updates_skipped, **skipped}
        self.normalization = state.get("normalization")
        last = state.get("last_group")
        self.last_group = GroupRecord(**last) if last is not None else None

    def __eq__(self, other: object) -> bool:
        # An empty group's loss is NaN; two ledgers that both recorded it are still equal.
        if not isinstance(other, AccumulationLedger):
            return NotImplemented
        return _nan_safe(self.state_dict()) == _nan_safe(other.state_dict())


#: The ledger's integer counters (its fields that start at 0; ``updates_skipped`` aside), as saved in its state.
COUNTERS: tuple[str, ...] = tuple(f.name for f in fields(AccumulationLedger) if type(f.default) is int)


def _nan_safe(state: dict[str, Any]) -> dict[str, Any]:
    last = state.get("last_group")
    if last is not None and isinstance(last["loss"], float) and math.isnan(last["loss"]):
        state["last_group"] = {**last, "loss": "nan"}
    return state
