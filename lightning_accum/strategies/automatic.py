"""The optimizer step of automatic optimization: Lightning's closure, then the group's close, inside the optimizer."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import Tensor
from torch.optim import Optimizer

from lightning_accum.carry import Carried
from lightning_accum.core.closing import GroupClosing
from lightning_accum.core.core import AccumulationCore
from lightning_accum.core.lifecycle import GroupState
from lightning_accum.decision import GroupOutcome
from lightning_accum.engine import AccumulationEngine
from lightning_accum.strategies.slicing import BatchSlicer

__all__ = ["CLOSURE_EVALUATING", "AutomaticSteps", "StepHost", "reevaluation_message"]

#: Optimizers known to evaluate the closure several times per update (a line search).
CLOSURE_EVALUATING: tuple[type[Optimizer], ...] = (torch.optim.LBFGS,)


def reevaluation_message(name: str, accumulate: int) -> str:
    """Why an optimizer that re-evaluates the closure cannot accumulate, and what to do."""
    return (
        f"`{name}` evaluates the training closure several times per update (a line search re-runs `training_step`"
        f" and `backward` at new parameters), but `accumulate_grad_batches={accumulate}`: each re-evaluation would"
        " cover only the group's last micro-batch, so no exact accumulated update exists. Use"
        f" `accumulate_grad_batches=1` with {name} (the strategy then runs it as Lightning does), or a first-order"
        " optimizer such as SGD or AdamW to accumulate."
    )


class StepHost(Protocol):
    """What :class:`AutomaticSteps` reads of the strategy it serves."""

    @property
    def gradient_scaler(self) -> torch.amp.GradScaler | None: ...

    @property
    def lightning_module(self) -> LightningModule | None: ...

    def use_engine(
        self, engine: AccumulationEngine, slicing: bool = True
    ) -> AbstractContextManager[AccumulationEngine]: ...


class _NoUpdate(Exception):  # control flow inside the optimizer step, never seen by users
    """Raised from the closure, inside the optimizer's ``step``, when the closed group makes no update."""

    def __init__(self, result: Any, outcome: GroupOutcome) -> None:
        super().__init__()
        self.result = result
        self.outcome = outcome


@dataclass(slots=True)
class _Step:
    """One automatic optimizer step: what the closing closure needs, and the group it closed."""

    host: StepHost
    closing: GroupClosing
    optimizer: Optimizer
    closure: Callable[..., Any]
    prepare: Callable[[], Carried | None]
    engine: AccumulationEngine
    scaler: torch.amp.GradScaler | None
    module: LightningModule | None
    accumulate: int
    ends_epoch: bool
    outcome: GroupOutcome | None = None
    scale_before: Tensor | None = None


class AutomaticSteps:
    """The optimizer steps of a run in automatic optimization, each closing its group inside the optimizer's step:
    ``core``'s group, after the slices ``slicer`` kept aside are put back."""

    def __init__(self, core: AccumulationCore, slicer: BatchSlicer) -> None:
        self.core, self.slicer = core, slicer
        self._step: _Step | None = None  # the step running, while the optimizer may evaluate the closure

    def optimizer_step(
        self,
        host: StepHost,
        optimizer: Optimizer,
        closure: Callable[..., Any],
        trainer: Trainer,
        lightning_step: Callable[[Callable[..., Any]], Any],
    ) -> Any:
        """Run ``lightning_step`` with a closure: ``closure``, then the group's close."""
        # Known before the closure runs: Lightning sets the batch's place in the epoch before its step.
        accumulate = trainer.accumulate_grad_batches
        ends_epoch = bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
        engine, closing, scaler, module = (
            self.core.engine,
            self.core.closing,
            host.gradient_scaler,
            host.lightning_module,
        )
        step = _Step(host, closing, optimizer, closure, self._prepare, engine, scaler, module, accumulate, ends_epoch)
        self._step = step
        try:
            output = lightning_step(self._closure_then_close)
        except _NoUpdate as stop:
            closing.finish(step.engine, stop.outcome, applied=False)
            return stop.result
        finally:
            self._step = None
        if step.outcome is not None:  # else the optimizer never evaluated the closure: Lightning raises its own error
            closing.finish_after_step(step.engine, step.outcome, step.scale_before, step.scaler)
        return output

    def _prepare(self) -> Carried | None:
        """What a group's close needs first, after Lightning's closure: the gradient of a resumed group whose
        remaining micro-batches had no backward, and a last slice's batch that Lightning did not put back; then the
        group closes in the lifecycle, which hands the close what a checkpoint carried into it."""
        core = self.core
        if core.group.state is GroupState.REOPENED:
            core.install_carried()
        if self.slicer.enabled:
            self.slicer.install_pending()
        return core.group.close()

    def _closure_then_close(self, *args: Any, **kw: Any) -> Any:
        """What the optimizer evaluates: Lightning's closure, then the group's close."""
        step = self._step
        assert step is not None
        if step.outcome is not None:  # the optimizer evaluates the closure again (LBFGS): same batch, new parameters
            return self._reevaluate(step, *args, **kw)
        result = step.closure(*args, **kw)
        carried = step.prepare()
        closing, scaler = step.closing, step.scaler
        outcome = step.outcome = closing.close(
            step.engine, step.optimizer, step.module, step.accumulate, step.ends_epoch, scaler, None, carried
        )
        step.scale_before = closing.scale_now(scaler)
        if outcome.action != "apply":
            step.optimizer.zero_grad(set_to_none=True)
            raise _NoUpdate(result, outcome)
        return result

    def _reevaluate(self, step: _Step, *args: Any, **kw: Any) -> Any:
        """A further evaluation of the closure inside one step: exact on a scratch engine, outside the ledger."""
        if step.accumulate > 1:
            raise RuntimeError(reevaluation_message(type(step.optimizer).__name__, step.accumulate))
        scratch = step.engine.scratch()
        with step.host.use_engine(scratch):
            result = step.closure(*args, **kw)
            scratch.close_group(accumulate=1, gradients=step.closing.gradients_by_kind(step.optimizer))
        return result
