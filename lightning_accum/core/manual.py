"""Exact accumulation for manual optimization: ``strategy.accumulate`` and ``strategy.close_group`` (docs/howto.md,
"Accumulate exactly in a manual loop").
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
from lightning_accum.core.lifecycle import Closed, GroupLifecycle, GroupState, Marks, marks_of
from lightning_accum.core.rules import refuse
from lightning_accum.engine import AccumulationEngine
from lightning_accum.ledger import GroupRecord
from lightning_accum.microbatch import Count

__all__ = ["ManualGroups"]


class ManualGroups:
    """The manual API's operations on the group, its rules checked where the mistake happens."""

    def __init__(self, group: GroupLifecycle) -> None:
        self.group = group

    def check_untouched(self, engine: AccumulationEngine, call: str) -> None:
        """Refuse a group whose gradients changed since its last backward other than through the strategy."""
        marks = self.group.marks
        if marks is None:
            return
        now = marks_of(self.group.watched)
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
        """Record one micro-batch; return ``loss · w / c``. ``opening``: it opens a group on these parameters."""
        group = self.group
        if group.state is GroupState.CLOSED:
            group.refuse("hand_out", "accumulate")
        self._check_handed_out_used("accumulate")
        if not isinstance(loss, Tensor):
            refuse("loss_not_a_tensor", kind=type(loss).__name__)
        # `group_size=1` declares the group's only micro-batch: on one replica it is back-propagated as it is (c = w,
        # the close's factor exactly 1), as the Trainer's `A = 1` is, so the update is the plain loop's bit for bit.
        sole = group_size == 1 and not isinstance(group_size, bool) and group.carried is None
        _check_group_size(group_size)
        if group_size is None:
            last = engine.ledger.last_group
            group_size = max(1, last.microbatches // replicas) if last is not None else 1
        if engine.holds_sole_microbatch:
            refuse("sole_microbatch_joined")
        output = {"loss": loss, **{key: value for key, value in counts.items() if value is not None}}
        if opening is not None:
            watched = opening()
            group.open(watched, *_nonzero_gradients(watched, local, engine.device))
        tensor = engine.add_microbatch(output, batch, accumulate=group_size, sole=sole)
        assert tensor is not None  # a tensor loss always gives one
        group.hand_out(tensor)
        return tensor

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
        """Close the group reported with :meth:`accumulate` (:data:`~lightning_accum.core.core.CLOSE_GROUP_DOC`)."""
        group = self.group
        held = engine.microbatches_in_group
        if group.state is not GroupState.OPEN or not held:
            group.refuse("close", "close_group")
        if group.last_unsynced and sync_matters:
            refuse("last_backward_unsynced")
        self.check_untouched(engine, "close_group")
        _refuse_gradients_of_other_optimizers(optimizer, optimizers)
        self._check_handed_out_used("close_group")
        _check_group_size(group_size)
        if group_size is not None and held > group_size:
            refuse("group_size_exceeded", group_size=group_size, held=held)
        accumulate = group_size if group_size is not None else held
        stale, opened_on = group.stale, group.opened_on
        carried = group.close()
        outcome = closing.close(engine, optimizer, module, accumulate, False, scaler, stale, carried)
        if outcome.stale:
            refuse("stale_gradient_at_opening", count=outcome.stale, names=_names(opened_on))
        if outcome.action != "apply":
            optimizer.zero_grad(set_to_none=True)
            group.await_step(Closed(optimizer, None))
            return closing.finish(engine, outcome, applied=False)
        group.await_step(Closed(optimizer, outcome, closing.scale_now(scaler)))
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
        """``optimizer.step()`` in a manual loop: Lightning's after an applied group, nothing after another."""
        if self.group.state is not GroupState.CLOSED and not engine.microbatches_in_group:
            return lightning_step()
        closed = self.group.stepped(optimizer)
        if closed.outcome is None:
            closure()  # the group makes no update; the user's closure (if any) still runs, as step would run it
            return None
        output = lightning_step()
        closing.finish_after_step(engine, closed.outcome, closed.scale_before, scaler)
        return output

    @staticmethod
    def refuse_clipping(engine: AccumulationEngine, call: str) -> None:
        """Refuse clipping inside an open group (its gradient is not yet rescaled)."""
        held = engine.microbatches_in_group
        if held:
            refuse("clipping_inside_open_group", call=call, held=held)

    def _check_handed_out_used(self, what: str) -> None:
        if self.group.handed_out is not None:
            refuse("handed_out_not_backpropagated", call=what)


def _check_group_size(group_size: Any) -> None:
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1):
        refuse("group_size_not_positive", group_size=group_size)


def _refuse_gradients_of_other_optimizers(closed: Optimizer, optimizers: Sequence[Optimizer]) -> None:
    """Refuse a group whose backward reached another optimizer's parameters (the close rescales only ``closed``'s)."""
    mine = {id(p) for group in closed.param_groups for p in group["params"]}
    for other in optimizers:
        if other is closed:
            continue
        if any(p.grad is not None and id(p) not in mine for g in other.param_groups for p in g["params"]):
            refuse("another_optimizers_gradient", closed=type(closed).__name__, other=type(other).__name__)


def _nonzero_gradients(
    parameters: NamedParameters, local: Callable[[Tensor], Tensor], device: torch.device
) -> tuple[list[str], Tensor | None]:
    """The parameters holding a gradient when a group opens, and how many are nonzero, counted on ``device``."""
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
    """What changed the open group's gradients outside the strategy, told from the marks."""
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
