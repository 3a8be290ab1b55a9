"""One accumulation group's sums: kept as the micro-batches arrive, formed once, reduced by sum, read once
(docs/internals.md, "A group's sums")."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum

import torch
from torch import Tensor

from lightning_accum.microbatch import Count, Microbatch

__all__ = [
    "CARRIED",
    "COUNT_SPLIT",
    "UNIT_CODES",
    "VECTOR_SIZE",
    "GroupSums",
    "ReducedGroup",
    "Slot",
    "split",
]

#: Counts travel as ``hi · COUNT_SPLIT + lo``: see the module docstring.
COUNT_SPLIT = 2**24
#: The unit of the run as a number in the reduced vector (replicas must agree on it).
UNIT_CODES = {"tokens": 1.0, "samples": 2.0, "batches": 3.0, "documents": 4.0}


class Slot(IntEnum):
    """Positions in the vector a group sums over replicas."""

    UNITS = 0  #: Σ w, the group's weight in its unit
    WEIGHTED_LOSS = 1  #: Σ w · loss
    TOKENS_HI = 2
    TOKENS_LO = 3
    SAMPLES_HI = 4
    SAMPLES_LO = 5
    NEGATIVE = 6  #: micro-batch counts reported below zero
    GROUP_SCALE = 7  #: c, the group's scale (every replica adds its own, identical, c: the sum is c · D)
    MICROBATCHES = 8
    UNIT_CODE = 9  #: :data:`UNIT_CODES` of the replica's unit (the sum is code · D when replicas agree)
    LAST = 10  #: 1 on a replica whose data ends with this group
    EXCESS = 11  #: micro-batches that reported more tokens than their batch has label positions (where known)
    DOCUMENTS_HI = 12
    DOCUMENTS_LO = 13
    UNIT_CODE_SQUARED = 14  #: its square: with the sum of the codes, replicas agree iff the codes' variance is 0
    STALE = 15  #: parameters that held a nonzero gradient when a manual group opened (see :attr:`GroupSums.stale`)


VECTOR_SIZE = len(Slot)
#: The additive slots a checkpoint written inside a group carries (the others are recomputed at the close).
CARRIED = (
    Slot.UNITS,
    Slot.WEIGHTED_LOSS,
    Slot.TOKENS_HI,
    Slot.TOKENS_LO,
    Slot.SAMPLES_HI,
    Slot.SAMPLES_LO,
    Slot.NEGATIVE,
    Slot.DOCUMENTS_HI,
    Slot.DOCUMENTS_LO,
)


def split(total: int) -> tuple[float, float]:
    """``(hi, lo)`` with ``total = hi · COUNT_SPLIT + lo`` and ``0 <= lo < COUNT_SPLIT``, as floats."""
    hi, lo = divmod(total, COUNT_SPLIT)
    return float(hi), float(lo)


@dataclass(slots=True)
class ReducedGroup:
    """The values of a group's vector after the sum over replicas, read on the host.

    Example:
        >>> values = [0.0] * VECTOR_SIZE
        >>> values[Slot.TOKENS_HI], values[Slot.TOKENS_LO] = 1.0, 5.0
        >>> ReducedGroup.from_values(values).tokens == COUNT_SPLIT + 5
        True
    """

    units: float
    weighted_loss: float
    tokens: int
    samples: int
    negative: int
    group_scale_times_d: float
    microbatches: int
    unit_code: float
    ended: int
    excess: int = 0
    documents: int = 0
    unit_code_squared: float = 0.0
    stale: int = 0

    @classmethod
    def from_values(cls, values: Sequence[float]) -> ReducedGroup:
        return cls(
            units=values[Slot.UNITS],
            weighted_loss=values[Slot.WEIGHTED_LOSS],
            tokens=int(values[Slot.TOKENS_HI]) * COUNT_SPLIT + int(values[Slot.TOKENS_LO]),
            samples=int(values[Slot.SAMPLES_HI]) * COUNT_SPLIT + int(values[Slot.SAMPLES_LO]),
            negative=round(values[Slot.NEGATIVE]),
            group_scale_times_d=values[Slot.GROUP_SCALE],
            microbatches=round(values[Slot.MICROBATCHES]),
            unit_code=values[Slot.UNIT_CODE],
            ended=round(values[Slot.LAST]),
            excess=round(values[Slot.EXCESS]),
            documents=int(values[Slot.DOCUMENTS_HI]) * COUNT_SPLIT + int(values[Slot.DOCUMENTS_LO]),
            unit_code_squared=values[Slot.UNIT_CODE_SQUARED],
            stale=round(values[Slot.STALE]),
        )


class GroupSums:
    """What one group's micro-batches reported, kept as they arrived (losses detached) until the group closes; the
    weights are the ``tokens``, ``samples`` or ``documents`` list, whichever the unit is, or 1 each."""

    def __init__(self) -> None:
        self.microbatches = 0
        self.losses: list[Tensor] = []
        self.tokens: list[Count] = []
        #: The label positions of the batch of each entry of :attr:`tokens` (``labels.numel()``), or ``None``.
        self.positions: list[int | None] = []
        self.samples: list[Count] = []
        self.documents: list[Count] = []
        self.batch_samples: list[int] = []
        self._mark: tuple[int, int, int, int, int, int, int] | None = None  # what `retract` restores
        #: The group holds one micro-batch known to be its only one, back-propagated as its loss (``c = w``; see
        #: :meth:`AccumulationEngine.add_microbatch`).
        self.sole = False
        #: A manual group that opened on gradients already there (zeroed in place, or stale): how many of them hold a
        #: nonzero value, counted on the device when it opened, given to the close and read with its values (no host
        #: read of its own): a gradient zeroed in place is harmless, a stale one an error at the close.
        self.stale: Tensor | None = None

    def add(self, microbatch: Microbatch, continues: bool = False) -> None:
        """Record one micro-batch as read (:func:`~lightning_accum.microbatch.read_microbatch`; no loss: the step
        returned none).

        ``continues``: a further slice of the micro-batch recorded last (``microbatch_size=``): its counts and loss
        are added, but the group's micro-batch count and the list of micro-batch sizes do not grow (the size is
        added to the last one). A token count above the batch's label positions is counted in :attr:`Slot.EXCESS`.
        """
        sizes = self.batch_samples
        self._mark = (
            self.microbatches,
            len(self.losses),
            len(self.tokens),
            len(self.samples),
            len(sizes),
            sizes[-1] if sizes else 0,
            len(self.documents),
        )
        size = microbatch.size
        if not continues:
            self.microbatches += 1
            if size is not None:
                sizes.append(size)
        elif size is not None and sizes:
            sizes[-1] += size
        loss = microbatch.loss
        if loss is None:
            return
        self.losses.append(loss.detach())
        if microbatch.tokens is not None:
            self.tokens.append(microbatch.tokens)
            self.positions.append(microbatch.label_positions)
        if microbatch.samples is not None:
            self.samples.append(microbatch.samples)
        if microbatch.documents is not None:
            self.documents.append(microbatch.documents)

    def retract(self) -> None:
        """Forget the last :meth:`add` (a slice whose backward ran out of memory and is run again, smaller)."""
        mark = self._mark
        if mark is None:
            raise RuntimeError("GroupSums.retract: nothing was added since the last retract.")
        self.sole = False  # the group is back to what it was before that add, which no sole add follows
        self.microbatches, losses, tokens, samples, sizes, last, documents = mark
        del self.losses[losses:], self.tokens[tokens:], self.positions[tokens:], self.samples[samples:]
        del self.documents[documents:]
        del self.batch_samples[sizes:]
        if sizes:
            self.batch_samples[-1] = last
        self._mark = None

    def local_vector(
        self,
        device: torch.device,
        unit: str | None,
        extra: Mapping[Slot, float] | None = None,
        group_scale: float | Tensor = 0.0,
        carried: Mapping[Slot, float] | None = None,
    ) -> Tensor:
        """This replica's contribution to the group's reduced vector (:class:`Slot` layout), a new float64 tensor.

        ``extra`` and ``carried`` (what a checkpoint carried into the group) add host values by slot; ``group_scale``
        is ``c`` (a float, or a device scalar). Host values are summed on the host, tensors on the device.
        """
        host = [0.0] * VECTOR_SIZE
        weights = self.weights(unit)
        counted, count_parts, stacked_weights = self._counts(device, weights)
        for slot, value in (*(extra or {}).items(), *(carried or {}).items(), *counted.items()):
            host[slot] += value
        host[Slot.EXCESS] += self.host_excess()
        # Device values and the slots they are added to (first: the count of stale gradients, where one was given).
        parts: list[tuple[tuple[Slot, ...], Tensor]] = (
            [] if self.stale is None else [((Slot.STALE,), self.stale.to(device, torch.float64).reshape(1))]
        )
        if isinstance(group_scale, Tensor):
            parts.append(((Slot.GROUP_SCALE,), group_scale.to(device=device, dtype=torch.float64).reshape(1)))
        else:
            host[Slot.GROUP_SCALE] += float(group_scale)
        parts += count_parts
        if self.losses:
            losses = torch.stack(self.losses).to(device=device, dtype=torch.float64)
            if weights is None:  # every micro-batch weighs 1
                host[Slot.UNITS] += len(self.losses)
                parts.append(((Slot.WEIGHTED_LOSS,), losses.sum().reshape(1)))
            else:
                w = stacked_weights.to(torch.float64) if stacked_weights is not None else _as_vector(weights, device)
                # where() keeps an empty micro-batch's NaN mean out of Σ w·loss.
                weighted = torch.dot(torch.where(w > 0, losses, 0.0), w)
                parts.append(((Slot.UNITS, Slot.WEIGHTED_LOSS), torch.stack((w.sum(), weighted))))
        vector = torch.tensor(host, dtype=torch.float64).to(device, non_blocking=True)
        if parts:
            slots = [slot for part_slots, _ in parts for slot in part_slots]
            index = torch.tensor(slots, dtype=torch.int64).to(device, non_blocking=True)
            vector.index_add_(0, index, torch.cat([values for _, values in parts]))
        return vector

    def _counts(
        self, device: torch.device, weights: list[Count] | None
    ) -> tuple[dict[Slot, float], list[tuple[tuple[Slot, ...], Tensor]], Tensor | None]:
        """The counts as ints summed on the host, as tensors stacked on the device, by slot (and the unit's stacked)."""
        host: dict[Slot, float] = {}
        parts: list[tuple[tuple[Slot, ...], Tensor]] = []
        stacked_weights: Tensor | None = None
        for counts, hi, lo in (
            (self.tokens, Slot.TOKENS_HI, Slot.TOKENS_LO),
            (self.samples, Slot.SAMPLES_HI, Slot.SAMPLES_LO),
            (self.documents, Slot.DOCUMENTS_HI, Slot.DOCUMENTS_LO),
        ):
            host[hi], host[lo] = split(sum(count for count in counts if not isinstance(count, Tensor)))
            tensors = [count for count in counts if isinstance(count, Tensor)]
            if tensors:
                stacked = torch.stack(tensors).to(device=device, dtype=torch.int64)
                columns = [torch.div(stacked, COUNT_SPLIT, rounding_mode="floor"), stacked % COUNT_SPLIT, stacked < 0]
                targets: tuple[Slot, ...] = (hi, lo, Slot.NEGATIVE)
                limits = self._position_limits(counts) if counts is self.tokens else None
                if limits is not None:
                    columns.append(stacked > limits.to(device, non_blocking=True))
                    targets = (hi, lo, Slot.NEGATIVE, Slot.EXCESS)
                parts.append((targets, torch.stack(columns).sum(1, dtype=torch.float64)))
                if counts is weights and len(tensors) == len(counts):
                    stacked_weights = stacked
        return host, parts, stacked_weights

    def weights(self, unit: str | None) -> list[Count] | None:
        """The micro-batches' weights in ``unit`` as reported (``None``: every micro-batch weighs 1)."""
        return {"tokens": self.tokens, "samples": self.samples, "documents": self.documents}.get(unit or "")

    def _position_limits(self, counts: list[Count]) -> Tensor | None:
        """The label positions of the token counts reported as tensors (a bound no count reaches where unknown), or
        ``None`` when none is known. Counts reported as ints are compared on the host, in :meth:`host_excess`."""
        limits = [p for c, p in zip(counts, self.positions, strict=True) if isinstance(c, Tensor)]
        if all(p is None for p in limits):
            return None
        return torch.tensor([2**62 if p is None else p for p in limits], dtype=torch.int64)

    def host_excess(self) -> int:
        """Token counts reported as ints above their batch's label positions."""
        return sum(
            1
            for c, p in zip(self.tokens, self.positions, strict=True)
            if p is not None and not isinstance(c, Tensor) and c > p
        )


def _as_vector(weights: list[Count], device: torch.device) -> Tensor:
    """The micro-batches' weights, not all reported as tensors (:meth:`GroupSums.local_vector` stacks those), as a
    float64 vector on ``device`` (host ints copied once, without waiting)."""
    if not any(isinstance(w, Tensor) for w in weights):
        return torch.tensor(weights, dtype=torch.float64).to(device, non_blocking=True)
    # ints and tensors mixed: rare
    return torch.stack([torch.as_tensor(w).to(device, torch.float64, non_blocking=True) for w in weights])
