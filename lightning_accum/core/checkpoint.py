"""The checkpoint of a run, and of a group open when it is written: save, validate, load, reopen, install.

A checkpoint written through an accumulation strategy holds, under the key :data:`CHECKPOINT_KEY`, the engine's state
(the ledger, ``M``), the configuration the run's groups depend on (``A``, ``D``, ``normalize``, ``partial_group``),
and, when written inside a group, that group (``open_group``): its counters summed over the replicas and its
accumulated gradient, so that a run resumed from it closes the group exactly, also under another ``A``, ``D`` or
strategy.

The carried gradient has one meaning whatever strategy wrote it (entry ``format`` 2): the sum over the writing run's
data-parallel replicas of ``Σ (w / c) · ∇loss`` over the group's micro-batches so far, ``c`` being
``open_group.scale_ref``; each strategy puts it back in its own terms on resume (docs/reliability.md, "What a
checkpoint written inside a group carries"). The entry is checked before anything is installed
(:mod:`~lightning_accum.core.entry`, where :data:`CHECKPOINT_KEY` and :data:`DISTRIBUTED_KEY` are defined).

:class:`OpenGroupCheckpoint` is the lifecycle, owned by the strategy: :meth:`~OpenGroupCheckpoint.entry` when
writing, :meth:`~OpenGroupCheckpoint.load` when Lightning restores (before ``setup``),
:meth:`~OpenGroupCheckpoint.reopen` at the first micro-batch of the resumed run (the loop's position is known then),
and :meth:`~OpenGroupCheckpoint.install` right before its first backward (after Lightning's ``zero_grad`` at a
group's start, so the carried gradient survives it). The strategy hands in the engine-specific parts as plain
values and callables: the gradient to carry, whether this rank holds the group's sums.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor

from lightning_accum.core.adapter import NamedParameters
from lightning_accum.core.entry import (
    CHECKPOINT_KEY,
    DISTRIBUTED_KEY,
    FORMAT,
    checked_distributed_gradients,
    checked_gradients,
    malformed,
    refuse_a_lost_group,
    refuse_unknown_meaning,
    validated_state,
)
from lightning_accum.core.lifecycle import GroupLifecycle
from lightning_accum.core.reading import distributed_gradients
from lightning_accum.engine import AccumulationEngine

__all__ = [
    "CHECKPOINT_KEY",
    "DISTRIBUTED_KEY",
    "FORMAT",
    "OpenGroupCheckpoint",
    "checked_gradients",
    "malformed",
    "validated_state",
]


class OpenGroupCheckpoint:
    """The package's checkpoint entry of a run, and the group it carries from the writing run to the resumed one: the
    operations; the group's state (read and waiting, its carried gradient) is the lifecycle's."""

    def __init__(self, group: GroupLifecycle) -> None:
        self.group = group

    # ------------------------------------------------------------------ writing

    def entry(
        self,
        engine: AccumulationEngine,
        config: dict[str, Any],
        running: int | None,
        failed: str | None,
        carry: Callable[[], dict[str, Tensor] | None],
        parameter_names: list[str],
    ) -> dict[str, Any]:
        """The checkpoint's entry: ``engine``'s state, ``config`` (:meth:`AccumulationCore.configuration
        <lightning_accum.core.core.AccumulationCore.configuration>`) and, inside a group, the group.

        Args:
            running: The micro-batch of the epoch (counted from 1) whose step is running while the checkpoint is written
                (Lightning runs it again on resume), or ``None``.
            failed: Why the replicas cannot be reached for a collective (then the group's gradient is not carried).
            carry: The group's gradient by parameter name, summed over the replicas (a collective), or ``None`` where
                the strategy cannot carry it (it says why).
            parameter_names: The optimized parameters' names (those without a carried gradient are listed).
        """
        state = engine.state_dict()
        state["format"] = FORMAT
        state["config"] = config
        if self.group.loaded is not None and self.group.pending_entry is not None:
            # Written after a resume and before the first micro-batch reopened the checkpoint's group (a signal, an
            # exception checkpoint when the first fetch fails): nothing ran since, so the group, and the configuration
            # it was formed under, are the ones read.
            state["open_group_microbatches"], group, written_config = self.group.pending_entry
            state["open_group"] = group
            state["config"] = written_config or config
            return state
        open_microbatches = engine.microbatches_in_group
        state["open_group_microbatches"] = open_microbatches
        carried_before = engine.carried_microbatches
        if open_microbatches or carried_before:
            total = carried_before + open_microbatches * config["replicas"]
            rerun = int(running is not None)
            state["open_group"] = self._group_entry(engine, config, total, rerun, failed, carry, parameter_names)
            if running is not None:
                rank_zero_warn(
                    f"lightning_accum: this checkpoint is written while micro-batch {running} of the epoch was running."
                    " Lightning runs it again on resume, but a training loader that saves its position (`state_dict`)"
                    " already counts it as consumed, so it then delivers the next batch: that micro-batch's examples"
                    " are skipped (Lightning's behaviour, not this strategy's)."
                )
        return state

    @staticmethod
    def _group_entry(
        engine: AccumulationEngine,
        config: dict[str, Any],
        total: int,
        rerun: int,
        failed: str | None,
        carry: Callable[[], dict[str, Tensor] | None],
        parameter_names: list[str],
    ) -> dict[str, Any]:
        """The open group's entry: counters and gradient summed over the replicas (collectives), or why not."""
        if failed is not None:
            group: dict[str, Any] = {"microbatches": engine.microbatches_in_group, "consistent": False}
            reason = f"the replicas could not be reached to sum it ({failed})"
        else:
            group = engine.open_group_state()
            reason = "a micro-batch's backward had not completed"
        group.update(
            replicas=config["replicas"],
            total_microbatches=total,
            carried_microbatches=engine.carried_microbatches,  # from an earlier checkpoint: total is checked
            rerun=rerun,
        )
        if "accumulate" in config:  # known where a Trainer runs the strategy
            group["accumulate"] = config["accumulate"]
        gradients = carry() if group["consistent"] else None
        if group["consistent"] and gradients is None:
            reason = "the strategy cannot carry this group's gradient (see its warning)"
        if gradients is not None:
            group["gradients"] = gradients
            group["no_gradient"] = [name for name in parameter_names if name not in gradients]
            group["carried"] = True
            return group
        group["carried"] = False
        group["reason"] = reason
        message = (
            f"lightning_accum: this checkpoint is written while {reason}; the open group's {total} micro-batch(es)"
            " (over all replicas) cannot be carried exactly and a run resumed from it will say how many of them are"
            " lost."
        )
        if failed is not None:
            warnings.warn(message, UserWarning, stacklevel=3)  # every surviving rank: rank 0 may be gone
        else:
            rank_zero_warn(message)
        return group

    # ------------------------------------------------------------------ loading

    def load(
        self,
        engine: AccumulationEngine,
        checkpoint: Mapping[str, Any],
        path: str,
        read_distributed: Callable[[list[str]], dict[str, Tensor]] | None = None,
    ) -> dict[str, Any] | None:
        """Restore ``engine`` from ``checkpoint``'s entry, checked first; keep its open group for :meth:`reopen`.

        Args:
            checkpoint: The loaded checkpoint (a distributed checkpoint's metadata file, for a folder).
            path: Where it was read from (named in messages).
            read_distributed: Reads the open group's gradient of the given parameters from a distributed checkpoint's
                shards (strategies that read such folders); ``None`` elsewhere.

        Returns:
            The checked entry, or ``None`` when the checkpoint has none (announced).
        """
        self.group.pending_entry = None
        if CHECKPOINT_KEY not in checkpoint:
            rank_zero_warn(
                f"lightning_accum: the checkpoint {path!r} holds no {CHECKPOINT_KEY!r} entry (written by another"
                " strategy, or the entry was removed): the ledger starts again at 0, the unit is chosen again, and if"
                " it was written inside an accumulation group, the micro-batches of that group before it are not in"
                " its update (the group is closed as a full one, not dropped as a partial one)."
            )
            self.group.loaded = {"microbatches": 0, "unknown": True}
            return None
        state = validated_state(checkpoint[CHECKPOINT_KEY])
        written_group = state.get("open_group")
        if written_group is not None:
            written_group = dict(written_group)
            refuse_unknown_meaning(state, written_group, path)
            if written_group.get("gradients_stored") == "distributed":
                written_group["gradients"] = distributed_gradients(checkpoint, written_group, path, read_distributed)
                checked_distributed_gradients(written_group)
            state["open_group"] = written_group
        written_unit = state["ledger"].get("normalization")
        engine.load_state_dict(state)
        group = dict(written_group or {"microbatches": 0})
        _honour_normalize(engine, written_unit, group)
        config = dict(state.get("config") or {})
        self.group.pending_entry = (int(group["microbatches"]), written_group, config)
        group["config"] = config  # checked against the loop's position at the reopen
        self.group.loaded = group
        return state

    # ------------------------------------------------------------------ resuming

    def reopen(
        self,
        engine: AccumulationEngine,
        config: dict[str, Any],
        position: int,
        holds_sums: bool,
        parameters: NamedParameters,
    ) -> None:
        """Finish, exactly, the group the checkpoint was written in (its gradient is added by :meth:`install`); or
        say which micro-batches are lost.

        Args:
            engine, config: The run's engine and configuration (as in :meth:`entry`).
            position: The micro-batches of the group the resumed run does not run again (Lightning's grouping: the
                first micro-batch's index in its epoch modulo ``A``; a Fabric loop resumes at the micro-batch after
                the one it saved at: 0).
            holds_sums: Whether this rank carries the group's counters and gradient (one replica does; the close's
                all-reduce and DDP's average add the others').
            parameters: The optimized parameters by name, to check the carried gradient against.
        """
        group, self.group.loaded = self.group.loaded, None
        if group is None:
            return
        _announce_changes(group.get("config") or {}, config, position)
        written_replicas = int(group.get("replicas", config["replicas"]))
        total = int(group.get("total_microbatches", int(group["microbatches"]) * written_replicas))
        if group.get("unknown"):
            if position:
                engine.note_missing_microbatches(position)
                rank_zero_warn(
                    f"lightning_accum: resumed at micro-batch {position + 1} of an accumulation group from a checkpoint"
                    f" without {CHECKPOINT_KEY!r} state: the group's first {position} micro-batch(es) per replica,"
                    " which Lightning does not run again, are not in its update (normalized by what remains)."
                )
            return
        if total == 0:
            if position:
                refuse_a_lost_group(group.get("config") or {}, config, position)
                engine.note_missing_microbatches(position)  # a shorter first group after a change of A
            return
        if "gradients" in group:
            gradients = checked_gradients(group, parameters)
            engine.resume_open_group(group, holds_sums=holds_sums, position=position, total=total)
            self.group.carried = gradients  # each strategy's `part` says what of it each rank adds (see `install`)
            self.group.targets = list(parameters)
            rank_zero_info(
                f"lightning_accum: resumed inside an accumulation group; its first {total} micro-batch(es) (over all"
                " replicas) come from the checkpoint (gradient and counters), so the group closes exactly."
            )
            return
        engine.note_missing_microbatches(position)
        # Lightning runs again the micro-batch whose step was running when the checkpoint was written (one per
        # replica).
        lost = max(total - int(group.get("rerun", 0)) * written_replicas, 0)
        reason = group.get("reason") or "no consistent gradient"
        rank_zero_warn(
            f"lightning_accum: resumed inside an accumulation group, but the checkpoint does not carry the"
            f" {total} micro-batch(es) of that group it holds (over {written_replicas} replica(s); {reason}):"
            f" {lost} of them, which Lightning does not run again, are lost (not in the update, normalized by what"
            " remains, and not counted by the ledger). Checkpoints written between micro-batches"
            " (on_train_batch_end, OnExceptionCheckpoint after a failed hook there, SIGTERM) or at update boundaries"
            " resume exactly."
        )

    def install(self, part: Callable[[Tensor, Tensor], Tensor | None]) -> None:
        """Add the carried gradient to the gradients of the parameters it was checked against at the reopen (right
        before the first backward after it, or before the close when the group's remaining micro-batches had no
        backward). Those are the optimized parameters themselves: FSDP2 registers other, unsharded tensors on the
        module between a forward and its backward.

        Args:
            part: The strategy's share of this rank, given a parameter and its carried gradient (the replicas' sum):
                the tensor to add to the parameter's gradient, or ``None`` for nothing.
        """
        gradients, self.group.carried = self.group.carried, None
        parameters, self.group.targets = self.group.targets, []
        if not gradients:
            return
        for name, p in parameters:
            saved = gradients.get(name)
            share = part(p, saved) if saved is not None else None
            if share is not None:
                p.grad = share if p.grad is None else p.grad.add_(share)


def _announce_changes(written: Mapping[str, Any], now: Mapping[str, Any], position: int) -> None:
    """Say which of ``A``, ``D`` and ``partial_group`` differ from the run that wrote the checkpoint."""
    changes = [
        f"{label} {written[key]!r} -> {now[key]!r}"
        for key, label in (
            ("strategy", "strategy"),
            ("accumulate", "accumulate_grad_batches"),
            ("replicas", "data-parallel replicas"),
            ("partial_group", "partial_group"),
        )
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
    """An explicit ``normalize=`` that differs from the unit the checkpoint's run used wins at an update boundary
    (announced; ``M`` is measured again in the new unit); inside a carried group it is an error, since that group's
    gradient is already weighted by the other unit."""
    wanted = engine.normalize
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
