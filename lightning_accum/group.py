"""One accumulation group's sums: kept as the micro-batches arrive, formed once, reduced by sum, read once.

In the manner of a torchmetrics metric (``MeanMetric`` keeps ``Σ value·weight`` and ``Σ weight``, reduces
both by sum across ranks and divides once), a group keeps what its micro-batches reported and turns it into
one small float64 vector when it closes (:meth:`GroupSums.local_vector`). The strategies sum that vector
over replicas (one all-reduce) and read it on the host once; :class:`ReducedGroup` names its values. On one
replica there is nothing to sum: the engine reads the reported values as they are and forms the same values on
the host (``AccumulationEngine._close_here``).

Counts stay exact integers whatever their size: a float64 sum is exact only below 2^53, so every count is
carried as two parts, ``count = hi · 2^24 + lo`` with ``0 <= lo < 2^24``. Each part's sum over micro-batches
and replicas stays far below 2^53 (``lo`` sums below 2^53 for up to 2^29 micro-batches of a group; ``hi``
sums below 2^53 for group totals up to 2^77), so the integer rebuilt on the host is exact.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, NamedTuple

import torch
from torch import Tensor

from lightning_accum.microbatch import Count

__all__ = [
    "COUNT_SPLIT",
    "UNIT_CODES",
    "GroupSums",
    "Parts",
    "ReducedGroup",
    "Slot",
    "combine",
    "group_position",
    "split",
]

#: Counts travel as ``hi · COUNT_SPLIT + lo``: see the module docstring.
COUNT_SPLIT = 2**24
#: The unit of the run as a number in the reduced vector (replicas must agree on it).
UNIT_CODES = {"tokens": 1.0, "samples": 2.0, "batches": 3.0}


class Slot(IntEnum):
    """Positions in the vector a group sums over replicas."""

    UNITS = 0  #: Σ w, the group's weight in its unit
    WEIGHTED_LOSS = 1  #: Σ w · loss
    TOKENS_HI = 2
    TOKENS_LO = 3
    SAMPLES_HI = 4
    SAMPLES_LO = 5
    NEGATIVE = 6  #: micro-batch counts reported below zero
    SCALE_REF = 7  #: c (every replica adds its own, identical, c: the sum is c · D)
    MICROBATCHES = 8
    UNIT_CODE = 9  #: :data:`UNIT_CODES` of the replica's unit (the sum is code · D when replicas agree)
    LAST = 10  #: 1 on a replica whose data ends with this group


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
)


def group_position(batch_idx: int, accumulate: int) -> int:
    """How many micro-batches of the current group come before batch ``batch_idx`` of an epoch (Lightning's
    groups start at multiples of ``accumulate``).

    Example:
        >>> group_position(5, 4), group_position(8, 4)
        (1, 0)
    """
    return batch_idx % accumulate


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
    scale_ref_times_d: float
    microbatches: int
    unit_code: float
    ended: int

    @classmethod
    def from_values(cls, values: Sequence[float]) -> ReducedGroup:
        return cls(
            units=values[Slot.UNITS],
            weighted_loss=values[Slot.WEIGHTED_LOSS],
            tokens=int(values[Slot.TOKENS_HI]) * COUNT_SPLIT + int(values[Slot.TOKENS_LO]),
            samples=int(values[Slot.SAMPLES_HI]) * COUNT_SPLIT + int(values[Slot.SAMPLES_LO]),
            negative=round(values[Slot.NEGATIVE]),
            scale_ref_times_d=values[Slot.SCALE_REF],
            microbatches=round(values[Slot.MICROBATCHES]),
            unit_code=values[Slot.UNIT_CODE],
            ended=round(values[Slot.LAST]),
        )


class Parts(NamedTuple):
    """A group's values where they are, before they are summed over replicas (:meth:`GroupSums.parts`)."""

    #: Host values by slot.
    host: list[float]
    #: The slot each entry of :attr:`source` is added to (a slot may appear several times, and in :attr:`host`).
    positions: list[int]
    #: The device values, a 1-d float64 tensor (``None`` when there is none).
    source: Tensor | None


class GroupSums:
    """What one group's micro-batches reported, kept as they arrived until the group closes.

    Nothing is computed per micro-batch: appending references costs no kernel launch, and the group's sums
    are formed once, vectorized, in :meth:`local_vector`. Losses are detached (no graph is kept). The weights
    are the ``tokens`` or the ``samples`` list, whichever the unit is (every micro-batch with a loss reports
    it), or 1 each.
    """

    def __init__(self) -> None:
        self.microbatches = 0
        #: Sums of micro-batches carried over from a checkpoint written inside this group, by slot (on one
        #: replica only; see :meth:`carry_state` and :meth:`from_carried`).
        self.carried: dict[Slot, float] = {}
        #: Micro-batches of this group that ran before a checkpoint but could not be carried over (lost).
        self.missing = 0
        #: Micro-batches carried over from a checkpoint over all replicas of the run that wrote it (identical on
        #: every replica; one replica adds them to the reduced vector, see :attr:`carried`).
        self.carried_microbatches = 0
        self.losses: list[Tensor] = []
        self.tokens: list[Count] = []
        self.samples: list[Count] = []
        self.batch_samples: list[int] = []
        self._mark: tuple[int, int, int, int, int, int] | None = None  # what `retract` restores
        #: The group holds one micro-batch known to be its only one, back-propagated as its loss (``c = w``; see
        #: :meth:`AccumulationEngine.add_microbatch`).
        self.sole = False

    @property
    def carried_nothing(self) -> bool:
        """Whether nothing of this group comes from a checkpoint (carried sums, or lost micro-batches)."""
        return not self.carried and not self.missing and not self.carried_microbatches

    def add(
        self,
        loss: Tensor | None,
        tokens: Count | None,
        samples: Count | None,
        size: int | None,
        continues: bool = False,
    ) -> None:
        """Record one micro-batch (``loss`` ``None``: the step returned no loss).

        ``continues``: a further slice of the micro-batch recorded last (``microbatch_size=``): its counts and loss
        are added, but the group's micro-batch count and the list of micro-batch sizes do not grow (the size is
        added to the last one).
        """
        sizes = self.batch_samples
        self._mark = (
            self.microbatches,
            len(self.losses),
            len(self.tokens),
            len(self.samples),
            len(sizes),
            sizes[-1] if sizes else 0,
        )
        if not continues:
            self.microbatches += 1
            if size is not None:
                self.batch_samples.append(size)
        elif size is not None and self.batch_samples:
            self.batch_samples[-1] += size
        if loss is None:
            return
        self.losses.append(loss.detach())
        if tokens is not None:
            self.tokens.append(tokens)
        if samples is not None:
            self.samples.append(samples)

    def retract(self) -> None:
        """Forget the last :meth:`add` (a slice whose backward ran out of memory and is run again, smaller)."""
        mark = getattr(self, "_mark", None)
        if mark is None:
            raise RuntimeError("GroupSums.retract: nothing was added since the last retract.")
        self.sole = False  # the group is back to what it was before that add, which no sole add follows
        self.microbatches, losses, tokens, samples, sizes, last = mark
        del self.losses[losses:], self.tokens[tokens:], self.samples[samples:], self.batch_samples[sizes:]
        if sizes:
            self.batch_samples[-1] = last
        self._mark = None

    def local_vector(
        self, device: torch.device, unit: str | None, extra: Mapping[Slot, float], device_extra: Mapping[Slot, Tensor]
    ) -> Tensor:
        """This replica's contribution to the group's reduced vector (:class:`Slot` layout), a new tensor.

        ``extra`` adds host values and ``device_extra`` device scalars by slot. The values of :meth:`parts` in one
        vector: the host values are one cached device tensor (they repeat from update to update), to which the
        device values are added by one ``index_add``.
        """
        parts = self.parts(device, unit, extra, device_extra)
        return combine(parts.host, parts.positions, parts.source, device)

    def parts(
        self,
        device: torch.device,
        unit: str | None,
        extra: Mapping[Slot, float],
        device_extra: Mapping[Slot, Tensor],
    ) -> Parts:
        """The group's values where they are (see :class:`Parts`): host floats by slot (``extra`` included), and
        the device values as one 1-d float64 tensor on ``device``.

        A handful of tensor operations whatever the number of micro-batches. The common cases take the fewest:
        weights known on the host (samples, batches, or token counts reported as ints) weight the losses with one
        product (one micro-batch) or one matrix-vector product; token counts reported as tensors form their sums
        (the count parts, ``Σ w`` and ``Σ w·loss``) with one sum over a stacked matrix. (On one replica the engine
        reads the reported values as they are and forms the sums on the host instead.)
        """
        host = [0.0] * VECTOR_SIZE
        for slot, value in extra.items():
            host[slot] += value
        for slot, value in self.carried.items():
            host[slot] += value
        positions: list[int] = []
        sources: list[Tensor] = []  # 1-d float64 tensors on `device`, added at `positions` in order
        scalars = [(slot, scalar.to(device=device, dtype=torch.float64)) for slot, scalar in device_extra.items()]
        losses = self.losses
        weights = self.tokens if unit == "tokens" else self.samples if unit == "samples" else None
        weighted = False  # Σ w·loss formed (with the unit's tensor counts)
        host_units = 0.0
        for values, hi_slot, lo_slot in (
            (self.tokens, Slot.TOKENS_HI, Slot.TOKENS_LO),
            (self.samples, Slot.SAMPLES_HI, Slot.SAMPLES_LO),
        ):
            if not values:
                continue
            tensors = [v for v in values if isinstance(v, Tensor)]
            if len(tensors) < len(values):
                total = sum(v for v in values if not isinstance(v, Tensor))
                hi, lo = split(total)
                host[hi_slot] += hi
                host[lo_slot] += lo
                if values is weights:
                    host_units = float(total)
            if not tensors:
                continue
            stacked = torch.stack(tensors).to(device=device, dtype=torch.int64)
            rows = [
                torch.div(stacked, COUNT_SPLIT, rounding_mode="floor"),
                torch.remainder(stacked, COUNT_SPLIT),
                stacked < 0,
            ]
            positions += (hi_slot, lo_slot, Slot.NEGATIVE)
            if values is weights:
                counts = stacked.to(torch.float64)
                rows.append(counts)  # Σ w of the tensor counts
                positions.append(Slot.UNITS)
                if len(tensors) == len(losses):  # every weight is a tensor: Σ w·loss in the same sum
                    losses64 = torch.stack(losses).to(device=device, dtype=torch.float64)
                    # where() keeps an empty micro-batch's NaN mean out.
                    rows.append(torch.where(counts > 0, losses64, 0.0) * counts)
                    positions.append(Slot.WEIGHTED_LOSS)
                    weighted = True
            sources.append(torch.stack(rows).sum(1, dtype=torch.float64))
        if losses and not weighted:
            positions.append(Slot.WEIGHTED_LOSS)
            if weights is None:  # every micro-batch weighs 1
                host[Slot.UNITS] += len(losses)
                known: tuple[float, ...] | None = (1.0,) * len(losses)
            else:
                host[Slot.UNITS] += host_units
                known = tuple(float(v) for v in weights if not isinstance(v, Tensor))
                if len(known) != len(weights) or not all(w > 0 for w in known):
                    known = None  # empty micro-batches, or ints and tensors mixed: rare
            if known is not None and len(losses) == 1 and losses[0].device == device:
                # One micro-batch (A = 1): w · loss in one product, a float32 loss promoted by the float64 weight.
                sources.append(losses[0] * _cached(("weight", known, device), known, device, torch.float64))
            elif known is not None:  # weights known on the host
                losses64 = torch.stack(losses).to(device=device, dtype=torch.float64)
                sources.append(torch.mv(_cached(("weights", known, device), [known], device, torch.float64), losses64))
            else:
                losses64 = torch.stack(losses).to(device=device, dtype=torch.float64)
                vector = _as_float64_vector(weights or [], device)
                sources.append(torch.dot(torch.where(vector > 0, losses64, 0.0), vector).reshape(1))
        if scalars:  # the device scalars first, in one stack
            positions[:0] = [slot for slot, _ in scalars]
            sources.insert(0, torch.stack([scalar for _, scalar in scalars]))
        source = None if not sources else sources[0] if len(sources) == 1 else torch.cat(sources)
        return Parts(host, positions, source)

    # ------------------------------------------------------------------ across a checkpoint

    @staticmethod
    def carry_state(values: Sequence[float]) -> dict[str, float]:
        """The carried slots of a reduced vector, by name (plain floats, for a checkpoint)."""
        return {slot.name.lower(): float(values[slot]) for slot in CARRIED}

    @classmethod
    def from_carried(cls, microbatches: int, sums: Any) -> GroupSums:
        """A group reopened from :meth:`carry_state` (or the five-number list of checkpoints before 0.2:
        units, Σ w·loss, tokens, samples, negatives)."""
        group = cls()
        group.microbatches = microbatches
        if isinstance(sums, Mapping):
            group.carried = {slot: float(sums[slot.name.lower()]) for slot in CARRIED}
        else:
            units, weighted, tokens, samples, negative = (float(v) for v in sums)
            group.carried = {Slot.UNITS: units, Slot.WEIGHTED_LOSS: weighted, Slot.NEGATIVE: negative}
            group.carried[Slot.TOKENS_HI], group.carried[Slot.TOKENS_LO] = split(round(tokens))
            group.carried[Slot.SAMPLES_HI], group.carried[Slot.SAMPLES_LO] = split(round(samples))
        return group


#: Device tensors that repeat from update to update (a group's host values, its layout, its host weights), by key.
_CACHE: dict[tuple[Any, ...], Tensor] = {}
_CACHE_LIMIT = 256  # emptied when full (counts that vary every update make new keys)


def _cached(key: tuple[Any, ...], values: Sequence[Any], device: torch.device, dtype: torch.dtype) -> Tensor:
    """A cached tensor of ``values`` (never modified: callers make new tensors from it)."""
    cached = _CACHE.get(key)
    if cached is None:
        if len(_CACHE) >= _CACHE_LIMIT:
            _CACHE.clear()
        cached = _CACHE[key] = torch.tensor(values, dtype=dtype, device=device)
    return cached


def combine(host: Sequence[float], positions: Sequence[int], source: Tensor | None, device: torch.device) -> Tensor:
    """A new vector of :class:`Slot` layout on ``device``: ``host`` plus ``source`` added at ``positions`` (what
    :meth:`GroupSums.parts` returns)."""
    base = _cached(("host", tuple(host), device), host, device, torch.float64)
    if source is None:
        return base.clone()
    return base.index_add(0, _cached(("positions", tuple(positions), device), positions, device, torch.int64), source)


def _as_float64_vector(values: list[Count], device: torch.device) -> Tensor:
    if not any(isinstance(v, Tensor) for v in values):
        return torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    return torch.stack(
        [torch.as_tensor(v, device=device).to(torch.float64) for v in values]  # mixed ints and tensors: rare
    )
