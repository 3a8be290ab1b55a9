"""What to do with a closed group, decided from its reduced values alone.

Every replica reads the same reduced vector, so every replica takes the same decision: no rank can leave the
others waiting in a collective. Pure functions; the engine adds the messages and the ledger.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from lightning_accum.group import UNIT_CODES, ReducedGroup
from lightning_accum.ledger import GroupRecord

__all__ = ["GroupOutcome", "check_agreement", "classify"]

Action = Literal["apply", "skip", "drop"]


@dataclass(slots=True)
class GroupOutcome:
    """What to do with a closed group.

    Attributes:
        action: ``"apply"`` (scale the gradients by ``factor``, unless :attr:`scaled`, and update), ``"skip"``
            (an attempt that makes no update) or ``"drop"`` (a partial final group dropped by policy; not an
            attempt).
        factor: The multiplier ``c · D / W`` for the accumulated gradients (1.0 unless ``"apply"``).
        record: The group's record, to be completed and added to the ledger by
            :meth:`~lightning_accum.engine.AccumulationEngine.finish_group`.
        scaled: Whether the engine already multiplied the gradients it was given by ``factor`` (then the caller
            scales nothing; a group that is not applied holds no update, and the caller zeroes its gradients).
        batch_samples: The group's micro-batch sizes in samples on this replica, where known on the host
            (reported as ints or read from the batch's tensor shapes), in order; handed to the listeners.
    """

    action: Action
    factor: float
    record: GroupRecord
    scaled: bool = False
    batch_samples: list[int] = field(default_factory=list)


def check_agreement(
    reduced: ReducedGroup, microbatches: int, replicas: int, ends_epoch: bool, unit: str | None
) -> None:
    """Raise the same error on every replica when replicas closed the group differently.

    Raises:
        RuntimeError: Some replicas' data ended with this group while others go on; replicas ran different
            numbers of micro-batches; or they weight micro-batches by different units.

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
    if reduced.unit_code != UNIT_CODES.get(unit or "", 0.0) * replicas:
        raise RuntimeError(
            f"Replicas weight micro-batches by different units (this replica: {unit!r}). Report `num_tokens` on"
            " every rank, or set `normalize=` explicitly on the strategy."
        )
    if reduced.negative > 0:
        raise ValueError(
            f"A negative `num_tokens` or `num_samples` was reported in this group ({reduced.negative} micro-batch"
            " counts below zero over all replicas). Counts must be >= 0: return the number of supervised units,"
            " e.g. `(labels != -100).sum()`."
        )


def classify(reduced: ReducedGroup, partial: bool, partial_group: str, nonfinite: bool) -> tuple[Action, str | None]:
    """``(action, skip_reason)`` for a group, in the order the checks apply.

    A partial final group under ``partial_group="drop"`` is dropped (not an attempt); a group without units is
    skipped as ``"empty"``; a non-finite gradient (found by the engine's check) as ``"nonfinite"``. A GradScaler's
    own skip (``"overflow"``) is only known after the optimizer ran.

    Example:
        >>> from lightning_accum.group import Slot, VECTOR_SIZE
        >>> empty = ReducedGroup.from_values([0.0] * VECTOR_SIZE)
        >>> classify(empty, partial=False, partial_group="rescale", nonfinite=False)
        ('skip', 'empty')
        >>> classify(empty, partial=True, partial_group="drop", nonfinite=False)
        ('drop', None)
    """
    if partial and partial_group == "drop":
        return "drop", None
    if reduced.units <= 0:
        return "skip", "empty"
    if nonfinite:
        return "skip", "nonfinite"
    return "apply", None
