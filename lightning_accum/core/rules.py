"""The rules of the manual API as one table: each a row (name, check, error, message), raised by :func:`refuse` at
both doors alike; ``tests/core/test_rules.py`` runs every row's scenario through both doors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn

__all__ = ["RULES", "Rule", "refuse"]


@dataclass(frozen=True)
class Rule:
    """One rule of the manual API: its ``name`` in :data:`RULES`, its ``check`` in words, the ``error`` type raised, and
    its ``message``, a :meth:`str.format` template over what the check found.
    """

    name: str
    check: str
    error: type[Exception]
    message: str


_RULES = (
    Rule(
        "manual_api_in_automatic_optimization",
        "`accumulate` or `close_group` called in a Trainer's automatic optimization (no such mode in Fabric)",
        RuntimeError,
        "`strategy.{call}` is for manual optimization (`automatic_optimization = False`). {instead}",
    ),
    Rule(
        "step_pending",
        "`accumulate` or `close_group` while a closed group waits for its `optimizer.step()`",
        RuntimeError,
        "`strategy.{call}` was called while the group closed by `strategy.close_group({optimizer})` still waits for its"
        " update. Call `optimizer.step()` right after `close_group` (it applies or skips the update and records it),"
        " then start the next group.",
    ),
    Rule(
        "handed_out_not_backpropagated",
        "`accumulate` or `close_group` while the tensor the last `accumulate` returned was never back-propagated",
        RuntimeError,
        "`strategy.{call}` was called while the tensor the last `strategy.accumulate(...)` returned was never"
        " back-propagated: its micro-batch counts in the group's denominator, but its gradient is not in the group."
        " Call `self.manual_backward(tensor)` on exactly the tensor `accumulate` returns, once per micro-batch, before"
        " the next `accumulate` or `close_group`.",
    ),
    Rule(
        "loss_not_a_tensor",
        "`accumulate` given a loss that is not a tensor",
        TypeError,
        "`strategy.accumulate(loss=...)` takes the micro-batch's mean loss as a tensor, got {kind}.",
    ),
    Rule(
        "group_size_not_positive",
        "`group_size=` of `accumulate` or `close_group` not a positive int or None",
        ValueError,
        "`group_size` must be a positive int or None, got {group_size!r}.",
    ),
    Rule(
        "sole_microbatch_joined",
        "`accumulate` into a group that holds a micro-batch reported with `group_size=1`",
        RuntimeError,
        "`strategy.accumulate`: the open group already holds a micro-batch reported with `group_size=1` (its group's"
        " only one, back-propagated as it is), so no other micro-batch can join it. Call `close_group(optimizer)`"
        " after each micro-batch reported with `group_size=1`, or pass the group's real size (or None) to"
        " `accumulate`.",
    ),
    Rule(
        "foreign_backward",
        "a backward of a tensor `accumulate` did not hand out (or of the handed-out one twice) inside an open group",
        RuntimeError,
        "A backward of a tensor that `strategy.accumulate` did not hand out, while the open group holds {held}"
        " micro-batch(es) reported with `accumulate`: its gradient would join the group's and be rescaled by"
        " c · D / W as if it were a weighted micro-batch (or, for the tensor `accumulate` returned, counted twice)."
        " Back-propagate exactly what `accumulate` returns, once each, until `close_group`; for a second loss of the"
        " same micro-batch, add it to the loss you pass to `accumulate`.",
    ),
    Rule(
        "gradient_changed_outside",
        "the open group's gradients changed outside the strategy since its last backward (`zero_grad()` inside the"
        " group, a group abandoned, torch's own `loss.backward()`): told at the next backward or the close from host"
        " marks (identity and version of each gradient)",
        RuntimeError,
        "`{call}`: the gradient of the open accumulation group ({held} micro-batch(es) reported with `accumulate`)"
        " changed outside the strategy since its last backward: {found}. Every reported micro-batch counts in the"
        " group's denominator, so the update would weigh micro-batches whose gradient is gone, or a gradient no"
        " `accumulate` reported. Back-propagate exactly what `accumulate` returns, through"
        " `self.manual_backward(tensor)` (Trainer) or `fabric.backward(tensor)` (Fabric) instead of `loss.backward()`,"
        " and call `optimizer.zero_grad()` only after `close_group(optimizer)` and `optimizer.step()`: a group is not"
        " abandoned halfway, close it (with `group_size=` for a partial group) and step.",
    ),
    Rule(
        "close_without_microbatches",
        "`close_group` with no micro-batch reported since the last close",
        RuntimeError,
        "`strategy.close_group` found no micro-batch in the open group. Report each micro-batch with"
        " `tensor = strategy.accumulate(loss, num_tokens=...)` and back-propagate it first.{after}",
    ),
    Rule(
        "last_backward_unsynced",
        "`close_group` after a last backward with gradient synchronisation blocked, where that leaves the gradient"
        " uncombined (several DDP replicas; FSDP2 on any)",
        RuntimeError,
        "`close_group`: the group's last backward ran with gradient synchronisation blocked (inside"
        " `no_backward_sync`: `fabric.no_backward_sync(model, enabled=True)` in Fabric, the strategy's"
        " `no_backward_sync()` or DDP's `no_sync()` in a Trainer), so the replicas' gradients were never combined"
        " (DDP: each replica holds its own; FSDP2: no rank's shard holds the group's gradient) and the update would"
        " differ per replica or miss the group. Run a group's last micro-batch with synchronisation:"
        " `enabled=not last`.",
    ),
    Rule(
        "another_optimizers_gradient",
        "`close_group(optimizer)` after a backward that reached another optimizer's parameters",
        RuntimeError,
        "`close_group({closed})`: the group's backward also reached the parameters of another optimizer ({other}), and"
        " the close rescales only the gradients of the one it is given to the group's exact mean: the other's step"
        " would apply `Σ (w / c) · ∇loss`. Give the parameters one optimizer (a parameter group each, e.g. for"
        " different learning rates), or set the other optimizer's gradients to None (`zero_grad()`) if they belong to"
        " another loss.",
    ),
    Rule(
        "group_size_exceeded",
        "`close_group(..., group_size=n)` over a group holding more than `n` micro-batches",
        ValueError,
        "`strategy.close_group(..., group_size={group_size})`: the open group holds {held} micro-batches, more than a"
        " group of {group_size}. Close each group after its last micro-batch, or pass the group size you run.",
    ),
    Rule(
        "stale_gradient_at_opening",
        "a group opened on a nonzero gradient already there (counted on the device when it opens, read by the close)",
        RuntimeError,
        "`close_group`: the group opened while {count} optimized parameter(s) already held a nonzero gradient (among"
        " {names}): a backward ran before the group's first `accumulate` (back-propagate only what `accumulate`"
        " returns), or `optimizer.zero_grad()` was not called after the last `optimizer.step()`. That gradient joined"
        " the group's and was rescaled with it: the examples of another update would contribute to this one, so the"
        " close stops here. Call `optimizer.zero_grad()` after each step (a gradient zeroed in place,"
        " `set_to_none=False`, is fine).",
    ),
    Rule(
        "step_inside_open_group",
        "`optimizer.step()` while micro-batches reported with `accumulate` wait in an open group",
        RuntimeError,
        "`{optimizer}.step()` was called while {held} micro-batch(es) reported with `strategy.accumulate` wait in an"
        " open group. Call `strategy.close_group(optimizer)` before `optimizer.step()`: it rescales the gradient to the"
        " exact weighted mean and records the group.",
    ),
    Rule(
        "step_of_another_optimizer",
        "`optimizer.step()` of another optimizer than the one the waiting group was closed over",
        RuntimeError,
        "`{optimizer}.step()` was called while the group closed by `strategy.close_group(...)` belongs to another"
        " optimizer ({closed}). Close each optimizer's group with `strategy.close_group(that_optimizer)` right before"
        " its step.",
    ),
    Rule(
        "group_left_open_at_setup",
        "a model or optimizer set up while a group holds micro-batches an earlier loop reported and never closed (a"
        " Fabric loop's `setup_module` / `setup_optimizers`; a Trainer's entry point ends its group at its teardown)",
        RuntimeError,
        "`{call}` was called while an accumulation group holds {held} micro-batch(es) reported with `accumulate` and"
        " not closed: an earlier loop ended inside its group (its gradient is still on that loop's parameters). Close"
        " the group (`close_group(optimizer)`, then `optimizer.step()`) before a loop ends, or end the earlier loop"
        " with `fabric.strategy.teardown()` (the group is discarded, the ledger keeps what it counted;"
        " `optimizer.zero_grad()` too if the next loop trains the same model).",
    ),
    Rule(
        "clipping_inside_open_group",
        "clipping (`self.clip_gradients`, `fabric.clip_gradients`) while micro-batches wait in an open group",
        RuntimeError,
        "`{call}` was called inside an open accumulation group ({held} micro-batch(es) reported): its gradient is not"
        " yet the group's mean, so the norm and the clip would be of another gradient. Call `close_group(optimizer)`"
        " first (it rescales the gradient to the exact weighted mean), then clip, then `optimizer.step()`.",
    ),
)

#: Every rule of the manual API, by name.
RULES: dict[str, Rule] = {rule.name: rule for rule in _RULES}


def refuse(name: str, **found: Any) -> NoReturn:
    """Raise rule ``name``'s error, its message formatted with what the check ``found``."""
    rule = RULES[name]
    raise rule.error(rule.message.format(**found))
