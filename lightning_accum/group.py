"""One accumulation group's sums: kept as the micro-batches arrive, formed once, reduced by sum, read once.

In the manner of a torchmetrics metric (``MeanMetric`` keeps ``Σ value·weight`` and ``Σ weight``, reduces
both by sum across ranks and divides once), a group keeps what its micro-batches reported and turns it into
one small float64 vector when it closes (:meth:`GroupSums.local_vector`). The strategies sum that vector
over replicas (one all-reduce) and read it on the host once; :class:`ReducedGroup` names its values.

Counts stay exact integers whatever their size: a float64 sum is exact only below 2^53, so every count is
carried as two parts, ``count = hi · 2^24 + lo`` with ``0 <= lo < 2^24``. Each part's sum over micro-batches
and replicas stays far below 2^53 (``lo`` sums below 2^53 for up to 2^29 micro-batches of a group; ``hi``
sums below 2^53 for group totals up to 2^77), so the integer rebuilt on the host is exact.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch
from torch import Tensor

from lightning_accum.microbatch import Count

__all__ = ["COUNT_SPLIT", "UNIT_CODES", "GroupSums", "ReducedGroup", "Slot", "group_position"]

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


def _split(total: int) -> tuple[float, float]:
    hi, lo = divmod(total, COUNT_SPLIT)
    return float(hi), float(lo)


@dataclass
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
        self.microbatches, losses, tokens, samples, sizes, last = mark
        del self.losses[losses:], self.tokens[tokens:], self.samples[samples:], self.batch_samples[sizes:]
        if sizes:
            self.batch_samples[-1] = last
        self._mark = None

    def local_vector(
        self, device: torch.device, unit: str | None, extra: Mapping[Slot, float], device_extra: Mapping[Slot, Tensor]
    ) -> Tensor:
        """This replica's contribution to the group's reduced vector (:class:`Slot` layout).

        ``extra`` adds host values and ``device_extra`` device scalars by slot. About a dozen tensor operations
        whatever the number of micro-batches.
        """
        host = [0.0] * VECTOR_SIZE
        for slot, value in extra.items():
            host[slot] += value
        for slot, value in self.carried.items():
            host[slot] += value
        parts: list[tuple[int, Tensor]] = [(int(slot), value) for slot, value in device_extra.items()]
        weights: dict[str, tuple[Tensor | None, float]] = {}
        for name, values, hi_slot, lo_slot in (
            ("tokens", self.tokens, Slot.TOKENS_HI, Slot.TOKENS_LO),
            ("samples", self.samples, Slot.SAMPLES_HI, Slot.SAMPLES_LO),
        ):
            total = sum(v for v in values if not isinstance(v, Tensor))
            hi, lo = _split(total)
            host[hi_slot] += hi
            host[lo_slot] += lo
            tensors = [v for v in values if isinstance(v, Tensor)]
            if not tensors:
                weights[name] = (None, float(total))
                continue
            stacked = torch.stack(tensors).to(device=device, dtype=torch.int64)
            high = torch.div(stacked, COUNT_SPLIT, rounding_mode="floor")
            parts += [
                (hi_slot, high.sum().to(torch.float64)),
                (lo_slot, (stacked - high * COUNT_SPLIT).sum().to(torch.float64)),
                (Slot.NEGATIVE, (stacked < 0).sum().to(torch.float64)),
            ]
            weights[name] = (stacked.to(torch.float64), float(total))
        if self.losses:
            losses = torch.stack(self.losses).to(device=device, dtype=torch.float64)
            if unit not in weights:  # every micro-batch weighs 1
                host[Slot.UNITS] += len(self.losses)
                parts.append((Slot.WEIGHTED_LOSS, losses.sum()))
            else:
                values = self.tokens if unit == "tokens" else self.samples
                tensor_weights, host_total = weights[unit]
                host[Slot.UNITS] += host_total
                if tensor_weights is not None:
                    parts.append((Slot.UNITS, tensor_weights.sum()))
                if tensor_weights is None or len(tensor_weights) != len(values):  # ints, or ints and tensors: rare
                    tensor_weights = _as_float64_vector(values, device)
                # Σ w·loss in micro-batch order; where() keeps an empty micro-batch's NaN mean out.
                parts.append(
                    (Slot.WEIGHTED_LOSS, torch.dot(torch.where(tensor_weights > 0, losses, 0.0), tensor_weights))
                )
        vector = torch.tensor(host, dtype=torch.float64, device=device)
        if parts:
            positions = tuple(index for index, _ in parts)
            vector.index_add_(0, _positions(positions, device), torch.stack([part for _, part in parts]))
        return vector

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
            group.carried[Slot.TOKENS_HI], group.carried[Slot.TOKENS_LO] = _split(round(tokens))
            group.carried[Slot.SAMPLES_HI], group.carried[Slot.SAMPLES_LO] = _split(round(samples))
        return group


_POSITIONS: dict[tuple[tuple[int, ...], torch.device], Tensor] = {}


def _positions(positions: tuple[int, ...], device: torch.device) -> Tensor:
    """A cached index tensor (a group's layout repeats every update)."""
    key = (positions, device)
    cached = _POSITIONS.get(key)
    if cached is None:
        cached = _POSITIONS[key] = torch.tensor(positions, dtype=torch.int64, device=device)
    return cached


def _as_float64_vector(values: list[Count], device: torch.device) -> Tensor:
    if not any(isinstance(v, Tensor) for v in values):
        return torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    return torch.stack(
        [torch.as_tensor(v, device=device).to(torch.float64) for v in values]  # mixed ints and tensors: rare
    )
