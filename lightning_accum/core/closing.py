"""Closing a group over an optimizer's gradients and completing its record once the optimizer ran, for automatic and
manual optimization alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_accum.carry import Carried
from lightning_accum.decision import GroupOutcome, schedule_due
from lightning_accum.engine import AccumulationEngine
from lightning_accum.gradients import GradientsByKind, scaler_skipped
from lightning_accum.ledger import GroupRecord

__all__ = ["GroupClosing", "Schedules", "enabled_scaler"]


class Schedules(Protocol):
    """The step-interval schedules a Trainer's run hands the close."""

    configs: list[Any]

    def mark_due(self, due: Callable[[int], bool]) -> None: ...

    def release(self) -> None: ...


def _as_is(tensor: Tensor) -> Tensor:
    return tensor


def enabled_scaler(plugin: Any) -> torch.amp.GradScaler | None:
    """The enabled GradScaler of a precision plugin, or ``None``."""
    scaler = getattr(plugin, "scaler", None)
    return scaler if isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled() else None


class GroupClosing:
    """What closing a group needs per run: the optimizer's parameter layout and the schedules.

    Args:
        local: The part of a gradient this rank rescales and checks (a DTensor's local shard).
    """

    def __init__(self, local: Callable[[Tensor], Tensor] = _as_is) -> None:
        self.local = local
        self._whole = local is _as_is  # every gradient is this rank's to rescale and check: no call per parameter
        #: This rank, named beside a non-finite gradient where each rank checks its own shard (``None`` elsewhere).
        self.rank: int | None = None
        #: The step-interval schedules that follow updates (automatic optimization), set by the strategy's ``setup``.
        self.schedules: Schedules | None = None
        self._layout: tuple[Optimizer, tuple[tuple[int, int], ...], list[tuple[Any, list[Tensor]]]] | None = None

    def reset(self) -> None:
        """Forget the run's layout and schedules (``teardown``)."""
        if self.schedules is not None:
            self.schedules.release()
            self.schedules = None
        self._layout = None

    def close(
        self,
        engine: AccumulationEngine,
        optimizer: Optimizer,
        module: Module | None,
        accumulate: int,
        ends_epoch: bool,
        scaler: torch.amp.GradScaler | None,
        stale: Tensor | None = None,
        carried: Carried | None = None,
    ) -> GroupOutcome:
        """Close the open group over ``optimizer``'s gradients: one all-reduce, the rescale, the decision."""
        return engine.close_group(
            accumulate=accumulate,
            ends_epoch=ends_epoch,
            gradients=self.gradients_by_kind(optimizer),
            check_gradients=scaler is None and engine.options.on_nonfinite != "ignore",
            describe_nonfinite=lambda: self.first_nonfinite(optimizer, module),
            stale=stale,
            carried=carried,
        )

    def gradients_by_kind(self, optimizer: Optimizer) -> GradientsByKind:
        """``optimizer``'s gradients (this rank's part) by device and dtype, from a layout kept for the run."""
        groups = optimizer.param_groups
        signature = tuple((id(group["params"]), len(group["params"])) for group in groups)
        layout = self._layout
        if layout is None or layout[0] is not optimizer or layout[1] != signature:
            kinds: dict[Any, list[Tensor]] = {}
            for group in groups:
                for p in group["params"]:
                    kinds.setdefault((p.device, p.dtype), []).append(p)  # a gradient has its parameter's kind
            layout = self._layout = (optimizer, signature, list(kinds.items()))
        by_kind = {}
        for kind, params in layout[2]:
            if self._whole:
                grads = [grad for p in params if (grad := p.grad) is not None]
            else:
                grads = [self.local(grad) for p in params if (grad := p.grad) is not None]
            if grads:
                by_kind[kind] = grads
        return by_kind

    def first_nonfinite(self, optimizer: Optimizer, module: Module | None) -> str:
        """The first parameter whose gradient holds a NaN/Inf, for the error of ``on_nonfinite="raise"``."""
        names = {id(p): name for name, p in module.named_parameters()} if module is not None else {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None and not bool(torch.isfinite(self.local(p.grad)).all()):
                    where = f", rank {self.rank}" if self.rank is not None else ""
                    return f"`{names.get(id(p), 'unnamed parameter')}` (shape {tuple(p.shape)}{where})"
        return "none found after the reduction" if self.rank is None else "in another rank's shard"

    def scale_now(self, scaler: torch.amp.GradScaler | None) -> Tensor | None:
        """The GradScaler's scale on the device, before its ``update()`` (no host read)."""
        # `_scale` is private: docs/internals.md (private names) says why it is read and which test guards it.
        return scaler._scale.clone() if scaler is not None and scaler._scale is not None else None

    def finish_after_step(
        self,
        engine: AccumulationEngine,
        outcome: GroupOutcome,
        scale_before: Tensor | None,
        scaler: torch.amp.GradScaler | None,
    ) -> GroupRecord:
        """Complete the record of an update the optimizer ran: applied, unless the GradScaler skipped it."""
        if scale_before is None or scaler is None or scaler._scale is None:
            return self.finish(engine, outcome, applied=True)
        before, after = torch.stack([scale_before, scaler._scale.to(scale_before)]).tolist()
        outcome.record.grad_scale = before
        return self.finish(engine, outcome, applied=not scaler_skipped(before, after), skip_reason="overflow")

    def finish(
        self, engine: AccumulationEngine, outcome: GroupOutcome, applied: bool, skip_reason: str | None = None
    ) -> GroupRecord:
        """Add the group to the ledger and make the step-interval schedules due where they advance on it."""
        record = engine.finish_group(outcome, applied=applied, skip_reason=skip_reason)
        schedules = self.schedules
        if schedules is not None and schedules.configs:
            schedules.mark_due(
                lambda frequency: schedule_due(record, engine.ledger, engine.options.schedule_on, frequency)
            )
        return record
