"""The loss of an evaluation set, ``Σ w·loss / Σ w`` over every batch on every replica, for both doors."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DistributedSampler

from lightning_accum.decision import negative_message, units_agree
from lightning_accum.engine import AccumulationEngine
from lightning_accum.group import UNIT_CODES
from lightning_accum.microbatch import Count, Microbatch, choose_unit, refuse_a_finer_unit

__all__ = [
    "SLOTS",
    "EvaluationLoss",
    "EvaluationRecord",
    "WeightedMean",
    "evaluation_weight",
    "no_unit_message",
    "perplexity_of",
    "repeats_message",
]


class WeightedMean:
    """``Σ w·value / Σ w`` over one rank's updates on the device (``exp=True``: its ``exp``); weight 0 adds nothing.

    Example:
        >>> mean = WeightedMean()
        >>> mean.update(torch.tensor(3.0), 512)
        >>> mean.update(torch.tensor(4.0), 1536)
        >>> float(mean.compute())
        3.75
    """

    def __init__(self, exp: bool = False, device: torch.device | str = "cpu") -> None:
        self.exp = exp
        self.weighted = torch.zeros((), dtype=torch.float64, device=device)
        self.units = torch.zeros((), dtype=torch.int64, device=device)
        self.negative = torch.zeros((), dtype=torch.int64, device=device)

    def update(self, value: Tensor, weight: Count) -> None:
        value = value.detach().to(device=self.weighted.device, dtype=torch.float64)
        if isinstance(weight, Tensor):
            weight = weight.to(self.units.device)
            self.weighted += torch.where(weight > 0, value * weight, 0.0)
            self.negative += weight < 0
        elif weight > 0:
            self.weighted += value * weight
        self.units += weight

    def compute(self) -> Tensor:
        mean = self.weighted / self.units
        return mean.exp() if self.exp else mean

    def parts(self) -> Tensor:
        return torch.stack((self.weighted, self.units.to(torch.float64), self.negative.to(torch.float64)))


def evaluation_weight(engine: AccumulationEngine, unit: str | None, read: Microbatch) -> tuple[str, Count | None]:
    """The unit an evaluation weights its batches by (``unit`` once fixed) and ``read``'s count of it (``None``: none).

    Example:
        >>> engine = AccumulationEngine()
        >>> evaluation_weight(engine, None, engine.read({"loss": torch.tensor(2.0), "num_tokens": 5}, torch.zeros(3)))
        ('tokens', 5)
    """
    has_tokens = read.tokens is not None and not read.reports_samples
    reported = choose_unit(engine.options.normalize, has_tokens, read.samples is not None, read.documents is not None)[
        0
    ]
    fixed = unit if unit is not None else engine.ledger.normalization
    if fixed is not None:
        refuse_a_finer_unit(fixed, engine.options.normalize, reported, "this evaluation batch")
    unit = fixed if fixed is not None else reported
    return unit, {"tokens": read.tokens, "samples": read.samples, "documents": read.documents}.get(unit, 1)


def repeats_message(loader: Any, subject: str, holder: str, replicas: int) -> str | None:
    """The warning that ``loader``'s padding ``DistributedSampler`` counts examples twice, or ``None``."""
    sampler = getattr(loader, "sampler", None)
    if not isinstance(sampler, DistributedSampler) or sampler.drop_last:
        return None
    examples = len(sampler.dataset)  # type: ignore[arg-type]
    repeats = sampler.total_size - examples
    if repeats <= 0:
        return None
    return (
        f"lightning_accum: {subject} counts {repeats} example(s) twice: the DistributedSampler pads the {examples}"
        f" examples of {holder} to {sampler.total_size} so that each of the {replicas} replicas runs"
        f" {sampler.num_samples}, repeating the first {repeats}, and the repeats cannot be told apart from the others."
        f" Give the set a size that is a multiple of {replicas} (or evaluate on one device) for the exact loss of the"
        " set."
    )


def perplexity_of(loss: float) -> float:
    """``exp(loss)``: ``inf`` past float64's range, NaN for a NaN loss."""
    if math.isnan(loss):
        return math.nan
    return math.exp(loss) if loss < 709.0 else math.inf


def no_unit_message(subject: str, holder: str, unit: str | None) -> str:
    """Why ``subject`` is NaN: ``holder`` holds no ``unit`` at all."""
    return (
        f"lightning_accum: {subject} is NaN: {holder} holds no {unit or 'unit'} at all (Σ num_{unit} = 0 over every"
        " batch and replica), so its weighted loss is 0/0. Likely causes: every label of the set is the ignore index,"
        " or the count is computed on the wrong tensor."
    )


@dataclass(frozen=True)
class EvaluationRecord:
    """What :meth:`EvaluationLoss.compute` returns, the same on every rank.

    Attributes:
        loss: ``Σ w·loss / Σ w`` over every batch on every replica (float64); NaN for a set without any unit.
        unit: ``"tokens"``, ``"samples"``, ``"documents"``, ``"batches"``, or ``None`` when no batch was added.
        units: ``Σ w`` over every replica.
        batches: The batches added over every replica.

    Example:
        >>> record = EvaluationRecord(loss=math.log(7.0), unit="tokens", units=2048, batches=2)
        >>> record.tokens, record.samples, round(record.perplexity, 12)
        (2048, None, 7.0)
    """

    loss: float
    unit: str | None
    units: int
    batches: int

    @property
    def tokens(self) -> int | None:
        """The set's tokens where the unit is tokens, else ``None``."""
        return self.units if self.unit == "tokens" else None

    @property
    def samples(self) -> int | None:
        """The set's samples where the unit is samples, else ``None``."""
        return self.units if self.unit == "samples" else None

    @property
    def documents(self) -> int | None:
        return self.units if self.unit == "documents" else None

    @property
    def perplexity(self) -> float | None:
        """``exp(loss)`` where the unit is tokens, else ``None``."""
        return perplexity_of(self.loss) if self.unit == "tokens" else None


#: The size of :meth:`EvaluationLoss.local`: host values first (ranks with a batch, batches, Σ unit code, Σ code²),
#: then the device sums (:meth:`WeightedMean.parts`).
SLOTS = 7


class EvaluationLoss:
    """The loss of one evaluation set over every replica, weighted by its units: ``fabric.strategy.evaluation()``.

    Args:
        engine: The strategy's engine (the run's unit, ``normalize=``, ``count_tokens=``, warnings).
        reduce_sum: Sums a tensor in place over the data-parallel replicas.
        device: Gives the device the sums live on.

    Example:
        >>> evaluation = EvaluationLoss(AccumulationEngine(), lambda t: t, lambda: torch.device("cpu"))
        >>> evaluation.add(torch.tensor(2.0), num_tokens=512)
        >>> evaluation.add(torch.tensor(4.0), num_tokens=torch.tensor(1536))
        >>> evaluation.compute()
        EvaluationRecord(loss=3.5, unit='tokens', units=2048, batches=2)
    """

    def __init__(
        self,
        engine: AccumulationEngine,
        reduce_sum: Callable[[Tensor], Tensor],
        device: Callable[[], torch.device],
    ) -> None:
        self._engine, self._reduce_sum, self._device = engine, reduce_sum, device
        self.reset()

    def reset(self) -> None:
        """Empty the sums and free the unit for a new evaluation."""
        self._sums: WeightedMean | None = None
        self._unit: str | None = None
        self._batches = 0

    def add(
        self,
        loss: Tensor,
        num_tokens: Count | None = None,
        num_samples: Count | None = None,
        batch: Any = None,
        num_documents: Count | None = None,
    ) -> None:
        """Add one batch of this rank: its mean ``loss`` and the count of its units (read as for ``accumulate``).

        Raises:
            TypeError: ``loss`` is not a tensor, or a count is not an integer.
            ValueError: ``loss`` holds more than one value, an int count is negative, or the unit's count is missing.
        """
        if not isinstance(loss, Tensor):
            raise TypeError(
                f"`evaluation.add(loss=...)` takes the batch's mean loss as a tensor, got {type(loss).__name__}."
            )
        if loss.numel() != 1:
            raise ValueError(
                f"`evaluation.add(loss=...)` takes the batch's mean loss, one value, got a tensor of shape"
                f" {tuple(loss.shape)}. Reduce it over the batch's units (e.g. `F.cross_entropy(...,"
                " ignore_index=-100)`) and pass their count."
            )
        counts = {"num_tokens": num_tokens, "num_samples": num_samples, "num_documents": num_documents}
        read = self._engine.read({"loss": loss, **{k: v for k, v in counts.items() if v is not None}}, batch)
        unit, weight = evaluation_weight(self._engine, self._unit, read)
        if weight is None:
            raise ValueError(self._missing_count(unit))
        self.include(read.loss, weight, unit)  # type: ignore[arg-type]  # a tensor loss is read as one

    def include(self, loss: Tensor, weight: Count, unit: str) -> None:
        self._unit = unit
        if self._sums is None:
            self._sums = WeightedMean(device=self._device())
        self._sums.update(loss, weight)
        self._batches += 1

    def local(self) -> Tensor:
        """This rank's :data:`SLOTS` values for the reduction."""
        sums = self._sums
        device = sums.weighted.device if sums is not None else self._device()
        code = UNIT_CODES.get(self._unit or "", 0.0)
        host = torch.tensor([float(self._batches > 0), float(self._batches), code, code * code], dtype=torch.float64)
        parts = sums.parts() if sums is not None else torch.zeros(3, dtype=torch.float64, device=device)
        return torch.cat((host.to(device, non_blocking=True), parts))

    def record(self, reduced: Sequence[float], subject: str, where: str) -> EvaluationRecord:
        """The set's record from :meth:`local` summed over the replicas."""
        ranks, batches, codes, squares, weighted, units, negative = reduced
        if negative:  # an int below zero is refused where it is given
            raise ValueError(negative_message(round(negative), "batch", where))
        if not units_agree(codes, squares, round(ranks)):
            raise RuntimeError(
                f"Ranks weighted their evaluation batches by different units (this rank: {self._unit!r}), so {subject}"
                " has no single meaning. Report the same count (e.g. `num_tokens=`) on every rank, or set"
                " `normalize=` on the strategy."
            )
        unit = next((name for name, value in UNIT_CODES.items() if ranks and value * ranks == codes), None)
        loss = weighted / units if units > 0 else math.nan  # a set without any unit is 0/0, said in a warning
        return EvaluationRecord(loss=loss, unit=unit, units=round(units), batches=round(batches))

    def compute(self) -> EvaluationRecord:
        """The set's loss over every replica (one all-reduce, one host read); call it on every rank.

        Raises:
            ValueError: A count given as a tensor was negative.
            RuntimeError: Ranks weighted their batches by different units.
        """
        reduced = self._reduce_sum(self.local()).tolist()  # the one host read
        record = self.record(reduced, "the set's loss", "to `evaluation.add` in this evaluation")
        if not record.batches:
            self._engine.warn(
                "lightning_accum: `evaluation.compute()` is NaN: no batch was added on any replica (an empty set, or"
                " `add` never called), so the set's loss is 0/0. Add the set's batches with `evaluation.add(loss,"
                " num_tokens=...)` before `compute()`."
            )
        elif not record.units:
            self._engine.warn(no_unit_message("`evaluation.compute()`", "the set", record.unit))
        return record

    def _missing_count(self, unit: str) -> str:
        name = f"num_{unit}"
        if self._engine.ledger.normalization is not None:
            why = "the run's unit, chosen by its training"
        elif self._unit is not None:
            why = "fixed by this evaluation's first batch"
        else:
            why = f"`normalize={self._engine.options.normalize!r}`"
        return (
            f"`evaluation.add`: this evaluation weights its batches by {unit} ({why}), but this batch reports no"
            f" `{name}`. Pass `{name}=` to every `add` of one evaluation (a set weighted partly by one count and partly"
            " by another has no single meaning); for tokens e.g. `num_tokens=lightning_accum.supervised_tokens(labels,"
            " shift=True)`, or `batch=` with the strategy's `count_tokens=`."
        )
