"""The one owner of an accumulation group's lifecycle, at both doors: :class:`GroupLifecycle`.

A group is opened by its first micro-batch, closed by the close, and may cross a checkpoint (written inside it,
reopened in another run, its carried gradient installed before the next backward). Every piece of state that lives
while a group lives is held here and nowhere else: what the manual API handed out and closed, the gradients the open
group owns (their host marks), a checkpoint's group waiting for the loop, and its carried gradient. The group's
arithmetic (its sums, its ``c``) is the engine's, which the lifecycle reads for its counts.

Its state is one read, :attr:`GroupLifecycle.state`:

============ ==========================================================================================
``IDLE``     no group: the next micro-batch opens one
``OPEN``     micro-batches reported on this replica since the last close (or a carried group, installed)
``CLOSED``   closed by ``close_group``, waiting for its ``optimizer.step()``
``LOADED``   a checkpoint's group read, waiting for the loop: its optimizers (Fabric's ``setup_optimizers``
             after ``load``) or its position (the Trainer's first micro-batch), to reopen it
``REOPENED`` reopened: its carried gradient waits for the first backward (or the close) to be added
============ ==========================================================================================

and it ends in one place, :meth:`GroupLifecycle.end`, which both doors' teardowns call.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from lightning_accum.core.adapter import NamedParameters
from lightning_accum.decision import GroupOutcome
from lightning_accum.engine import AccumulationEngine

__all__ = ["Closed", "GroupLifecycle", "GroupState", "Marks"]

#: Each gradient of the open group as a host mark: its identity and version counter (``None`` without one).
Marks = list[tuple[int, int] | None]


class GroupState(enum.Enum):
    """Where a group is in its lifecycle (see the module's table)."""

    IDLE = "idle"
    OPEN = "open"
    CLOSED = "closed"
    LOADED = "loaded"
    REOPENED = "reopened"


@dataclass
class Closed:
    """A group closed by ``close_group`` whose ``optimizer.step()`` has not run yet."""

    optimizer: Optimizer
    outcome: GroupOutcome | None  # None: the group makes no update, the step is answered by doing nothing
    scale_before: Tensor | None = None  # the GradScaler's scale, read on the device (no host read)


class GroupLifecycle:
    """The state of the group one strategy runs, whatever door and engine; see the module.

    Args:
        engine: The engine whose sums are the group's arithmetic (read for its micro-batch counts).
    """

    def __init__(self, engine: AccumulationEngine) -> None:
        self.engine = engine
        self._forget()

    def _forget(self) -> None:
        # The manual API: the last tensor `accumulate` returned until it is back-propagated, the group closed and
        # waiting for its step, and whether the group's latest (any) backward ran with synchronisation blocked.
        self.handed_out: Tensor | None = None
        self.closed: Closed | None = None
        self.last_unsynced = False
        self.unsynced = False  # a backward of it did (its gradient may be held unreduced inside FSDP2)
        self.unwatch()
        # A checkpoint's group: read and waiting for the loop (`loaded`, as the entry was read in `pending_entry`),
        # reopened later where the loop's optimizers are not set up yet (`reopen_later`), and its gradient waiting
        # for the first backward (`carried`, added to `targets`).
        self.loaded: dict[str, Any] | None = None
        self.pending_entry: tuple[int, dict[str, Any] | None, dict[str, Any] | None] | None = None
        self.reopen_later: Callable[[], None] | None = None
        self.carried: dict[str, Tensor] | None = None
        self.targets: NamedParameters = []

    def unwatch(self) -> None:
        """Forget the gradients a manual group owned (its close, or a new group)."""
        self.watched: NamedParameters = []  # the open group's parameters, whose gradients it owns
        self.marks: Marks | None = None  # each gradient's (id, version) after the group's last backward
        self.held: list[Tensor | None] = []  # those gradients, kept so that no new one reuses an id
        self.opened_on: list[str] = []  # the parameters that held a gradient when the group opened
        self.stale: Tensor | None = None  # how many of them are nonzero, counted on the device (read by the close)

    @property
    def state(self) -> GroupState:
        """Where the group is (see the module's table)."""
        if self.closed is not None:
            return GroupState.CLOSED
        if self.loaded is not None or self.reopen_later is not None:
            return GroupState.LOADED
        if self.carried is not None:
            return GroupState.REOPENED
        if self.engine.microbatches_in_group or self.engine.carried_microbatches:
            return GroupState.OPEN
        return GroupState.IDLE

    @property
    def group_open(self) -> bool:
        """Whether a group is open: micro-batches reported since the last close, a carried group reopened, or a
        checkpoint's group of at least one micro-batch waiting for the loop (one written between groups is not)."""
        state = self.state
        if state is GroupState.LOADED:
            return int((self.loaded or {}).get("microbatches", 0)) > 0
        return state in (GroupState.OPEN, GroupState.REOPENED)

    def end(self, why: str, say: Callable[[str], None] | None = None, then: str = "") -> int:
        """End the group with the entry point that ran it: the engine's open micro-batches are discarded and
        everything above is forgotten. Where micro-batches were discarded, ``say`` (if given) tells the user, ``why``
        naming what ended the group ("the fit stopped", "`teardown` ended the loop") and ``then`` what to do. Returns
        the micro-batches discarded on this replica."""
        lost = self.engine.discard_open_group()
        if lost and say is not None:
            say(
                f"lightning_accum: {why} inside an accumulation group: its {lost} micro-batch(es) on this replica never"
                f" reached an optimizer step. Their gradient is discarded and the ledger does not count them.{then}"
            )
        self._forget()
        return lost
