"""Exact accumulation for manual optimization: what ``strategy.accumulate`` and ``strategy.close_group`` do.

A manual loop (``automatic_optimization = False``, or a Fabric loop) reports each micro-batch with ``accumulate``,
back-propagates the tensor it returns and calls ``close_group(optimizer)`` right before ``optimizer.step()``
(docs/howto.md, "Accumulate exactly in a manual loop"). Every tensor handed out must be back-propagated before the next
``accumulate`` or the close: its micro-batch counts in the group's denominator. The open group owns its parameters'
gradients: each backward notes every gradient's identity and version counter (host values, no device read), and the
next backward and the close compare, so that ``zero_grad()`` inside the group, torch's own ``loss.backward()`` or an
in-place edit is an error naming what changed. A group that opens on gradients already there counts, on the device,
those that are nonzero: the close's one host read tells a gradient zeroed in place (harmless) from a stale one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_accum.core.adapter import NamedParameters
from lightning_accum.core.closing import GroupClosing
from lightning_accum.core.lifecycle import Closed, GroupLifecycle, Marks
from lightning_accum.core.rules import refuse
from lightning_accum.engine import AccumulationEngine
from lightning_accum.ledger import GroupRecord
from lightning_accum.microbatch import Count

__all__ = ["ManualGroups"]


class ManualGroups:
    """The manual API's operations on the group: what a manual loop reports, closes and steps. Its state (the tensor
    handed out, the group waiting for its step, the gradients the group owns) is the lifecycle's."""

    def __init__(self, group: GroupLifecycle) -> None:
        self.group = group

    def _mark(self) -> None:
        group = self.group
        group.held = [p.grad for _, p in group.watched]
        group.marks = _marks_of(group.watched)

    def note_backward(self, unsynced: bool, parameters: Callable[[], NamedParameters]) -> None:
        """The handed-out tensor was back-propagated, with gradient synchronisation blocked or not (as the door that
        ran it saw: Fabric's ``no_backward_sync``, DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync``); the
        group's gradients are marked as this backward left them (``parameters``: the group's, where it did not open
        with an ``accumulate``, as one reopened from a checkpoint)."""
        self.group.last_unsynced = unsynced
        self.group.unsynced = self.group.unsynced or unsynced
        if not self.group.watched:
            self.group.watched = parameters()
        self._mark()

    def check_untouched(self, engine: AccumulationEngine, call: str) -> None:
        """Refuse a group whose gradients changed since its last backward (or its opening) other than through the
        strategy: compared on the host, by each gradient's identity and version counter."""
        marks = self.group.marks
        if marks is None:
            return
        now = _marks_of(self.group.watched)
        if now != marks:
            refuse(
                "gradient_changed_outside",
                call=call,
                held=engine.microbatches_in_group,
                found=_what_changed(self.group.watched, marks, now),
            )

    def accumulate(
        self,
        engine: AccumulationEngine,
        loss: Tensor,
        counts: dict[str, Count | None],
        batch: Any,
        group_size: int | None,
        replicas: int,
        opening: Callable[[], NamedParameters] | None = None,
        local: Callable[[Tensor], Tensor] = lambda grad: grad,
    ) -> Tensor:
        """Record one micro-batch in the open group; return ``loss · w / c`` (see ``ExactAccumulation.accumulate``).
        ``opening``: the micro-batch opens a group, on these parameters (a gradient already there must be zero: told
        at the close); ``local``: the part of a gradient this rank holds (a DTensor's shard)."""
        self._check_no_step_pending("accumulate")
        self._check_handed_out_used("accumulate")
        if not isinstance(loss, Tensor):
            refuse("loss_not_a_tensor", kind=type(loss).__name__)
        # `group_size=1` declares the group's only micro-batch: on one replica it is back-propagated as it is (c = w,
        # the close's factor exactly 1), as the Trainer's `A = 1` is, so the update is the plain loop's bit for bit.
        sole = group_size == 1 and not isinstance(group_size, bool)
        _check_group_size(group_size)
        if group_size is None:
            last = engine.ledger.last_group
            group_size = max(1, last.microbatches // replicas) if last is not None else 1
        if engine.holds_sole_microbatch:
            refuse("sole_microbatch_joined")
        output = {"loss": loss, **{key: value for key, value in counts.items() if value is not None}}
        if opening is not None:
            self.group.unwatch()
            self.group.watched = opening()
            self.group.opened_on, self.group.stale = _nonzero_gradients(self.group.watched, local, engine.device)
            self._mark()
        tensor = engine.add_microbatch(output, batch, accumulate=group_size, sole=sole)
        assert tensor is not None  # a tensor loss always gives one
        self.group.handed_out = tensor
        return tensor

    def is_handed_out(self, tensor: Tensor) -> bool:
        """Whether ``tensor``, about to be back-propagated, is the one :meth:`accumulate` handed out last (then no
        longer outstanding)."""
        if self.group.handed_out is None or tensor is not self.group.handed_out:
            return False
        self.group.handed_out = None
        return True

    def close(
        self,
        engine: AccumulationEngine,
        closing: GroupClosing,
        optimizer: Optimizer,
        module: Module | None,
        scaler: torch.amp.GradScaler | None,
        group_size: int | None = None,
        optimizers: Sequence[Optimizer] = (),
        sync_matters: bool = False,
    ) -> GroupRecord:
        """Close the group reported with :meth:`accumulate` (:data:`~lightning_accum.core.core.CLOSE_GROUP_DOC`).
        ``optimizers``: every optimizer of the loop (a backward that reached another one's parameters is refused);
        ``sync_matters``: whether a last backward with synchronisation blocked leaves the group's gradient uncombined
        (several DDP replicas, FSDP2), which is then refused."""
        self._check_no_step_pending("close_group")
        held = engine.microbatches_in_group
        if held == 0:
            last = engine.ledger.last_group
            after = (
                f" The last group ({last.microbatches} micro-batch(es)) was closed already: a group is closed once,"
                " over one optimizer's parameters; with several optimizers over one loss, give them one optimizer"
                " (parameter groups) or accumulate each one's loss separately."
                if last is not None
                else ""
            )
            refuse("close_without_microbatches", after=after)
        if self.group.last_unsynced and sync_matters:
            refuse("last_backward_unsynced")
        self.check_untouched(engine, "close_group")
        _refuse_gradients_of_other_optimizers(optimizer, optimizers)
        self._check_handed_out_used("close_group")
        _check_group_size(group_size)
        if group_size is not None and held > group_size:
            refuse("group_size_exceeded", group_size=group_size, held=held)
        accumulate = group_size if group_size is not None else held
        outcome = closing.close(
            engine, optimizer, module, accumulate, ends_epoch=False, scaler=scaler, stale=self.group.stale
        )
        self.group.last_unsynced = self.group.unsynced = False
        opened_on = self.group.opened_on
        self.group.unwatch()
        if outcome.stale:
            refuse("stale_gradient_at_opening", count=outcome.stale, names=_names(opened_on))
        if outcome.action != "apply":
            optimizer.zero_grad(set_to_none=True)
            self.group.closed = Closed(optimizer, None)
            return closing.finish(engine, outcome, applied=False)
        self.group.closed = Closed(optimizer, outcome, closing.scale_now(scaler))
        return outcome.record

    def optimizer_step(
        self,
        engine: AccumulationEngine,
        closing: GroupClosing,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        scaler: torch.amp.GradScaler | None,
        lightning_step: Callable[[], Any],
    ) -> Any:
        """``optimizer.step()`` in a manual loop: ``lightning_step()`` (Lightning's own) after a group closed as
        "apply", nothing after one that makes no update, Lightning's behaviour when no group was reported."""
        closed = self.group.closed
        if closed is None:
            if engine.microbatches_in_group:
                refuse("step_inside_open_group", optimizer=type(optimizer).__name__, held=engine.microbatches_in_group)
            return lightning_step()
        if closed.optimizer is not optimizer:
            refuse(
                "step_of_another_optimizer",
                optimizer=type(optimizer).__name__,
                closed=type(closed.optimizer).__name__,
            )
        self.group.closed = None
        if closed.outcome is None:
            closure()  # the group makes no update; the user's closure (if any) still runs, as step would run it
            return None
        output = lightning_step()
        closing.finish_after_step(engine, closed.outcome, closed.scale_before, scaler)
        return output

    @staticmethod
    def refuse_clipping(engine: AccumulationEngine, call: str) -> None:
        """Clipping needs the group's exact gradient, which exists once the close rescaled it by ``c · D / W``:
        before, the gradient is ``Σ (w / c) · ∇loss``, and a norm of it clips by another factor (silently wrong)."""
        held = engine.microbatches_in_group
        if held:
            refuse("clipping_inside_open_group", call=call, held=held)

    def _check_no_step_pending(self, what: str) -> None:
        if self.group.closed is not None:
            refuse("step_pending", call=what, optimizer=type(self.group.closed.optimizer).__name__)

    def _check_handed_out_used(self, what: str) -> None:
        if self.group.handed_out is not None:
            refuse("handed_out_not_backpropagated", call=what)


def _check_group_size(group_size: Any) -> None:
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1):
        refuse("group_size_not_positive", group_size=group_size)


def _refuse_gradients_of_other_optimizers(closed: Optimizer, optimizers: Sequence[Optimizer]) -> None:
    """The close rescales ``closed``'s parameters only: a group whose backward also reached another optimizer's
    parameters would leave those unscaled (``Σ (w / c) · ∇loss``) for that optimizer's step."""
    mine = {id(p) for group in closed.param_groups for p in group["params"]}
    for other in optimizers:
        if other is closed:
            continue
        if any(p.grad is not None and id(p) not in mine for g in other.param_groups for p in g["params"]):
            refuse("another_optimizers_gradient", closed=type(closed).__name__, other=type(other).__name__)


def _marks_of(parameters: NamedParameters) -> Marks:
    """Each parameter's gradient as a host mark: its identity and version counter (``None`` without one)."""
    return [(id(g), g._version) if (g := p.grad) is not None else None for _, p in parameters]


def _nonzero_gradients(
    parameters: NamedParameters, local: Callable[[Tensor], Tensor], device: torch.device
) -> tuple[list[str], Tensor | None]:
    """The parameters that hold a gradient when a group opens, and how many of them hold a nonzero one, counted on
    ``device`` (``None`` when none holds a gradient: nothing to count, the usual case after ``zero_grad()``)."""
    held = [(name, grad) for name, p in parameters if (grad := p.grad) is not None]
    if not held:
        return [], None
    count = torch.zeros((), dtype=torch.float64, device=device)
    for _, grad in held:
        count += local(grad).ne(0).any().to(device, non_blocking=True)
    return [name for name, _ in held], count


def _names(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def _what_changed(parameters: NamedParameters, before: Marks, after: Marks) -> str:
    """What changed the open group's gradients outside the strategy, told from the marks (and, on this error path
    only, a read of the gradients changed in place: zeroed, or added to)."""
    kinds: dict[str, list[str]] = {}
    for (name, p), old, new in zip(parameters, before, after, strict=True):
        if old == new:
            continue
        if new is None or (old is not None and old[0] != new[0]):
            kind = "cleared"
        elif old is None:
            kind = "added"
        else:
            kind = "zeroed" if not bool(p.grad.ne(0).any()) else "added"  # type: ignore[union-attr]
        kinds.setdefault(kind, []).append(name)
    what = {
        "cleared": "set to None (`optimizer.zero_grad()` or `model.zero_grad()` inside the group: a group abandoned"
        " without `close_group`)",
        "zeroed": "zeroed in place (`zero_grad(set_to_none=False)` inside the group)",
        "added": "added to by a backward that did not go through the strategy (torch's own `loss.backward()`) or"
        " changed in place",
    }
    return "; ".join(
        f"{len(names)} parameter gradient(s) {what[kind]}, e.g. {_names(names)}" for kind, names in kinds.items()
    )
