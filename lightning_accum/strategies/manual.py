"""Exact accumulation for manual optimization: the state behind ``strategy.accumulate`` and ``strategy.close_group``.

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
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor
from torch.optim import Optimizer

from lightning_accum.decision import GroupOutcome

__all__ = ["ManualGroups"]


@dataclass
class _Closed:
    """A group closed by ``close_group`` whose ``optimizer.step()`` has not run yet."""

    optimizer: Optimizer
    outcome: GroupOutcome | None  # None: the group makes no update, the step is answered by doing nothing
    scale_before: Tensor | None = None  # the GradScaler's scale, read on the device (no host read)


class ManualGroups:
    """What a manual loop has reported and closed: the tensor handed out, the group waiting for its step."""

    def __init__(self) -> None:
        self.handed_out: Tensor | None = None  # the last tensor `accumulate` returned, until it is back-propagated
        self.closed: _Closed | None = None

    def check_no_step_pending(self, what: str) -> None:
        """Raise when a closed group still waits for its ``optimizer.step()``."""
        if self.closed is not None:
            name = type(self.closed.optimizer).__name__
            raise RuntimeError(
                f"`strategy.{what}` was called while the group closed by `strategy.close_group({name})` still waits"
                f" for its update. Call `optimizer.step()` right after `close_group` (it applies or skips the update"
                " and records it), then start the next group."
            )

    def take_closed(self, optimizer: Optimizer) -> _Closed | None:
        """The closed group waiting for ``optimizer``'s step (forgotten here), or ``None``."""
        closed = self.closed
        if closed is None:
            return None
        if closed.optimizer is not optimizer:
            raise RuntimeError(
                f"`{type(optimizer).__name__}.step()` was called while the group closed by"
                f" `strategy.close_group(...)` belongs to another optimizer ({type(closed.optimizer).__name__})."
                " Close each optimizer's group with `strategy.close_group(that_optimizer)` right before its step."
            )
        self.closed = None
        return closed

    def reset(self) -> None:
        self.handed_out = None
        self.closed = None
