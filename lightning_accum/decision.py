"""What to do with a closed group, decided alike on every replica from its reduced values, and its booking."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from lightning_accum.carry import Carried
from lightning_accum.group import UNIT_CODES, GroupSums, ReducedGroup
from lightning_accum.ledger import AccumulationLedger, GroupRecord
from lightning_accum.options import AccumulationOptions

__all__ = [
    "GroupDecisions",
    "GroupListener",
    "GroupOutcome",
    "check_agreement",
    "classify",
    "empty_message",
    "excess_message",
    "group_record",
    "negative_message",
    "no_update_message",
    "nonfinite_message",
    "partial_message",
    "raised_reference",
    "schedule_due",
    "short_epoch_message",
    "units_agree",
]

Action = Literal["apply", "skip", "drop"]
#: ``listener(record, batch_samples)``: see :meth:`GroupDecisions.add_listener`.
GroupListener = Callable[[GroupRecord, Sequence[int]], None]
Say = Callable[[str], None]


@dataclass(slots=True)
class GroupOutcome:
    """What to do with a closed group: its ``action`` (``"apply"``, ``"skip"`` or ``"drop"``), the ``factor``
    ``c · D / W`` for its gradients (1.0 unless applied), its ``record``, whether the engine already ``scaled`` the
    gradients, and this replica's ``batch_samples`` (micro-batch sizes known on the host) for the listeners.
    """

    action: Action
    factor: float
    record: GroupRecord
    scaled: bool = False
    batch_samples: list[int] = field(default_factory=list)
    #: Parameters that held a nonzero gradient when the (manual) group opened, over all replicas: the manual API
    #: refuses such a group at its close.
    stale: int = 0


def units_agree(codes: float, squares: float, count: int) -> bool:
    """Whether ``count`` replicas used one unit: codes summing to ``codes``, squares to ``squares`` (variance 0)."""
    return squares * count == codes * codes


def check_agreement(
    reduced: ReducedGroup, microbatches: int, replicas: int, ends_epoch: bool, unit: str | None
) -> None:
    """Raise the same error on every replica when replicas closed the group differently.

    Raises:
        RuntimeError: Some replicas' data ended with this group while others go on, or replicas ran different
            numbers of micro-batches or weighted by different units.
        ValueError: A reported count was negative.

    Example:
        >>> from lightning_accum.group import Slot, VECTOR_SIZE
        >>> values = [0.0] * VECTOR_SIZE; values[Slot.MICROBATCHES] = 3.0
        >>> check_agreement(ReducedGroup.from_values(values), microbatches=2, replicas=2, ends_epoch=False, unit=None)
        ... # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        RuntimeError: Replicas closed an accumulation group with different numbers of micro-batches (this replica: 2...
    """
    if 0 < reduced.ended < replicas:
        raise RuntimeError(
            f"The training data of {reduced.ended} of {replicas} replicas ended with this accumulation group while"
            f" the others have more batches (this replica's data {'ended' if ends_epoch else 'goes on'}). Replicas"
            " must see the same number of batches per epoch, or the others would wait in a collective forever:"
            " shard the iterable dataset evenly (drop the remainder), or use a DistributedSampler."
        )
    if reduced.microbatches != microbatches * replicas:
        raise RuntimeError(
            f"Replicas closed an accumulation group with different numbers of micro-batches (this replica:"
            f" {microbatches}, all {replicas} replicas: {reduced.microbatches}). Every replica must see the same"
            " number of batches per epoch: use a DistributedSampler (Lightning adds one for map-style datasets) or"
            " make the iterable dataset yield equally many batches on every rank."
        )
    codes = reduced.unit_code
    if codes != UNIT_CODES.get(unit or "", 0.0) * replicas or not units_agree(
        codes, reduced.unit_code_squared, replicas
    ):
        raise RuntimeError(
            f"Replicas weight micro-batches by different units (this replica: {unit!r}). Report `num_tokens` on"
            " every rank, or set `normalize=` explicitly on the strategy."
        )
    if reduced.negative > 0:
        raise ValueError(negative_message(reduced.negative, "micro-batch", "in this group"))


def negative_message(negative: int, counts: str, where: str) -> str:
    """The error for ``negative`` counts below zero, reported by ``counts`` at ``where``."""
    return (
        f"A negative `num_tokens`, `num_samples` or `num_documents` was reported {where} ({negative} {counts} counts"
        " below zero over all replicas). Counts must be >= 0: return the number of supervised units, e.g."
        " `(labels != -100).sum()`."
    )


def group_record(reduced: ReducedGroup) -> GroupRecord:
    """The record of a closed group (completed once the optimizer ran): its weighted loss and its counts."""
    units = reduced.units
    return GroupRecord(
        loss=reduced.weighted_loss / units if units > 0 else math.nan,
        tokens=reduced.tokens,
        samples=reduced.samples,
        microbatches=reduced.microbatches,
        applied=False,
        documents=reduced.documents,
    )


def raised_reference(reference: float | None, reduced: ReducedGroup) -> float | None:
    """``M`` after a group: never lowered, raised by a group whose mean micro-batch weight is larger.

    Example:
        >>> from lightning_accum.group import Slot, VECTOR_SIZE
        >>> values = [0.0] * VECTOR_SIZE; values[Slot.UNITS], values[Slot.MICROBATCHES] = 30.0, 3.0
        >>> group = ReducedGroup.from_values(values)  # a mean weight of 10 per micro-batch
        >>> raised_reference(4.0, group), raised_reference(20.0, group), raised_reference(None, group)
        (10.0, 20.0, 10.0)
    """
    if reduced.units <= 0 or reduced.microbatches <= 0:
        return reference
    mean_weight = reduced.units / reduced.microbatches
    return mean_weight if reference is None else max(reference, mean_weight)


def classify(reduced: ReducedGroup, partial: bool, partial_group: str, nonfinite: bool) -> tuple[Action, str | None]:
    """``(action, skip_reason)``: ``"drop"`` a partial group under ``"drop"``, else skip ``"empty"`` or ``"nonfinite"``.

    Example:
        >>> from lightning_accum.group import VECTOR_SIZE
        >>> classify(ReducedGroup.from_values([0.0] * VECTOR_SIZE), False, partial_group="drop", nonfinite=False)
        ('skip', 'empty')
    """
    if partial and partial_group == "drop":
        return "drop", None
    if reduced.units <= 0:
        return "skip", "empty"
    if nonfinite:
        return "skip", "nonfinite"
    return "apply", None


def schedule_due(record: GroupRecord, ledger: AccumulationLedger, schedule_on: str, frequency: int = 1) -> bool:
    """Whether a schedule stepping every ``frequency`` applied (or attempted) updates advances after ``record``.

    Example:
        >>> skipped = GroupRecord(1.0, tokens=9, samples=1, microbatches=1, applied=False, skip_reason="overflow")
        >>> ledger = AccumulationLedger(); ledger.record(skipped)
        >>> schedule_due(skipped, ledger, "applied"), schedule_due(skipped, ledger, "attempted")
        (False, True)
    """
    if record.dropped:
        return False
    if schedule_on == "applied":
        return record.applied and ledger.updates_applied % frequency == 0
    return ledger.updates_attempted % frequency == 0


def partial_message(microbatches: int, accumulate: int, partial_group: str) -> str:
    """What happens to a partial final group (said once per run)."""
    what = (
        "updated with its real denominator (partial_group='rescale')"
        if partial_group == "rescale"
        else "dropped without an update; its examples are recorded in the ledger (partial_group='drop')"
    )
    return (
        f"lightning_accum: an epoch ended with a partial group of {microbatches} of {accumulate} micro-batches; {what}."
    )


def excess_message(update: int, microbatches: int) -> str:
    """A token count above its batch's label positions (said once per run)."""
    return (
        f"lightning_accum: {microbatches} micro-batch(es) of update {update} reported more tokens (`num_tokens`, or"
        " `count_tokens`) than their batch has label positions (`batch['labels'].numel()`). A count of supervised"
        " tokens is at most that: this one probably counts something else (the inputs with their padding, or the"
        " batch more than once), and the updates are weighted by it as reported. Count the labels that are not the"
        " ignore index. (Said once.)"
    )


def empty_message(update: int, unit: str) -> str:
    """Why a group without units is skipped (said once per run)."""
    return (
        f"lightning_accum: update {update} is skipped: its group holds no {unit} at all (every micro-batch"
        " on every replica reported 0). Likely causes: every label of these micro-batches is ignored (`ignore_index`),"
        " or `num_tokens` is computed on the wrong tensor (e.g. the input ids' padding instead of the labels). Such"
        " updates are counted in `ledger.updates_skipped['empty']`; this is said once."
    )


def no_update_message(ledger: AccumulationLedger) -> str | None:
    """The error for a run that attempted updates and applied none (``None`` otherwise)."""
    attempted, skipped, unit = ledger.updates_attempted, ledger.updates_skipped, ledger.normalization
    if attempted == 0 or ledger.updates_applied > 0 or unit is None:  # no unit: every step returned None (skipped)
        return None
    if skipped.get("empty", 0) == attempted:  # "batches" weigh every micro-batch 1: never empty
        why = (
            f"every micro-batch reported zero {unit} on every replica, so no group had a weight. `training_step` should"
            f" return `num_{unit}`, the {unit} its mean loss averages over (for tokens the labels that are not the"
            " ignore index, e.g. `lightning_accum.supervised_tokens(labels, shift=...)`): are all labels ignored, or is"
            " the count taken from the wrong tensor?"
        )
    else:
        why = (
            f"every update was skipped ({', '.join(f'{k} {v}' for k, v in skipped.items() if v)}): 'overflow' by the"
            " GradScaler (inf/NaN gradients in every group), 'nonfinite' by the NaN/Inf guard (`on_nonfinite='skip'`),"
            " 'empty' for groups without a unit. Find the NaN/Inf source (a lower learning rate, bf16 instead of"
            " fp16), or report the units"
        )
    return f"The fit attempted {attempted} update(s) and applied none: {why}. The parameters are unchanged."


def nonfinite_message(update: int, where: str, loss: float, on_nonfinite: str) -> str:
    """The error (``on_nonfinite="raise"``) or warning (``"skip"``) for a non-finite group gradient."""
    if on_nonfinite == "raise":
        return (
            f"The gradient of update {update} is not finite (first non-finite gradient: {where}; group loss {loss})."
            " Find the NaN/Inf source, or pass `on_nonfinite='skip'` to skip such updates."
        )
    return (
        f"lightning_accum: skipped update {update}: its gradient is not finite (first non-finite gradient: {where})."
        " Parameters and optimizer state are unchanged (on_nonfinite='skip')."
    )


def short_epoch_message(batches_per_epoch: float, accumulate: int, partial_group: str) -> str | None:
    """The warning (``"rescale"``) or error (``"drop"``) for an epoch shorter than one group; ``None`` otherwise.

    Example:
        >>> short_epoch_message(10, 4, "rescale") is None
        True
    """
    if not math.isfinite(batches_per_epoch) or batches_per_epoch >= accumulate or batches_per_epoch <= 0:
        return None
    batches = int(batches_per_epoch)
    if partial_group == "drop":
        return (
            f"An epoch has {batches} training batches but `accumulate_grad_batches={accumulate}`; with"
            f" `partial_group='drop'` no update would ever happen. Lower `accumulate_grad_batches` to at most"
            f" {batches}, or use `partial_group='rescale'`."
        )
    return (
        f"An epoch has {batches} training batches but `accumulate_grad_batches={accumulate}`: every update uses a"
        f" partial group of {batches} micro-batches (normalized by its real denominator). Lower"
        " `accumulate_grad_batches` if that is not what you intended."
    )


_NOTHING_CARRIED = Carried()


class GroupDecisions:
    """What happens to the closed groups of a run: each one decided (:meth:`decide`), then booked (:meth:`finish`).

    Args:
        options: The run's options (``partial_group``, ``on_nonfinite``, ``max_consecutive_skips``).
        ledger: The run's ledger.
    """

    def __init__(self, options: AccumulationOptions, ledger: AccumulationLedger) -> None:
        self.options = options
        self.ledger = ledger
        #: Skipped updates since the last applied one (dropped groups count neither way).
        self.consecutive_skips = 0
        self.listeners: list[GroupListener] = []
        self._said: set[str] = set()  # the kinds of message said once per run

    def decide(
        self,
        sums: GroupSums,
        reduced: ReducedGroup,
        accumulate: int,
        replicas: int,
        ends_epoch: bool,
        nonfinite: bool,
        scaled: bool,
        describe_nonfinite: Callable[[], str] | None,
        say: tuple[Say, Say],
        carried: Carried | None = None,
    ) -> GroupOutcome:
        """The outcome of the group whose local ``sums`` reduced to ``reduced``; ``RuntimeError`` / ``ValueError`` as
        :func:`check_agreement`, or for a non-finite gradient under ``on_nonfinite="raise"``.
        """
        info, warn = say
        k, unit = sums.microbatches, self.ledger.normalization
        carried = carried or _NOTHING_CARRIED  # known alike on every replica (from the checkpoint)
        own = reduced.microbatches - carried.microbatches
        check_agreement(
            dataclasses.replace(reduced, microbatches=own) if own != reduced.microbatches else reduced,
            k,
            replicas,
            ends_epoch,
            unit,
        )
        record = group_record(reduced)
        partial = k + carried.done < accumulate
        if partial and carried.microbatches and carried.samples and k:
            # Resumed under another m or D: the carried samples say how much of the group ran, in this run's
            # micro-batches (each replica's m' = the new samples / (k · D)): complete iff Σ samples ≥ A · m' · D.
            partial = reduced.samples * k < accumulate * (reduced.samples - carried.samples)
        if partial:
            self.ledger.partial_groups += 1
            self._say_once("partial", info, partial_message(k, accumulate, self.options.partial_group))
        action, reason = classify(reduced, partial, self.options.partial_group, nonfinite)
        record.dropped = action == "drop"
        record.skip_reason = reason
        update = self.ledger.updates_attempted + 1
        if reduced.excess:
            self._say_once("excess", warn, excess_message(update, reduced.excess))
        if reason == "empty" and unit is not None:  # no unit yet: every step returned None (Lightning's skip, warned)
            self._say_once("empty", warn, empty_message(update, unit))
        elif reason == "nonfinite":
            where = describe_nonfinite() if describe_nonfinite is not None else "a parameter"
            message = nonfinite_message(update, where, record.loss, self.options.on_nonfinite)
            if self.options.on_nonfinite == "raise":
                raise RuntimeError(message)
            warn(message)
        factor = reduced.group_scale_times_d / reduced.units if action == "apply" else 1.0
        return GroupOutcome(
            action, factor, record, scaled=scaled, batch_samples=sums.batch_samples, stale=reduced.stale
        )

    def _say_once(self, kind: str, say: Say, message: str) -> None:
        if kind not in self._said:
            self._said.add(kind)
            say(message)

    def finish(self, outcome: GroupOutcome, applied: bool, skip_reason: str | None = None) -> GroupRecord:
        """Book the outcome after the optimizer ran; ``RuntimeError`` after ``max_consecutive_skips`` skips in a row."""
        record = outcome.record
        record.applied = applied
        if not applied and record.skip_reason is None and not record.dropped:
            record.skip_reason = skip_reason
        self.ledger.record(record)
        if not record.dropped:
            self.consecutive_skips = 0 if applied else self.consecutive_skips + 1
        for listener in self.listeners:
            listener(record, outcome.batch_samples)
        limit = self.options.max_consecutive_skips
        if limit is not None and self.consecutive_skips >= limit:
            raise RuntimeError(
                f"{self.consecutive_skips} consecutive updates were skipped (the last for {record.skip_reason!r};"
                f" skipped so far: {self.ledger.updates_skipped}): the run makes no progress. Find the source of the"
                " NaN/Inf (or the empty groups), or raise `max_consecutive_skips=` on the strategy."
            )
        return record

    def check_progress(self) -> None:
        """Raise ``RuntimeError`` at a fit's end if the run attempted updates and applied none."""
        if (message := no_update_message(self.ledger)) is not None:
            raise RuntimeError(message)

    def warn_short_epoch(self, batches_per_epoch: float, accumulate: int, warn: Say) -> None:
        """Warn (or raise under ``"drop"``) when an epoch holds fewer batches than one group."""
        message = short_epoch_message(batches_per_epoch, accumulate, self.options.partial_group)
        if message is not None and self.options.partial_group == "drop":
            raise ValueError(message)
        if message is not None:
            warn(message)

    def add_listener(self, listener: GroupListener) -> None:
        """Call ``listener(record, batch_samples)`` after every group is booked, dropped ones included (added once)."""
        if listener not in self.listeners:
            self.listeners.append(listener)

    def remove_listener(self, listener: GroupListener) -> None:
        """Stop calling ``listener`` (no effect if it was not added)."""
        if listener in self.listeners:
            self.listeners.remove(listener)
