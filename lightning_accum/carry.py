"""An accumulation group across a checkpoint: what a checkpoint written inside it carries, and the group reopened.

The checkpoint holds the group's additive sums (:data:`~lightning_accum.group.CARRIED`), summed over the replicas, and
its ``c``; the strategy saves the accumulated gradient next to them. The resumed run reopens the group with those sums
on exactly one replica (the close's all-reduce adds them to the others'), so it closes as if never interrupted, also
under another ``A`` or number of replicas. Pure functions over plain values, composed by the engine; the entry around
them is :mod:`lightning_accum.core.checkpoint`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_accum.group import CARRIED, COUNT_SPLIT, GroupSums, Slot

__all__ = ["carried_state", "reopened_group"]

GroupScale = float | Tensor


def carried_state(
    microbatches: int, reduced: Sequence[float], group_scale: GroupScale | None, consistent: bool
) -> dict[str, Any]:
    """The entry of an open group, from its vector summed over the replicas (``reduced``, read on the host).

    Returns:
        ``microbatches`` (per replica), ``sums`` (the carried slots by name, floats), ``scale_ref`` (the group's
        ``c``, or ``None`` if no micro-batch reported a loss; the key keeps its written name), ``scale_ref_is_tensor``
        (the run's first group forms ``w / c`` with ``c`` a float64 tensor: resumed, it must do the same) and
        ``consistent`` (the gradient holds exactly the recorded micro-batches).

    Example:
        >>> from lightning_accum.group import VECTOR_SIZE
        >>> state = carried_state(2, [5.0] + [0.0] * (VECTOR_SIZE - 1), 8.0, True)
        >>> state["sums"]["units"], state["scale_ref"]
        (5.0, 8.0)
    """
    return {
        "microbatches": microbatches,
        "sums": {slot.name.lower(): float(reduced[slot]) for slot in CARRIED},
        "scale_ref": float(group_scale) if group_scale is not None else None,
        "scale_ref_is_tensor": isinstance(group_scale, Tensor),
        "consistent": consistent,
    }


def reopened_group(
    state: Mapping[str, Any], holds_sums: bool, position: int | None, total: int
) -> tuple[GroupSums, GroupScale | None]:
    """The group a checkpoint was written in, reopened: its sums and its ``c``.

    Args:
        state: What :func:`carried_state` gave when the checkpoint was written.
        holds_sums: Whether this replica adds the carried sums to the group (exactly one replica does).
        position: ``None``: the run resumes where the group's micro-batches left off (the same grouping). Else the
            places of the group that Lightning's grouping counts as done now (another ``A`` or ``D``): the carried
            micro-batches then count as ``total``, wherever they fall.
        total: The carried micro-batches over all replicas of the run that wrote the checkpoint.
    """
    group = GroupSums()
    if holds_sums:  # an entry written before documents were counted has no documents' sums: 0
        group.carried = {slot: float(state["sums"].get(slot.name.lower(), 0.0)) for slot in CARRIED}
    if position is None:
        group.microbatches = int(state["microbatches"])
    else:
        group.missing = position
        group.carried_microbatches = total
        sums = state["sums"]  # the carried samples, known alike on every replica: where the group resumes, in samples
        group.carried_samples = int(sums.get("samples_hi", 0.0)) * COUNT_SPLIT + int(sums.get("samples_lo", 0.0))
        if holds_sums:
            group.carried[Slot.MICROBATCHES] = float(total)
    scale = state.get("scale_ref")
    if scale is None:
        return group, None
    if state.get("scale_ref_is_tensor"):
        return group, torch.tensor(float(scale), dtype=torch.float64)  # a 0-d CPU tensor works on any device
    return group, float(scale)
