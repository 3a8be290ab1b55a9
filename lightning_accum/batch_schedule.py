"""A schedule of the global batch by the run's position on an axis (docs/howto.md, "Ramp the batch by tokens")."""

from __future__ import annotations

import bisect
import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_accum.ledger import AXES, AccumulationLedger
from lightning_accum.options import validate_choice

__all__ = [
    "BATCH_UNITS",
    "LR_SCALING_CHOICES",
    "SCHEDULE_AXES",
    "BatchSchedule",
    "Stage",
    "parse_count",
    "parse_stages",
]

#: The axes a batch schedule's thresholds may be stated on.
SCHEDULE_AXES: tuple[str, ...] = ("tokens", "samples", "updates")
#: What a stage's batch counts: samples per update, or tokens per update (fixed-length rows).
BATCH_UNITS: tuple[str, ...] = ("samples", "tokens")
#: How the learning rate follows the batch: by its square root, linearly, or not at all.
LR_SCALING_CHOICES: tuple[str, ...] = ("sqrt", "linear")

_SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}
_COUNT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMBT]?)\s*$", re.IGNORECASE)


def parse_count(text: str) -> int:
    """A count with an optional K, M, B or T suffix, as Megatron writes it.

    Example:
        >>> parse_count("250B"), parse_count("1.5M"), parse_count("768")
        (250000000000, 1500000, 768)
    """
    match = _COUNT.match(text)
    value = None
    if match is not None:
        whole, fraction = [*match.group(1).split("."), ""][:2]
        scale = _SUFFIXES[match.group(2).upper()]
        numerator = int(whole + fraction) * scale
        denominator = 10 ** len(fraction)
        value = numerator // denominator if numerator % denominator == 0 else None
    if value is None:
        raise ValueError(
            "A batch schedule's count must be a whole number with an optional K, M, B or T suffix;"
            f" got {text!r}. Write e.g. '250B' or '1500000'."
        )
    return value


def parse_stages(text: str) -> dict[int, int]:
    """Megatron's ``"threshold:batch ..."`` form as a dict.

    Example:
        >>> parse_stages("0:768 250B:1536 500B:3072")
        {0: 768, 250000000000: 1536, 500000000000: 3072}
    """
    stages: dict[int, int] = {}
    for item in text.split():
        threshold, sep, batch = item.partition(":")
        if not sep:
            raise ValueError(
                f"`stages={text!r}`: each stage is written 'threshold:batch', got {item!r}."
                " Write e.g. '0:768 250B:1536 500B:3072'."
            )
        value = parse_count(threshold)
        if stages and value <= max(stages):  # a dict would keep one of two equal thresholds silently
            raise _not_increasing(max(stages), value)
        stages[value] = parse_count(batch)
    return stages


def _not_increasing(before: int, after: int) -> ValueError:
    return ValueError(
        f"`BatchSchedule(stages=...)`: thresholds must increase, but {after} follows {before}."
        " Write the stages in increasing order of their threshold, each threshold once."
    )


@dataclass(frozen=True)
class Stage:
    """One stage of a :class:`BatchSchedule`: its ``index``, its ``threshold`` on the axis, ``samples`` per update and
    ``tokens`` per update (with ``batch_unit="tokens"``, else ``None``).
    """

    index: int
    threshold: int
    samples: int
    tokens: int | None = None


class BatchSchedule:
    """A schedule of the global batch (samples per update) by the run's position on ``axis``.

    Args:
        stages: ``{threshold: batch}`` (the first threshold 0, thresholds increasing), or Megatron's string form
            ``"0:768 250B:1536 500B:3072"``.
        axis: What the thresholds count over every replica: ``"tokens"``, ``"samples"`` or ``"updates"`` (applied).
        batch_unit: ``"samples"`` per update, or ``"tokens"`` per update for rows of ``sequence_length`` tokens.
        sequence_length: The tokens of one row, with ``batch_unit="tokens"``.
        lr_scaling: ``"sqrt"``, ``"linear"`` or ``None``: the factor ``(B_i / B_0) ** 0.5`` or ``B_i / B_0`` on
            stage ``i``'s learning rate.

    Raises:
        ValueError: The first threshold is not 0, thresholds do not increase, a batch is not positive, a tokens
            batch is not a whole number of rows, or an argument is not one of its choices.

    Example:
        >>> schedule = BatchSchedule({0: 64, 2_000_000: 128, 6_000_000: 256}, axis="tokens", lr_scaling="sqrt")
        >>> schedule.stage_at(2_500_000).samples, schedule.lr_factor(2)
        (128, 2.0)
    """

    def __init__(
        self,
        stages: Mapping[int, int] | str,
        axis: str = "tokens",
        batch_unit: str = "samples",
        sequence_length: int | None = None,
        lr_scaling: str | None = None,
    ) -> None:
        self.axis = validate_choice("axis", axis, SCHEDULE_AXES)
        self.batch_unit = validate_choice("batch_unit", batch_unit, BATCH_UNITS)
        if lr_scaling is not None:
            validate_choice("lr_scaling", lr_scaling, LR_SCALING_CHOICES)
        self.lr_scaling = lr_scaling
        self.sequence_length = sequence_length
        table = parse_stages(stages) if isinstance(stages, str) else dict(stages)
        self.stages: tuple[Stage, ...] = tuple(self._stages(table))
        self._thresholds = [stage.threshold for stage in self.stages]

    @classmethod
    def ramp(
        cls, start: int, increment: int, over: int, final: int, axis: str = "tokens", **kwargs: Any
    ) -> BatchSchedule:
        """Megatron's ramp (``--rampup-batch-size``): ``start`` grows by ``increment`` to ``final`` over ``over`` units.

        Example:
            >>> BatchSchedule.ramp(start=32, increment=32, over=300, final=128, axis="samples").table()
            {0: 32, 100: 64, 200: 96, 300: 128}
        """
        for name, value in (("start", start), ("increment", increment), ("over", over), ("final", final)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`BatchSchedule.ramp({name}=...)` must be a positive int, got {value!r}.")
        if (final - start) % increment or final <= start:
            suggested = start + increment * max(1, (final - start) // increment)
            raise ValueError(
                f"`BatchSchedule.ramp`: `final - start` ({final} - {start}) must be a positive multiple of"
                f" `increment={increment}`. Pass e.g. `final={suggested}`."
            )
        steps = (final - start) // increment
        stages = {-(-i * over // steps): start + i * increment for i in range(steps + 1)}
        return cls(stages, axis=axis, **kwargs)

    def _stages(self, table: dict[int, int]) -> list[Stage]:
        thresholds = list(table)
        if not thresholds or thresholds[0] != 0:
            first = thresholds[0] if thresholds else None
            raise ValueError(
                f"`BatchSchedule(stages=...)`: the first threshold must be 0 (the batch the run starts with), got"
                f" {first!r}. Add a stage `0: <batch>` at the start of the schedule."
            )
        for before, after in itertools.pairwise(thresholds):
            if after <= before:
                raise _not_increasing(before, after)
        stages = []
        for index, (threshold, batch) in enumerate(table.items()):
            if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
                raise ValueError(f"`BatchSchedule`: stage {index}'s batch must be a positive int, got {batch!r}.")
            if self.batch_unit == "samples":
                stages.append(Stage(index, threshold, batch))
                continue
            length = self.sequence_length
            if isinstance(length, bool) or not isinstance(length, int) or length < 1:
                raise ValueError(
                    f"`BatchSchedule(batch_unit='tokens')` needs `sequence_length`, the tokens of one row (a positive"
                    f" int), got {length!r}. Pass e.g. `sequence_length=2048`, or state the batch in samples."
                )
            if batch % length:
                raise ValueError(
                    f"`BatchSchedule`: stage {index} (from {threshold} {self.axis}) holds {batch} tokens per update,"
                    f" not a whole number of rows of `sequence_length={length}`. Use a multiple of {length}, e.g."
                    f" {max(length, batch // length * length)} or {(batch // length + 1) * length}."
                )
            stages.append(Stage(index, threshold, batch // length, batch))
        return stages

    def table(self) -> dict[int, int]:
        """``{threshold: batch}`` as stated (samples, or tokens with ``batch_unit="tokens"``)."""
        return {s.threshold: s.samples if s.tokens is None else s.tokens for s in self.stages}

    def __repr__(self) -> str:
        scaling = "" if self.lr_scaling is None else f", lr_scaling={self.lr_scaling!r}"
        return f"BatchSchedule({self.table()}, axis={self.axis!r}{scaling})"

    def position(self, ledger: AccumulationLedger) -> int:
        """The ledger's count on the schedule's axis."""
        return int(getattr(ledger, AXES[self.axis]))

    def stage_at(self, position: int | AccumulationLedger) -> Stage:
        """The stage of a group that starts at ``position`` (a count on the axis, or a ledger)."""
        if isinstance(position, AccumulationLedger):
            position = self.position(position)
        return self.stages[bisect.bisect_right(self._thresholds, position) - 1]

    def check(self, microbatch_size: int, replicas: int) -> None:
        """Raise ``ValueError`` naming the first stage whose batch is not a multiple of ``m · D``."""
        unit = microbatch_size * replicas
        for stage in self.stages:
            if stage.samples % unit:
                low, high = stage.samples // unit * unit, (stage.samples // unit + 1) * unit
                nearest = f"{low} or {high}" if low else f"{high}"
                raise ValueError(
                    f"`BatchSchedule`: stage {stage.index} (from {stage.threshold} {self.axis}) holds {stage.samples}"
                    f" samples per update, not a multiple of m × D = {microbatch_size} × {replicas} = {unit} (the"
                    f" samples of one micro-batch on every replica). Use {nearest} for that stage, or change the"
                    " loader's batch size or the device count."
                )

    def microbatches(self, ledger: AccumulationLedger, microbatch_size: int, replicas: int) -> int:
        """``A``: the micro-batches per replica of the group starting at the ledger's position (checked)."""
        self.check(microbatch_size, replicas)
        return self.stage_at(ledger).samples // (microbatch_size * replicas)

    def lr_factor(self, stage: int | Stage) -> float:
        """The factor on the learning rate of the updates of ``stage`` (1.0 without ``lr_scaling``)."""
        index = stage.index if isinstance(stage, Stage) else stage
        ratio = self.stages[index].samples / self.stages[0].samples
        if self.lr_scaling == "sqrt":
            return float(ratio**0.5)
        return float(ratio) if self.lr_scaling == "linear" else 1.0

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BatchSchedule):
            return NotImplemented
        return (self.stages, self.axis, self.lr_scaling) == (other.stages, other.axis, other.lr_scaling)

    def __hash__(self) -> int:
        return hash((self.stages, self.axis, self.lr_scaling))


def as_schedule(value: BatchSchedule | Mapping[int, int] | str | None) -> BatchSchedule | None:
    """A strategy's ``batch_schedule=`` as a :class:`BatchSchedule` (a dict or string: on tokens)."""
    if value is None or isinstance(value, BatchSchedule):
        return value
    if isinstance(value, (str, Mapping)):
        return BatchSchedule(value)
    raise TypeError(
        f"`batch_schedule` must be a BatchSchedule, a dict {{threshold: batch}}, a string such as"
        f" '0:768 250B:1536', or None; got {type(value).__name__}."
        " Pass e.g. `BatchSchedule({0: 64, 2_000_000: 128})`."
    )
