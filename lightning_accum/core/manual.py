"""Exact accumulation for manual optimization: what ``strategy.accumulate`` and ``strategy.close_group`` do.

With ``automatic_optimization = False`` Lightning's own loop does not accumulate (``accumulate_grad_batches`` must
be 1) and the strategy's hooks pass everything through unchanged, as Lightning's strategies do. A manual loop that
wants exact weighting reports each micro-batch and closes each group itself::

    tensor = strategy.accumulate(loss, num_tokens=n)   # loss · w / c, recorded in the open group
    self.manual_backward(tensor)
    ...
    record = strategy.close_group(optimizer)           # one all-reduce, the rescale by c · D / W, the decision
    optimizer.step()                                   # applied, or skipped by the strategy / the GradScaler
    optimizer.zero_grad()

The update of ``optimizer.step()`` goes through the strategy's ``optimizer_step`` as usual: after a group that closed
as "apply" it runs (the GradScaler may still skip it) and the record is completed and added to the ledger; after a
group that closed as "skip" (non-finite without a scaler, or no unit at all) it does nothing. Listeners (AxisLogger,
AccumulationReport, AxisLR) see every group as in automatic optimization.

Every tensor ``accumulate`` hands out must be back-propagated before the next ``accumulate`` or the group's close:
its micro-batch counts in the group's denominator, so a gradient missing from the group would under-weight the
update silently. The strategy knows which tensor it handed out and says so instead.

The open group owns its parameters' gradients: between two of its backwards nothing else may change them. Each
backward notes every gradient's identity and version counter (host values, no device read); the next backward and
the close compare, so that ``zero_grad()`` inside the group (a group abandoned without a close), torch's own
``loss.backward()`` or an in-place edit is an error naming what changed, never an update that counts micro-batches
whose gradient is gone. A group that opens on gradients already there counts, on the device, those that are nonzero:
the close's one host read tells a gradient zeroed in place (harmless) from a stale one (an error).
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
            raise RuntimeError(_touched_message(call, engine.microbatches_in_group, self.group.watched, marks, now))

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
            raise TypeError(
                f"`strategy.accumulate(loss=...)` takes the micro-batch's mean loss as a tensor, got"
                f" {type(loss).__name__}."
            )
        # `group_size=1` declares the group's only micro-batch: on one replica it is back-propagated as it is (c = w,
        # the close's factor exactly 1), as the Trainer's `A = 1` is, so the update is the plain loop's bit for bit.
        sole = group_size == 1 and not isinstance(group_size, bool)
        if group_size is None:
            last = engine.ledger.last_group
            group_size = max(1, last.microbatches // replicas) if last is not None else 1
        elif isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"`group_size` must be a positive int or None, got {group_size!r}.")
        if engine.holds_sole_microbatch:
            raise RuntimeError(
                "`strategy.accumulate`: the open group already holds a micro-batch reported with `group_size=1` (its"
                " group's only one, back-propagated as it is), so no other micro-batch can join it. Call"
                " `close_group(optimizer)` after each micro-batch reported with `group_size=1`, or pass the group's"
                " real size (or None) to `accumulate`."
            )
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
            raise RuntimeError(
                "`strategy.close_group` found no micro-batch in the open group. Report each micro-batch with"
                f" `tensor = strategy.accumulate(loss, num_tokens=...)` and back-propagate it first.{after}"
            )
        if self.group.last_unsynced and sync_matters:
            raise RuntimeError(
                "`close_group`: the group's last backward ran with gradient synchronisation blocked (inside"
                " `no_backward_sync`: `fabric.no_backward_sync(model, enabled=True)` in Fabric, the strategy's"
                " `no_backward_sync()` or DDP's `no_sync()` in a Trainer), so the replicas' gradients were never"
                " combined (DDP: each replica holds its own; FSDP2: no rank's shard holds the group's gradient) and the"
                " update would differ per replica or miss the group. Run a group's last micro-batch with"
                " synchronisation: `enabled=not last`."
            )
        self.check_untouched(engine, "close_group")
        _refuse_gradients_of_other_optimizers(optimizer, optimizers)
        self._check_handed_out_used("close_group")
        if group_size is not None and (
            isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1
        ):
            raise ValueError(f"`group_size` must be a positive int or None, got {group_size!r}.")
        if group_size is not None and held > group_size:
            raise ValueError(
                f"`strategy.close_group(..., group_size={group_size})`: the open group holds {held} micro-batches,"
                f" more than a group of {group_size}. Close each group after its last micro-batch, or pass the"
                " group size you run."
            )
        accumulate = group_size if group_size is not None else held
        outcome = closing.close(
            engine, optimizer, module, accumulate, ends_epoch=False, scaler=scaler, stale=self.group.stale
        )
        self.group.last_unsynced = self.group.unsynced = False
        opened_on = self.group.opened_on
        self.group.unwatch()
        if outcome.stale:
            raise RuntimeError(_stale_message(outcome.stale, opened_on))
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
                raise RuntimeError(
                    f"`{type(optimizer).__name__}.step()` was called while {engine.microbatches_in_group}"
                    " micro-batch(es) reported with `strategy.accumulate` wait in an open group. Call"
                    " `strategy.close_group(optimizer)` before `optimizer.step()`: it rescales the gradient to the"
                    " exact weighted mean and records the group."
                )
            return lightning_step()
        if closed.optimizer is not optimizer:
            raise RuntimeError(
                f"`{type(optimizer).__name__}.step()` was called while the group closed by"
                f" `strategy.close_group(...)` belongs to another optimizer ({type(closed.optimizer).__name__})."
                " Close each optimizer's group with `strategy.close_group(that_optimizer)` right before its step."
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
            raise RuntimeError(
                f"`{call}` was called inside an open accumulation group ({held} micro-batch(es) reported): its"
                " gradient is not yet the group's mean, so the norm and the clip would be of another gradient. Call"
                " `close_group(optimizer)` first (it rescales the gradient to the exact weighted mean), then clip, then"
                " `optimizer.step()`."
            )

    def _check_no_step_pending(self, what: str) -> None:
        if self.group.closed is not None:
            name = type(self.group.closed.optimizer).__name__
            raise RuntimeError(
                f"`strategy.{what}` was called while the group closed by `strategy.close_group({name})` still waits"
                f" for its update. Call `optimizer.step()` right after `close_group` (it applies or skips the update"
                " and records it), then start the next group."
            )

    def _check_handed_out_used(self, what: str) -> None:
        if self.group.handed_out is not None:
            raise RuntimeError(
                f"`strategy.{what}` was called while the tensor the last `strategy.accumulate(...)` returned was never"
                " back-propagated: its micro-batch counts in the group's denominator, but its gradient is not in the"
                " group. Call `self.manual_backward(tensor)` on exactly the tensor `accumulate` returns, once per"
                " micro-batch, before the next `accumulate` or `close_group`."
            )


def _refuse_gradients_of_other_optimizers(closed: Optimizer, optimizers: Sequence[Optimizer]) -> None:
    """The close rescales ``closed``'s parameters only: a group whose backward also reached another optimizer's
    parameters would leave those unscaled (``Σ (w / c) · ∇loss``) for that optimizer's step."""
    mine = {id(p) for group in closed.param_groups for p in group["params"]}
    for other in optimizers:
        if other is closed:
            continue
        if any(p.grad is not None and id(p) not in mine for g in other.param_groups for p in g["params"]):
            raise RuntimeError(
                f"`close_group({type(closed).__name__})`: the group's backward also reached the parameters of another"
                f" optimizer ({type(other).__name__}), and the close rescales only the gradients of the one it is given"
                " to the group's exact mean: the other's step would apply `Σ (w / c) · ∇loss`. Give the parameters one"
                " optimizer (a parameter group each, e.g. for different learning rates), or set the other optimizer's"
                " gradients to None (`zero_grad()`) if they belong to another loss."
            )


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


def _stale_message(count: int, names: list[str]) -> str:
    return (
        f"`close_group`: the group opened while {count} optimized parameter(s) already held a nonzero gradient (among"
        f" {_names(names)}): a backward ran before the group's first `accumulate` (back-propagate only what"
        " `accumulate` returns), or `optimizer.zero_grad()` was not called after the last `optimizer.step()`. That"
        " gradient joined the group's and was rescaled with it: the examples of another update would contribute to"
        " this one, so the close stops here. Call `optimizer.zero_grad()` after each step (a gradient zeroed in place,"
        " `set_to_none=False`, is fine)."
    )


def _touched_message(call: str, held: int, parameters: NamedParameters, before: Marks, after: Marks) -> str:
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
    found = "; ".join(
        f"{len(names)} parameter gradient(s) {what[kind]}, e.g. {_names(names)}" for kind, names in kinds.items()
    )
    return (
        f"`{call}`: the gradient of the open accumulation group ({held} micro-batch(es) reported with `accumulate`)"
        f" changed outside the strategy since its last backward: {found}. Every reported micro-batch counts in the"
        " group's denominator, so the update would weigh micro-batches whose gradient is gone, or a gradient no"
        " `accumulate` reported. Back-propagate exactly what `accumulate` returns, through"
        " `self.manual_backward(tensor)` (Trainer) or `fabric.backward(tensor)` (Fabric) instead of `loss.backward()`,"
        " and call `optimizer.zero_grad()` only after `close_group(optimizer)` and `optimizer.step()`: a group is"
        " not abandoned halfway, close it (with `group_size=` for a partial group) and step."
    )
