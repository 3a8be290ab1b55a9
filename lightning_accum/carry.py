"""An accumulation group across a checkpoint: the sums its entry carries and :class:`Carried`, what the resumed group
brings in (docs/reliability.md, "What a checkpoint written inside a group carries").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_accum.group import CARRIED, COUNT_SPLIT, Slot

__all__ = ["Carried", "carried_state"]


def carried_state(
    microbatches: int, reduced: Sequence[float], scale: float | Tensor | None, consistent: bool
) -> dict[str, Any]:
    """The counters of an open group's entry, from its vector summed over the replicas (``reduced``, on the host).

    Example:
        >>> from lightning_accum.group import VECTOR_SIZE
        >>> state = carried_state(2, [5.0] + [0.0] * (VECTOR_SIZE - 1), 8.0, True)
        >>> state["sums"]["units"], state["scale_ref"]
        (5.0, 8.0)
    """
    return {
        "microbatches": microbatches,
        "sums": {slot.name.lower(): float(reduced[slot]) for slot in CARRIED},
        "scale_ref": float(scale) if scale is not None else None,
        "scale_ref_is_tensor": isinstance(scale, Tensor),
        "consistent": consistent,
    }


@dataclass(frozen=True)
class Carried:
    """What a checkpoint's group brings into the resumed run's group: the places ``done`` (carried or lost), the carried
    ``microbatches`` and ``samples`` over all replicas, the ``sums`` by slot (on the one replica adding them), its ``c``
    (``scale``), and its ``gradients`` by name until installed into the ``targets``.
    """

    done: int = 0
    microbatches: int = 0
    samples: int = 0
    sums: Mapping[Slot, float] = field(default_factory=dict)
    scale: float | Tensor | None = None
    gradients: dict[str, Tensor] | None = None
    targets: list[tuple[str, Tensor]] = field(default_factory=list)

    @classmethod
    def from_entry(cls, group: Mapping[str, Any], holds_sums: bool, position: int, total: int) -> Carried:
        """What the entry's ``group`` carries into a group at ``position``; ``holds_sums``: this replica adds sums."""
        sums = group["sums"]
        carried = {slot: float(sums.get(slot.name.lower(), 0.0)) for slot in CARRIED} if holds_sums else {}
        if holds_sums:
            carried[Slot.MICROBATCHES] = float(total)
        scale = group.get("scale_ref")
        if scale is not None:  # a tensor c where the writing run formed one: the resumed group's `w / c` does too
            scale = (
                torch.tensor(float(scale), dtype=torch.float64) if group.get("scale_ref_is_tensor") else float(scale)
            )
        samples = int(sums.get("samples_hi", 0.0)) * COUNT_SPLIT + int(sums.get("samples_lo", 0.0))
        return cls(position, total, samples, carried, scale)
