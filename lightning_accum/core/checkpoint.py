"""The package's checkpoint entry written and read, and a group crossing a checkpoint (docs/reliability.md)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor

from lightning_accum.carry import Carried
from lightning_accum.core.adapter import NamedParameters
from lightning_accum.core.entry import (
    CHECKPOINT_KEY,
    DISTRIBUTED_KEY,
    FORMAT,
    checked_distributed_gradients,
    checked_gradients,
    refuse_a_lost_group,
    refuse_unknown_meaning,
    validated_state,
)
from lightning_accum.core.lifecycle import GroupLifecycle
from lightning_accum.core.reading import distributed_gradients
from lightning_accum.engine import AccumulationEngine

__all__ = ["CHECKPOINT_KEY", "DISTRIBUTED_KEY", "FORMAT", "OpenGroupCheckpoint", "Writing"]


@dataclasses.dataclass(frozen=True)
class Writing:
    """A checkpoint being written, as its door tells it: the run's ``config``; ``running``, the micro-batch of the
    epoch (from 1) whose step runs while it is written; ``failed``, why the replicas cannot be reached; ``carry``, the
    group's gradient summed over the replicas (``None`` where the strategy cannot); the optimized parameters' names."""

    config: dict[str, Any]
    running: int | None
    failed: str | None
    carry: Callable[[], dict[str, Tensor] | None]
    parameter_names: list[str]


class OpenGroupCheckpoint:
    """The entry of a run and the group it carries into the resumed one, changed through the lifecycle ``group``."""

    def __init__(self, group: GroupLifecycle) -> None:
        self.group = group

    def entry(self, engine: AccumulationEngine, writing: Writing) -> dict[str, Any]:
        """The checkpoint's entry: ``engine``'s state, the configuration and the open group."""
        config = writing.config
        state = {**engine.state_dict(), "format": FORMAT, "config": config}
        held, written = engine.microbatches_in_group, self.group.written
        if written is not None and not held:
            # Nothing ran since a checkpoint's entry was read (a loaded group waiting for the loop, or reopened and
            # its gradient not yet installed): the group, and the configuration it was formed under, are the ones read.
            group, written_config = written
            count = group["microbatches"] if group else 0
            return {**state, "open_group_microbatches": count, "open_group": group, "config": written_config or config}
        state["open_group_microbatches"] = held
        carried = self.group.carried
        if held or (carried is not None and carried.microbatches):
            state["open_group"] = _group_entry(engine, carried, writing)
            if writing.running is not None:
                rank_zero_warn(
                    f"lightning_accum: this checkpoint is written while micro-batch {writing.running} of the epoch was"
                    " running. Lightning runs it again on resume, but a training loader that saves its position"
                    " (`state_dict`) already counts it as consumed, so it then delivers the next batch: that"
                    " micro-batch's examples are skipped (Lightning's behaviour, not this strategy's)."
                )
        return state

    def load(
        self,
        engine: AccumulationEngine,
        checkpoint: Mapping[str, Any],
        path: str,
        read_distributed: Callable[[list[str]], dict[str, Tensor]] | None = None,
    ) -> dict[str, Any] | None:
        """Restore ``engine`` from ``checkpoint``'s checked entry; returns it, or ``None`` without one (announced)."""
        if CHECKPOINT_KEY not in checkpoint:
            rank_zero_warn(
                f"lightning_accum: the checkpoint {path!r} holds no {CHECKPOINT_KEY!r} entry (written by another"
                " strategy, or the entry was removed): the ledger starts again at 0, the unit is chosen again, and if"
                " it was written inside an accumulation group, the micro-batches of that group before it are not in"
                " its update (the group is closed as a full one, not dropped as a partial one)."
            )
            self.group.load(None)
            return None
        state = validated_state(checkpoint[CHECKPOINT_KEY])
        written = state.get("open_group")
        if written is not None:
            written = dict(written)
            refuse_unknown_meaning(state, written, path)
            if written.get("gradients_stored") == "distributed":
                written["gradients"] = distributed_gradients(checkpoint, written, path, read_distributed)
                checked_distributed_gradients(written)
            state["open_group"] = written
        written_unit = state["ledger"].get("normalization")
        engine.load_state_dict(state)
        _honour_normalize(engine, written_unit, written or {})
        self.group.load((written, dict(state.get("config") or {})))
        return state

    def reopen(self, config: dict[str, Any], position: int, holds_sums: bool, parameters: NamedParameters) -> None:
        """Finish exactly the group the checkpoint was written in, or say which micro-batches are lost."""
        group = self.group.loaded
        if group is None:
            self.group.refuse("reopen")
        carried = None
        try:
            carried = _carried(group, config, position, holds_sums, parameters)
        finally:
            self.group.reopen(carried)

    def install(self, part: Callable[[Tensor, Tensor], Tensor | None]) -> None:
        """Add the carried gradient, ``part`` of it on this rank, to the parameters it was checked against."""
        gradients, parameters = self.group.install()
        for name, p in parameters:
            saved = gradients.get(name)
            share = part(p, saved) if saved is not None else None
            if share is not None:
                p.grad = share if p.grad is None else p.grad.add_(share)


def _group_entry(engine: AccumulationEngine, carried: Carried | None, writing: Writing) -> dict[str, Any]:
    """The open group's entry: its counters and gradient summed over the replicas (collectives), or why not."""
    config, failed = writing.config, writing.failed
    held, before = engine.microbatches_in_group, carried.microbatches if carried is not None else 0
    if failed is not None:
        group: dict[str, Any] = {"microbatches": held, "consistent": False}
        reason = f"the replicas could not be reached to sum it ({failed})"
    else:
        group = engine.open_group_state(carried)
        reason = "a micro-batch's backward had not completed"
    total, rerun = before + held * config["replicas"], int(writing.running is not None)
    group.update(replicas=config["replicas"], total_microbatches=total, carried_microbatches=before, rerun=rerun)
    if "accumulate" in config:  # known where a Trainer runs the strategy
        group["accumulate"] = config["accumulate"]
    gradients = writing.carry() if group["consistent"] else None
    if gradients is not None:
        no_gradient = [name for name in writing.parameter_names if name not in gradients]
        return {**group, "gradients": gradients, "no_gradient": no_gradient, "carried": True}
    if group["consistent"]:
        reason = "the strategy cannot carry this group's gradient (see its warning)"
    message = (
        f"lightning_accum: this checkpoint is written while {reason}; the open group's {total} micro-batch(es)"
        " (over all replicas) cannot be carried exactly and a run resumed from it will say how many of them are"
        " lost."
    )
    if failed is not None:
        warnings.warn(message, UserWarning, stacklevel=3)  # every surviving rank: rank 0 may be gone
    else:
        rank_zero_warn(message)
    return {**group, "carried": False, "reason": reason}


def _carried(
    group: Mapping[str, Any], config: dict[str, Any], position: int, holds_sums: bool, parameters: NamedParameters
) -> Carried | None:
    """What the loaded ``group`` carries into the resumed run's group at ``position``; the resume announced."""
    written = group.get("config") or {}
    _announce_changes(written, config, position)
    lost = Carried(done=position) if position else None  # the group's places done, not in its update
    replicas = int(group.get("replicas", config["replicas"]))
    total = int(group.get("total_microbatches", int(group["microbatches"]) * replicas))
    if group.get("unknown"):
        if position:
            rank_zero_warn(
                f"lightning_accum: resumed at micro-batch {position + 1} of an accumulation group from a checkpoint"
                f" without {CHECKPOINT_KEY!r} state: the group's first {position} micro-batch(es) per replica,"
                " which Lightning does not run again, are not in its update (normalized by what remains)."
            )
        return lost
    if total == 0:
        if position:
            refuse_a_lost_group(written, config, position)  # else a shorter first group after a change of A
        return lost
    if "gradients" in group:
        gradients = checked_gradients(group, parameters)
        rank_zero_info(
            f"lightning_accum: resumed inside an accumulation group; its first {total} micro-batch(es) (over all"
            " replicas) come from the checkpoint (gradient and counters), so the group closes exactly."
        )
        carried = Carried.from_entry(group, holds_sums, position, total)
        return dataclasses.replace(carried, gradients=gradients, targets=list(parameters))
    # Lightning runs again the micro-batch whose step was running when the checkpoint was written (one per replica).
    missing = max(total - int(group.get("rerun", 0)) * replicas, 0)
    rank_zero_warn(
        f"lightning_accum: resumed inside an accumulation group, but the checkpoint does not carry the"
        f" {total} micro-batch(es) of that group it holds (over {replicas} replica(s);"
        f" {group.get('reason') or 'no consistent gradient'}): {missing} of them, which Lightning does not run again,"
        " are lost (not in the update, normalized by what remains, and not counted by the ledger). Checkpoints written"
        " between micro-batches (on_train_batch_end, OnExceptionCheckpoint after a failed hook there, SIGTERM) or at"
        " update boundaries resume exactly."
    )
    return lost


def _announce_changes(written: Mapping[str, Any], now: Mapping[str, Any], position: int) -> None:
    """Say which of the strategy, ``A``, ``D`` and ``partial_group`` changed since the checkpoint."""
    labels = {"strategy": "strategy", "accumulate": "accumulate_grad_batches", "replicas": "data-parallel replicas"}
    changes = [
        f"{labels.get(key, key)} {written[key]!r} -> {now[key]!r}"
        for key in ("strategy", "accumulate", "replicas", "partial_group")
        if key in written and key in now and written[key] != now[key]
    ]
    if not changes:
        return
    where = (
        f" Lightning groups micro-batches by their index in the epoch, so the first group after the resume already"
        f" counts {position} place(s) of {now['accumulate']} as done: it closes after"
        f" {now['accumulate'] - position} more micro-batch(es) per replica and is updated with its real"
        " denominator (a full group, not a partial one)."
        if position and "accumulate" in now
        else ""
    )
    rank_zero_info(f"lightning_accum: resumed with {', '.join(changes)}; the new values apply from here on.{where}")


def _honour_normalize(engine: AccumulationEngine, written_unit: str | None, group: Mapping[str, Any]) -> None:
    """An explicit ``normalize=`` wins at an update boundary (announced) and is refused inside a carried group."""
    wanted = engine.options.normalize
    if wanted == "auto" or written_unit is None or wanted == written_unit:
        return
    if group.get("gradients") is not None:
        raise ValueError(
            f"`normalize={wanted!r}` conflicts with the checkpoint: it was written inside an accumulation group"
            f" whose gradient is weighted by {written_unit}. Resume with `normalize={written_unit!r}` (or"
            " 'auto') to finish that group exactly, or resume from a checkpoint written at an update boundary to"
            " change the unit."
        )
    engine.ledger.normalization = wanted
    engine.reference_weight = None
    rank_zero_info(
        f"lightning_accum: the checkpoint's run weighted micro-batches by {written_unit}; from now on they are"
        f" weighted by {wanted} (`normalize={wanted!r}` given to the strategy wins at an update boundary)."
    )
