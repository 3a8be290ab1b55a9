"""The one owner of an accumulation group's state, at both doors: :class:`GroupLifecycle` (docs/internals.md, "The
group's lifecycle").
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from torch import Tensor
from torch.optim import Optimizer

from lightning_accum.carry import Carried
from lightning_accum.core.adapter import NamedParameters
from lightning_accum.core.rules import refuse
from lightning_accum.decision import GroupOutcome
from lightning_accum.engine import AccumulationEngine

__all__ = ["LEAVES", "Closed", "GroupLifecycle", "GroupState", "Marks", "marks_of"]

#: Each gradient of the open group as a host mark: its identity and version counter (``None`` without one).
Marks = list[tuple[int, int] | None]


class GroupState(enum.Enum):
    """Where a group is in its lifecycle."""

    IDLE = "idle"  #: no group: the next micro-batch opens one
    OPEN = "open"  #: micro-batches reported since the last close (or a carried group, installed)
    CLOSED = "closed"  #: closed by ``close_group``, waiting for its ``optimizer.step()``
    LOADED = "loaded"  #: a checkpoint's entry read, waiting for the loop (its optimizers or its position)
    REOPENED = "reopened"  #: a checkpoint's group reopened: its gradient waits for the first backward or the close


_IDLE, _OPEN, _CLOSED, _LOADED, _REOPENED = GroupState
#: Each transition and the states it may leave; :meth:`GroupLifecycle.refuse` says why any other is refused.
LEAVES: dict[str, tuple[GroupState, ...]] = {
    "open": (_IDLE,),
    "hand_out": (_OPEN, _REOPENED),
    "close": (_OPEN,),
    "await_step": (_IDLE,),
    "stepped": (_CLOSED,),
    "load": (_IDLE, _LOADED),
    "reopen_later": (_LOADED,),
    "reopen": (_LOADED,),
    "install": (_REOPENED,),
    "end": tuple(GroupState),
}


@dataclass
class Closed:
    """A group closed by ``close_group`` whose ``optimizer.step()`` has not run yet."""

    optimizer: Optimizer
    outcome: GroupOutcome | None  # None: the group makes no update, the step is answered by doing nothing
    scale_before: Tensor | None = None  # the GradScaler's scale, read on the device (no host read)


def marks_of(parameters: NamedParameters) -> Marks:
    return [(id(g), g._version) if (g := p.grad) is not None else None for _, p in parameters]


class GroupLifecycle:
    """The state of the group one strategy runs, changed only by its transitions (:data:`LEAVES`).

    Args:
        engine: The engine whose sums are the group's arithmetic.

    Raises:
        RuntimeError: A transition from a state it does not leave: the manual API's rule where a loop causes it, else
            an internal error.
    """

    def __init__(self, engine: AccumulationEngine) -> None:
        self.engine = engine
        self._forget()

    def _forget(self) -> None:
        self.state = GroupState.IDLE
        # The manual API: the tensor `accumulate` handed out until it is back-propagated, the group closed and waiting
        # for its step, whether the group's last (any) backward ran with synchronisation blocked, what it watches.
        self.handed_out: Tensor | None = None
        self.closed: Closed | None = None
        self.last_unsynced = self.unsynced = False
        self._watch([], [], None)
        # A checkpoint's group: its entry's open group and configuration as read (`written`, also what a checkpoint
        # written before the group changes writes again), a reopen waiting for the loop's optimizers (`deferred`: its
        # configuration and position), and what the group carries in (`carried`).
        self.written: tuple[dict[str, Any] | None, dict[str, Any]] | None = None
        self.deferred: tuple[dict[str, Any], int] | None = None
        self.carried: Carried | None = None

    def _watch(self, watched: NamedParameters, opened_on: list[str], stale: Tensor | None) -> None:
        self.watched = watched  # the open manual group's parameters, whose gradients it owns
        self.held = [p.grad for _, p in watched]  # their gradients, kept so that no new one reuses an id
        self.marks: Marks | None = marks_of(watched) if watched else None  # each gradient's (id, version)
        self.opened_on = opened_on  # the parameters that held a gradient when the group opened
        self.stale = stale  # how many of them are nonzero, counted on the device (read by the close)

    # ------------------------------------------------------------------ reads

    @property
    def loaded(self) -> dict[str, Any] | None:
        """While ``LOADED``: the checkpoint's open group with its ``config``, else ``None``."""
        if self.state is not GroupState.LOADED:
            return None
        if self.written is None:
            return {"microbatches": 0, "unknown": True}
        group, config = self.written
        return {**(group or {"microbatches": 0}), "config": config}

    @property
    def group_open(self) -> bool:
        """Whether a group is open: open, reopened, or loaded with at least one micro-batch."""
        if self.state is GroupState.LOADED:
            return int((self.loaded or {}).get("microbatches", 0)) > 0
        return self.state in (GroupState.OPEN, GroupState.REOPENED)

    def refuse(self, transition: str, call: str = "", optimizer: str = "") -> NoReturn:
        """Refuse ``transition``: with the manual API's rule where a loop's ``call`` causes it, else as a bug."""
        state, held = self.state, self.engine.microbatches_in_group
        if state is GroupState.CLOSED and call:
            refuse("step_pending", call=call, optimizer=type(self.closed.optimizer).__name__)  # type: ignore[union-attr]
        if transition == "close" and state in (GroupState.IDLE, GroupState.OPEN):
            last = self.engine.ledger.last_group
            after = (
                f" The last group ({last.microbatches} micro-batch(es)) was closed already: a group is closed once,"
                " over one optimizer's parameters; with several optimizers over one loss, give them one optimizer"
                " (parameter groups) or accumulate each one's loss separately."
                if last is not None
                else ""
            )
            refuse("close_without_microbatches", after=after)
        if transition == "stepped" and state in (GroupState.OPEN, GroupState.REOPENED):
            refuse("step_inside_open_group", optimizer=optimizer, held=held)
        allowed = " or ".join(s.value for s in LEAVES[transition])
        raise RuntimeError(
            f"lightning_accum: the accumulation group cannot `{transition}` while it is {state.value} ({held}"
            f" micro-batch(es) held; it leaves {allowed} that way). This is a bug of lightning_accum: please report it."
        )

    # ------------------------------------------------------------------ the group's micro-batches

    def open(
        self, watched: NamedParameters | None = None, opened_on: list[str] | None = None, stale: Tensor | None = None
    ) -> None:
        """A micro-batch opens a group (a manual one owns the gradients of ``watched``)."""
        if self.state is not GroupState.IDLE:
            self.refuse("open", "accumulate")
        self.state = GroupState.OPEN
        if watched:
            self._watch(watched, opened_on or [], stale)

    def hand_out(self, tensor: Tensor) -> None:
        """``accumulate`` handed out ``tensor``, to be back-propagated before its next call or the close."""
        if self.state not in LEAVES["hand_out"]:
            self.refuse("hand_out", "accumulate")
        self.handed_out = tensor

    def back_propagated(self, tensor: Tensor) -> bool:
        """Whether ``tensor`` is the one handed out last (then no longer outstanding)."""
        if self.handed_out is None or tensor is not self.handed_out:
            return False
        self.handed_out = None
        return True

    def backward_ran(self, unsynced: bool, parameters: Callable[[], NamedParameters]) -> None:
        """The handed-out tensor's backward ran (``unsynced``: synchronisation blocked); the gradients are marked."""
        self.last_unsynced = unsynced
        self.unsynced = self.unsynced or unsynced
        watched = self.watched or parameters()
        self.watched, self.held, self.marks = watched, [p.grad for _, p in watched], marks_of(watched)

    def close(self) -> Carried | None:
        """The group goes to the close; returns what a checkpoint carried into it."""
        if self.state is not GroupState.OPEN:
            self.refuse("close", "close_group")
        carried, self.carried = self.carried, None
        self.state, self.last_unsynced, self.unsynced = GroupState.IDLE, False, False
        if self.watched:
            self._watch([], [], None)
        return carried

    def await_step(self, closed: Closed) -> None:
        """A manual close's group waits for its ``optimizer.step()``."""
        if self.state is not GroupState.IDLE:
            self.refuse("await_step", "close_group")
        self.state, self.closed = GroupState.CLOSED, closed

    def stepped(self, optimizer: Optimizer) -> Closed:
        """``optimizer.step()`` of the closed group: returns it."""
        closed = self.closed
        if self.state is not GroupState.CLOSED or closed is None:
            self.refuse("stepped", optimizer=type(optimizer).__name__)
        if closed.optimizer is not optimizer:
            refuse(
                "step_of_another_optimizer", optimizer=type(optimizer).__name__, closed=type(closed.optimizer).__name__
            )
        self.state, self.closed = GroupState.IDLE, None
        return closed

    # ------------------------------------------------------------------ a group across a checkpoint

    def load(self, written: tuple[dict[str, Any] | None, dict[str, Any]] | None) -> None:
        """A checkpoint's entry is read: its open group (or ``None``) and configuration (``None``: it had no entry)."""
        if self.state not in LEAVES["load"]:
            self.refuse("load")
        self._forget()
        self.state, self.written = GroupState.LOADED, written

    def reopen_later(self, config: dict[str, Any], position: int) -> None:
        if self.state is not GroupState.LOADED:
            self.refuse("reopen_later")
        self.deferred = (config, position)

    def reopen(self, carried: Carried | None) -> None:
        """The loaded group is reopened with what it ``carried``, or ends when nothing was carried."""
        if self.state is not GroupState.LOADED:
            self.refuse("reopen")
        self.deferred, self.carried = None, carried
        if carried is None or carried.gradients is None:
            self.state, self.written = GroupState.IDLE, None
            return
        self.state = GroupState.REOPENED
        self.engine.resume_open_group(carried.scale)

    def install(self) -> tuple[dict[str, Tensor], NamedParameters]:
        """The carried gradient and its parameters, handed out once to be added (the group is then open)."""
        carried = self.carried
        if self.state is not GroupState.REOPENED or carried is None:
            self.refuse("install")
        self.carried = dataclasses.replace(carried, gradients=None, targets=[])
        self.state, self.written = GroupState.OPEN, None
        return carried.gradients or {}, carried.targets

    def end(self, why: str, say: Callable[[str], None] | None = None, then: str = "") -> int:
        """End the group: discard the engine's open micro-batches (``say`` says why); returns how many."""
        lost = self.engine.discard_open_group()
        if lost and say is not None:
            say(
                f"lightning_accum: {why} inside an accumulation group: its {lost} micro-batch(es) on this replica never"
                f" reached an optimizer step. Their gradient is discarded and the ledger does not count them.{then}"
            )
        self._forget()
        return lost
