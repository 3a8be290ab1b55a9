"""The base every accumulation strategy shares: Lightning's hooks adapted to one :class:`AccumulationEngine`.

Lightning's own loop stays (zero_grad at a group's start, ``no_sync`` on non-final micro-batches, the optimizer
evaluating the closure inside its ``step``, the precision plugin's unscale, clipping and step, Lightning's hook order
and its own errors); three strategy hooks change:

* ``training_step``: read the micro-batch's loss and unit count and prepare ``loss · w / c``;
* ``backward``: back-propagate that tensor instead of Lightning's ``loss / A``;
* ``optimizer_step``: the closure handed to the optimizer runs Lightning's (the group's last micro-batch) and then
  reduces the group's counters once and rescales the gradient by ``c · D / W``, before unscale and clipping; the
  update is applied, skipped or dropped. A closure-re-evaluating optimizer (LBFGS) runs as in Lightning at
  ``A = 1`` and is an error at ``A > 1``.

With ``automatic_optimization = False`` every hook passes through (Lightning's behaviour); a manual loop gets exact
weighting through :meth:`ExactAccumulation.accumulate` and :meth:`ExactAccumulation.close_group`.

``trainer.global_step`` keeps Lightning's meaning (optimizer-step calls, a dropped partial group
included); exact counts are in :attr:`ExactAccumulation.ledger`.

Checkpoints hold the ledger, ``c`` and the configuration they were written under (``A``, ``D``, ``normalize``,
``partial_group``) under the key ``"lightning_accum"``; one written inside a group also carries that group (its
counters and its gradient summed over replicas), so a run resumed from it closes the group exactly, also under
another ``A`` or ``D``; what cannot be carried (a backward in progress, replicas that cannot be reached) is reported
when writing and when resuming. The entry is checked when loading: a damaged one is an error naming the key, a
missing one is announced. See ``docs/reliability.md``.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_accum.axis_lr import bind_schedulers
from lightning_accum.decision import GroupOutcome
from lightning_accum.engine import AccumulationEngine, GroupListener, Replicas
from lightning_accum.gradients import GradientsByKind, scaler_skipped, summed_gradients
from lightning_accum.group import CARRIED, UNIT_CODES, group_position
from lightning_accum.ledger import COUNTERS, AccumulationLedger, GroupRecord
from lightning_accum.microbatch import Count
from lightning_accum.schedules import UpdateSchedules
from lightning_accum.slicing import MicrobatchSize, SlicingLog, SplitBatch
from lightning_accum.strategies.manual import ManualGroups, _Closed
from lightning_accum.strategies.slicing import BatchSlicer

__all__ = ["CHECKPOINT_KEY", "ExactAccumulation"]

#: Key of the strategy's state in checkpoints written through the strategy.
CHECKPOINT_KEY = "lightning_accum"

_Path = str | Path  # what Lightning's checkpoint methods accept

#: Optimizers known to evaluate the closure several times per update (a line search).
_CLOSURE_EVALUATING: tuple[type[Optimizer], ...] = (torch.optim.LBFGS,)


class _NoUpdate(Exception):  # control flow inside the optimizer step, never seen by users
    """Raised from the closure, inside the optimizer's ``step``, when the closed group makes no update."""

    def __init__(self, result: Any, outcome: GroupOutcome) -> None:
        super().__init__()
        self.result = result
        self.outcome = outcome


class _Step:
    """One automatic optimizer step: what the group-closing closure needs, and the group it closed."""

    __slots__ = ("closure", "optimizer", "outcome", "scale_before", "trainer")

    def __init__(self, optimizer: Optimizer, closure: Callable[..., Any], trainer: Trainer) -> None:
        self.optimizer = optimizer
        self.closure = closure
        self.trainer = trainer
        self.outcome: GroupOutcome | None = None
        self.scale_before: Tensor | None = None


def _reevaluation_message(name: str, accumulate: int) -> str:
    return (
        f"`{name}` evaluates the training closure several times per update (a line search re-runs `training_step`"
        f" and `backward` at new parameters), but `accumulate_grad_batches={accumulate}`: each re-evaluation would"
        " cover only the group's last micro-batch, so no exact accumulated update exists. Use"
        f" `accumulate_grad_batches=1` with {name} (the strategy then runs it as Lightning does), or a first-order"
        " optimizer such as SGD or AdamW to accumulate."
    )


class ExactAccumulation(Strategy):
    """The public base of the accumulation strategies: the hooks they share and the interface callbacks use.

    Listed first in a strategy's bases so that its overrides wrap the Lightning strategy's own methods
    (``super()`` is the single-device or DDP strategy in the method resolution order). Callbacks and user code
    program against this class: ``isinstance(trainer.strategy, ExactAccumulation)``, then :attr:`ledger`,
    :attr:`data_parallel_replicas`, :meth:`add_group_listener` / :meth:`remove_group_listener`,
    :meth:`reduce_sum`, :attr:`gradient_scaler` and :meth:`use_engine`; manual-optimization loops use
    :meth:`accumulate`, :meth:`close_group` and :meth:`no_backward_sync`.
    """

    _engine: AccumulationEngine

    def _init_engine(
        self,
        normalize: str,
        count_tokens: Callable[[Any], Count] | None,
        partial_group: str,
        schedule_on: str,
        on_nonfinite: str,
        max_consecutive_skips: int | None,
        microbatch_size: MicrobatchSize = None,
        split_batch: SplitBatch | None = None,
    ) -> None:
        self._slicer = BatchSlicer(microbatch_size, split_batch)
        if microbatch_size is not None and normalize == "batches":
            raise ValueError(
                f"`microbatch_size={microbatch_size!r}` cannot be combined with `normalize='batches'`: a loader batch"
                " cut into slices must keep its weight, but 'batches' would weigh every slice 1. Use"
                " `normalize='samples'` (a mean loss over samples), 'tokens' (report `num_tokens`), or 'auto'."
            )
        self._engine = AccumulationEngine(
            normalize=normalize,
            count_tokens=count_tokens,
            partial_group=partial_group,
            schedule_on=schedule_on,
            on_nonfinite=on_nonfinite,
            max_consecutive_skips=max_consecutive_skips,
        )
        self._engine.bind(info=rank_zero_info, warn=rank_zero_warn)
        self._schedules: UpdateSchedules | None = None
        self._manual = ManualGroups()
        self._resumed_group: dict[str, Any] | None = None
        self._carried_gradients: dict[str, Tensor] | None = None  # added at the first backward after a resume
        self._trainer_ref: Trainer | None = None  # set in `setup`: the hooks of every micro-batch read it
        # Computed once per run, read on every update: the scaler of the precision plugin, the optimizer's
        # parameters grouped by device and dtype (one fused kernel each), and the group-closing closure's state.
        self._scaler_of: tuple[Any, torch.amp.GradScaler | None] | None = None
        self._layout: tuple[Optimizer, tuple[tuple[int, int], ...], list[tuple[tuple[Any, Any], list[Tensor]]]] | None
        self._layout = None
        self._step: _Step | None = None
        self._naming: Optimizer | None = None  # the optimizer whose group closes (to name a non-finite gradient)

    # ------------------------------------------------------------------ the public interface

    @property
    def ledger(self) -> AccumulationLedger:
        """Exact global counters of the run (identical on every rank); see :class:`AccumulationLedger`."""
        return self._engine.ledger

    @property
    def engine(self) -> AccumulationEngine:
        """The object that does the arithmetic and holds the options given to the strategy."""
        return self._engine

    @property
    def slicing(self) -> SlicingLog:
        """This rank's record of ``microbatch_size=``: the size in force, realized slice sizes, out-of-memory retries
        (see :class:`~lightning_accum.slicing.SlicingLog`)."""
        return self._slicer.log

    @property
    def data_parallel_replicas(self) -> int:
        """``D``: the number of replicas that see different data and whose gradients are averaged."""
        return 1

    def reduce_sum(self, tensor: Tensor) -> Tensor:
        """Sum ``tensor`` in place over the data-parallel replicas (a collective when ``D > 1``); return it."""
        return tensor

    @property
    def gradient_scaler(self) -> torch.amp.GradScaler | None:
        """The enabled GradScaler of the precision plugin, or ``None``."""
        plugin = self.precision_plugin
        cached = self._scaler_of
        if cached is not None and cached[0] is plugin and getattr(plugin, "scaler", None) is cached[1]:
            return cached[1]
        scaler = getattr(plugin, "scaler", None)
        enabled = scaler if isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled() else None
        self._scaler_of = (plugin, enabled) if enabled is scaler else None
        return enabled

    def add_group_listener(self, listener: GroupListener) -> None:
        """Call ``listener(record, batch_samples)`` after every closed group; see
        :meth:`AccumulationEngine.add_listener`."""
        self._engine.add_listener(listener)

    def remove_group_listener(self, listener: GroupListener) -> None:
        """Stop calling ``listener``."""
        self._engine.remove_listener(listener)

    @contextmanager
    def use_engine(self, engine: AccumulationEngine, slicing: bool = True) -> Iterator[AccumulationEngine]:
        """Run the strategy's hooks on ``engine`` (e.g. :meth:`AccumulationEngine.scratch`) inside the block, so
        the run's ledger, open group and pending resume are not touched. ``slicing=False``: a batch given to
        ``training_step`` in the block is run whole even with ``microbatch_size=`` (for a plain-autograd
        reference); with ``True`` it is cut as in the run (the slicing record is not touched either way)."""
        real, resumed, carried = self._engine, self._resumed_group, self._carried_gradients
        self._engine, self._resumed_group, self._carried_gradients = engine, None, None
        with self._slicer.aside(enabled=slicing):
            try:
                yield engine
            finally:
                self._engine, self._resumed_group, self._carried_gradients = real, resumed, carried

    # ------------------------------------------------------------------ hooks

    def _trainer(self) -> Trainer:
        if self._trainer_ref is not None:
            return self._trainer_ref
        module = self.lightning_module
        assert module is not None
        return module.trainer

    def _check_supported(self, trainer: Trainer) -> None:
        if getattr(self, "handles_gradient_accumulation", False):
            raise RuntimeError(
                f"{type(self).__name__} cannot work on a strategy that handles gradient accumulation itself"
                " (`handles_gradient_accumulation=True`, e.g. DeepSpeed). Use strategy='accum' or 'accum_ddp'."
            )
        if self._slicer.enabled and not trainer.lightning_module.automatic_optimization:
            raise ValueError(
                f"`microbatch_size={self._slicer.log.configured!r}` cuts the loader's batch inside Lightning's"
                " automatic optimization, but this LightningModule sets `automatic_optimization = False`. In a"
                " manual loop, cut the batch yourself and report every slice with `strategy.accumulate(...)`, or"
                " pass `microbatch_size=None`."
            )
        accumulate = trainer.accumulate_grad_batches
        if not trainer.lightning_module.automatic_optimization or accumulate == 1:
            return
        for optimizer in trainer.optimizers:
            if isinstance(optimizer, _CLOSURE_EVALUATING):
                raise ValueError(_reevaluation_message(type(optimizer).__name__, accumulate))

    def _automatic(self) -> bool:
        module = self.lightning_module
        return module is None or module.automatic_optimization

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self._automatic():
            self._manual_resume_check()
            return super().training_step(*args, **kwargs)  # Lightning's behaviour; see `accumulate`
        trainer = self._trainer()
        batch_idx = trainer.fit_loop.epoch_loop.batch_idx  # the index Lightning's hooks of this batch receive
        if self._resumed_group is not None or (
            self._engine.microbatches_in_group and group_position(batch_idx, trainer.accumulate_grad_batches) == 0
        ):
            self._check_group_start(trainer, batch_idx)
        if self._slicer.enabled:
            return self._slicer.training_step(
                self, super().training_step, args, kwargs, batch_idx, trainer.accumulate_grad_batches
            )
        output = super().training_step(*args, **kwargs)
        batch = args[0] if args else kwargs.get("batch")
        # An output Lightning rejects (not a tensor, a mapping with "loss", or None) is recorded as "no loss" here;
        # Lightning raises its own MisconfigurationException for it right after this hook.
        # A = 1 (the batch not cut into slices): the group's only micro-batch (c = w, no factor to apply).
        accumulate = trainer.accumulate_grad_batches
        self._engine.add_microbatch(output, batch, accumulate=accumulate, sole=accumulate == 1)
        return output

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        if self._carried_gradients is not None:
            self._install_carried_gradients()
        if not self._automatic():
            # `manual_backward`: the tensor is back-propagated as given; if it is the one `accumulate` handed out,
            # the open group notes that its gradient now holds that micro-batch.
            ours = self._manual.handed_out is not None and closure_loss is self._manual.handed_out
            if ours:
                self._manual.handed_out = None
                self._engine.take_backward_tensor()
            result = super().backward(closure_loss, optimizer, *args, **kwargs)
            if ours:
                self._engine.backward_finished()
            return result
        tensor = self._engine.take_backward_tensor()
        if self._slicer.enabled:
            result = self._slicer.backward(
                self,
                tensor if tensor is not None else closure_loss,
                optimizer,
                lambda t: super(ExactAccumulation, self).backward(t, optimizer, *args, **kwargs),
                synchronised=self._synchronises(),
                args=args,
                kwargs=kwargs,
                lightning_loss=closure_loss,
            )
        else:
            result = super().backward(tensor if tensor is not None else closure_loss, optimizer, *args, **kwargs)
        self._engine.backward_finished()
        return result

    def _synchronises(self) -> bool:
        """Whether the running backward synchronises gradients over replicas (a group's last batch, D > 1)."""
        if self.data_parallel_replicas == 1:
            return False
        trainer = self._trainer()
        epoch_loop = trainer.fit_loop.epoch_loop
        return (epoch_loop.batch_idx + 1) % trainer.accumulate_grad_batches == 0 or bool(
            epoch_loop.batch_progress.is_last_batch
        )

    def _agree_slice_count(self, count: int, num_samples: int) -> int:
        """The number of slices every rank cuts this loader batch into, where ranks must agree on it (collectives
        inside the forward); ``count`` (this rank's own) where they need not."""
        return count

    def _before_forward_retry(self) -> None:
        """Called before the strategy's forward path runs again on the same loader batch after an out-of-memory error
        (DDP: the failed attempt already synchronised the module's buffers)."""

    def _gradients(self, optimizer: Optimizer) -> list[Tensor]:
        return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]

    def _gradients_by_kind(self, optimizer: Optimizer) -> GradientsByKind:
        """``optimizer``'s gradients grouped by device and dtype, from a layout of its parameters kept for the run
        (built again when its parameter groups change)."""
        groups = optimizer.param_groups
        signature = tuple((id(group["params"]), len(group["params"])) for group in groups)
        layout = self._layout
        if layout is None or layout[0] is not optimizer or layout[1] != signature:
            kinds: dict[tuple[Any, Any], list[Tensor]] = {}
            for group in groups:
                for p in group["params"]:
                    kinds.setdefault((p.device, p.dtype), []).append(p)  # a gradient has its parameter's kind
            layout = self._layout = (optimizer, signature, list(kinds.items()))
        by_kind = {}
        for kind, params in layout[2]:
            grads = [grad for p in params if (grad := p.grad) is not None]
            if grads:
                by_kind[kind] = grads
        return by_kind

    def _first_nonfinite_name(self, optimizer: Optimizer) -> str:
        module = self.lightning_module
        names = {id(p): name for name, p in module.named_parameters()} if module is not None else {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
                    return f"`{names.get(id(p), 'unnamed parameter')}` (shape {tuple(p.shape)})"
        return "none found after the reduction"

    def _close(self, optimizer: Optimizer, accumulate: int, ends_epoch: bool) -> GroupOutcome:
        """Close the open group over ``optimizer``'s gradients: one all-reduce, the rescale, the decision."""
        # The engine rescales the gradient by c·D/W on the device and, without a GradScaler (which finds
        # non-finite gradients itself: skip reason "overflow"), checks it for NaN/Inf in the same pass.
        self._naming = optimizer
        engine = self._engine
        return engine.close_group(
            accumulate=accumulate,
            ends_epoch=ends_epoch,
            gradients=self._gradients_by_kind(optimizer),
            check_gradients=self.gradient_scaler is None and engine.options.on_nonfinite != "ignore",
            describe_nonfinite=self._describe_nonfinite,
        )

    def _describe_nonfinite(self) -> str:
        """The first non-finite gradient of the optimizer whose group is closing (read only when one is found)."""
        assert self._naming is not None
        return self._first_nonfinite_name(self._naming)

    def _scale_now(self) -> Tensor | None:
        # GradScaler's `_scale` (private) is read on the device before and after its update: the skip is known
        # from one host read per update, for every optimizer, fused ones included (see docs: private names).
        scaler = self.gradient_scaler
        return scaler._scale.clone() if scaler is not None and scaler._scale is not None else None

    def _finish_after_step(self, outcome: GroupOutcome, scale_before: Tensor | None) -> None:
        scaler = self.gradient_scaler
        if scale_before is None or scaler is None or scaler._scale is None:
            self._finish(outcome, applied=True)
            return
        before, after = torch.stack([scale_before, scaler._scale.to(scale_before)]).tolist()
        outcome.record.grad_scale = before
        self._finish(outcome, applied=not scaler_skipped(before, after), skip_reason="overflow")

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        if not self._automatic():
            return self._manual_optimizer_step(optimizer, closure, model, **kwargs)
        # Lightning calls this once per group, on its last micro-batch, and the optimizer evaluates the closure
        # (that micro-batch's training_step, zero_grad at a group's start, backward) inside its `step`, in
        # Lightning's order. The group closes right after the closure, inside the step: before unscale, clipping
        # and the update. A group that makes no update leaves the step through `_NoUpdate` from the closure.
        # No closure is made per update: the step's state lives in `_step` while the optimizer runs
        # `_closure_then_close` (a method bound once per run).
        step = self._step = _Step(optimizer, closure, self._trainer())
        try:
            output = super().optimizer_step(optimizer, self._closure_then_close, model, **kwargs)
        except _NoUpdate as stop:
            self._finish(stop.outcome, applied=False)
            return stop.result
        finally:
            self._step = None
        if step.outcome is not None:  # else the optimizer never evaluated the closure: Lightning raises its own error
            self._finish_after_step(step.outcome, step.scale_before)
        return output

    def _closure_then_close(self, *args: Any, **kw: Any) -> Any:
        """What the optimizer evaluates in automatic optimization: Lightning's closure, then the group's close."""
        step = self._step
        assert step is not None
        trainer = step.trainer
        if step.outcome is not None:  # the optimizer evaluates the closure again (LBFGS): same batch, new parameters
            return self._reevaluate(step.optimizer, step.closure, trainer.accumulate_grad_batches, *args, **kw)
        result = step.closure(*args, **kw)
        if self._carried_gradients is not None:  # a resumed group whose remaining micro-batches had no backward
            self._install_carried_gradients()
        if self._slicer.enabled:  # a last slice without a loss: Lightning ran no backward to put its batch back
            self._slicer.install_pending(self)
        outcome = step.outcome = self._close(
            step.optimizer,
            trainer.accumulate_grad_batches,
            bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch),
        )
        step.scale_before = self._scale_now()
        if outcome.action != "apply":
            step.optimizer.zero_grad(set_to_none=True)
            raise _NoUpdate(result, outcome)
        return result

    def _reevaluate(
        self, optimizer: Optimizer, closure: Callable[..., Any], accumulate: int, *args: Any, **kw: Any
    ) -> Any:
        """A further evaluation of the closure inside one step: exact on a scratch engine, outside the ledger."""
        if accumulate > 1:
            raise RuntimeError(_reevaluation_message(type(optimizer).__name__, accumulate))
        scratch = self._engine.scratch()
        with self.use_engine(scratch):
            result = closure(*args, **kw)
            scratch.close_group(accumulate=1, gradients=self._gradients(optimizer))
        return result

    def _finish(self, outcome: GroupOutcome, applied: bool, skip_reason: str | None = None) -> GroupRecord:
        record = self._engine.finish_group(outcome, applied=applied, skip_reason=skip_reason)
        schedules = self._schedules
        if schedules is not None and schedules.configs:
            # Lightning calls the module's `lr_scheduler_step` right after this batch; it goes through for these.
            schedules.mark_due(lambda frequency: self._engine.schedule_due(record, frequency))
        return record

    # ------------------------------------------------------------------ manual optimization

    def accumulate(
        self,
        loss: Tensor,
        num_tokens: Count | None = None,
        num_samples: Count | None = None,
        batch: Any = None,
        group_size: int | None = None,
    ) -> Tensor:
        """Record one micro-batch of a manual loop in the open group; return the tensor to back-propagate.

        For ``automatic_optimization = False``: pass what ``training_step`` would return in automatic optimization,
        back-propagate the returned ``loss · w / c`` with ``self.manual_backward``, and call :meth:`close_group`
        before ``optimizer.step()``. Under DDP, run the backward of every micro-batch but a group's last inside
        :meth:`no_backward_sync`; every replica reports the same number of micro-batches per group.

        Args:
            loss: The micro-batch's mean loss over its units (a scalar tensor with a graph).
            num_tokens: Its supervised tokens (int or 0-d integer tensor), as ``"num_tokens"`` in automatic
                optimization; or ``None`` (then the strategy's ``count_tokens``, if given, reads ``batch``).
            num_samples: Its samples; ``None`` infers them from ``batch``'s tensors.
            batch: The micro-batch, for ``count_tokens`` and to infer the samples; optional.
            group_size: The micro-batches per update you plan: it only sets the magnitude of what is
                back-propagated (close to Lightning's ``loss / A``), never the update, which is exact whatever it is.
                ``None``: the previous group's micro-batches per replica (1 for the first group).

        Raises:
            RuntimeError: In automatic optimization (return the counts from ``training_step`` there), or while a
                closed group waits for its ``optimizer.step()``.
            TypeError: ``loss`` is not a tensor.
        """
        if self._automatic():
            raise RuntimeError(
                "`strategy.accumulate` is for manual optimization (`automatic_optimization = False`). In automatic"
                " optimization return `{'loss': loss, 'num_tokens': n}` from `training_step`: the strategy weights it."
            )
        self._manual.check_no_step_pending("accumulate")
        if not isinstance(loss, Tensor):
            raise TypeError(
                f"`strategy.accumulate(loss=...)` takes the micro-batch's mean loss as a tensor, got"
                f" {type(loss).__name__}."
            )
        output: dict[str, Any] = {"loss": loss}
        if num_tokens is not None:
            output["num_tokens"] = num_tokens
        if num_samples is not None:
            output["num_samples"] = num_samples
        if group_size is None:
            last = self._engine.ledger.last_group
            group_size = max(1, last.microbatches // self.data_parallel_replicas) if last is not None else 1
        elif isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"`group_size` must be a positive int or None, got {group_size!r}.")
        tensor = self._engine.add_microbatch(output, batch, accumulate=group_size)
        assert tensor is not None  # a tensor loss always gives one
        self._manual.handed_out = tensor
        return tensor

    def close_group(self, optimizer: Optimizer | LightningOptimizer) -> GroupRecord:
        """Close the group reported with :meth:`accumulate`, before ``optimizer.step()`` (manual optimization).

        One all-reduce of the group's counts, the rescale of ``optimizer``'s gradients by ``c · D / W`` and the
        decision, as at the end of a group in automatic optimization. Then call ``optimizer.step()``: it updates
        (unless a GradScaler finds an overflow) or, for a group that makes no update, does nothing; either way the
        group is recorded in :attr:`ledger` and the listeners are called.

        Returns:
            The group's record; ``applied`` and ``skip_reason`` are final once ``optimizer.step()`` returned (the
            same object is completed then).

        Raises:
            RuntimeError: In automatic optimization, with no micro-batch reported since the last close, or while
                the previous group's ``optimizer.step()`` has not run.
        """
        if self._automatic():
            raise RuntimeError(
                "`strategy.close_group` is for manual optimization (`automatic_optimization = False`); in automatic"
                " optimization the strategy closes every group itself."
            )
        self._manual.check_no_step_pending("close_group")
        inner = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        microbatches = self._engine.microbatches_in_group
        if microbatches == 0:
            raise RuntimeError(
                "`strategy.close_group` found no micro-batch in the open group. Report each micro-batch with"
                " `tensor = strategy.accumulate(loss, num_tokens=...)` and `self.manual_backward(tensor)` first."
            )
        outcome = self._close(inner, accumulate=microbatches, ends_epoch=False)
        if outcome.action != "apply":
            inner.zero_grad(set_to_none=True)
            self._manual.closed = _Closed(inner, None)
            return self._finish(outcome, applied=False)
        self._manual.closed = _Closed(inner, outcome, self._scale_now())
        return outcome.record

    def no_backward_sync(self, enabled: bool = True) -> AbstractContextManager[Any]:
        """A block whose backward passes do not synchronize gradients over replicas (DDP's ``no_sync``).

        For manual loops: every micro-batch of a group but its last runs its forward and backward inside it, as
        Lightning does in automatic optimization; a no-op on one replica, or when ``enabled`` is False.
        """
        block = getattr(self, "block_backward_sync", None)
        if not enabled or block is None or self.data_parallel_replicas == 1:
            return nullcontext()
        return block()  # type: ignore[no-any-return]

    def _manual_optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: LightningModule | Module | None, **kwargs: Any
    ) -> Any:
        closed = self._manual.take_closed(optimizer)
        if closed is None:
            if self._engine.microbatches_in_group:
                raise RuntimeError(
                    f"`{type(optimizer).__name__}.step()` was called while {self._engine.microbatches_in_group}"
                    " micro-batch(es) reported with `strategy.accumulate` wait in an open group. Call"
                    " `strategy.close_group(optimizer)` before `optimizer.step()`: it rescales the gradient to the"
                    " exact weighted mean and records the group."
                )
            return super().optimizer_step(optimizer, closure, model, **kwargs)  # Lightning's behaviour
        if closed.outcome is None:
            closure()  # the group makes no update; the user's closure (if any) still runs, as step would run it
            return None
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._finish_after_step(closed.outcome, closed.scale_before)
        return output

    def _manual_resume_check(self) -> None:
        group, self._resumed_group = self._resumed_group, None
        if group and int(group.get("microbatches", 0)):
            rank_zero_warn(
                f"lightning_accum: the checkpoint was written inside a group of {group['microbatches']} micro-batch(es)"
                " reported with `strategy.accumulate`; with manual optimization that group is not carried over:"
                " write checkpoints between groups."
            )

    @override
    def setup(self, trainer: Trainer) -> None:
        super().setup(trainer)
        self._trainer_ref = trainer
        self._manual.reset()
        self._slicer.reset()
        self._engine.bind(self.root_device, Replicas(self.data_parallel_replicas, self.reduce_sum))
        bind_schedulers(self.lr_scheduler_configs, self._engine)  # AxisLR counts what each applied update consumed
        module = trainer.lightning_module
        if module.automatic_optimization:  # in manual optimization the user steps the schedulers
            self._schedules = UpdateSchedules(module, self.lr_scheduler_configs)

    @override
    def teardown(self) -> None:
        if self._schedules is not None:
            self._schedules.release()
            self._schedules = None
        self._manual.reset()
        self._slicer.reset()
        self._trainer_ref = None
        super().teardown()

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self._trainer()
        self._check_supported(trainer)
        if trainer.lightning_module.automatic_optimization:
            self._engine.warn_short_epoch(trainer.num_training_batches, trainer.accumulate_grad_batches)

    # ------------------------------------------------------------------ checkpoints

    def _group_parameters(self) -> list[tuple[str, Tensor]]:
        """The optimized parameters by name, in a fixed order (the same on every replica)."""
        module = self.lightning_module
        assert module is not None
        optimized = {
            id(p) for optimizer in self.optimizers for group in optimizer.param_groups for p in group["params"]
        }
        return [(name, p) for name, p in module.named_parameters() if id(p) in optimized]

    def _open_group_gradients(self) -> dict[str, Tensor] | None:
        """The open group's gradient summed over replicas, by parameter name, for a checkpoint written inside a
        group (a collective: every replica calls it); ``None`` where the strategy cannot carry it (it says why)."""
        reduce = self.reduce_sum if self.data_parallel_replicas > 1 else None
        return summed_gradients(self._group_parameters(), reduce)

    def _collectives_failed(self) -> str | None:
        """Why the replicas cannot be reached for a collective now (``None``: they can, or there is one replica).

        The DDP strategy answers from the exception being handled (a checkpoint written by ``on_exception`` after a
        collective failed: a dead peer, a timeout)."""
        return None

    def _configuration(self) -> dict[str, Any]:
        """What the checkpoint's groups depend on: ``A``, ``D``, the ``normalize=`` and ``partial_group=`` options."""
        trainer = self._trainer()
        return {
            "accumulate": int(trainer.accumulate_grad_batches),
            "replicas": int(self.data_parallel_replicas),
            "normalize": self._engine.normalize,
            "partial_group": self._engine.partial_group,
        }

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _Path, storage_options: Any | None = None) -> None:
        state = self._engine.state_dict()
        config = self._configuration()
        state["config"] = config
        open_microbatches = self._engine.microbatches_in_group
        carried_before = self._engine.carried_microbatches
        state["open_group_microbatches"] = open_microbatches
        failed = self._collectives_failed() if self.data_parallel_replicas > 1 else None
        if open_microbatches or carried_before:
            # Written inside a group (OnExceptionCheckpoint, SIGTERM, a time-based or hand-written checkpoint):
            # carry the group's counters and its accumulated gradient, so that a run resumed from this file
            # finishes the group exactly (see `_reopen_group`). Every replica takes part (collectives).
            total = carried_before + open_microbatches * config["replicas"]
            if failed is not None:
                group: dict[str, Any] = {"microbatches": open_microbatches, "consistent": False}
                reason = f"the replicas could not be reached to sum it ({failed})"
            else:
                group = self._engine.open_group_state()
                reason = "a micro-batch's backward had not completed"
            progress = self._trainer().fit_loop.epoch_loop.batch_progress.current
            rerun = 1 if progress.ready > getattr(progress, "processed", progress.ready) else 0  # Lightning reruns it
            group.update(
                replicas=config["replicas"], accumulate=config["accumulate"], total_microbatches=total, rerun=rerun
            )
            gradients = self._open_group_gradients() if group["consistent"] else None
            if group["consistent"] and gradients is None:
                reason = "the strategy cannot carry this group's gradient (see its warning)"
            if gradients is not None:
                group["gradients"] = gradients
                group["no_gradient"] = [name for name, _ in self._group_parameters() if name not in gradients]
                group["carried"] = True
            else:
                group["carried"] = False
                group["reason"] = reason
                message = (
                    f"lightning_accum: this checkpoint is written while {reason}; the open group's {total}"
                    " micro-batch(es) (over all replicas) cannot be carried exactly and a run resumed from it will"
                    " say how many of them are lost."
                )
                if failed is not None:
                    warnings.warn(message, UserWarning, stacklevel=2)  # every surviving rank: rank 0 may be gone
                else:
                    rank_zero_warn(message)
            state["open_group"] = group
            if progress.ready > getattr(progress, "processed", progress.ready):
                rank_zero_warn(
                    f"lightning_accum: this checkpoint is written while micro-batch {progress.ready} of the epoch was"
                    " running. Lightning runs it again on resume, but a training loader that saves its position"
                    " (`state_dict`) already counts it as consumed, so it then delivers the next batch: that"
                    " micro-batch's examples are skipped (Lightning's behaviour, not this strategy's)."
                )
        if self._slicer.enabled:
            state["slicing"] = self._slicing_state(gather=failed is None)
        checkpoint[CHECKPOINT_KEY] = state
        if failed is not None:
            self._save_without_peers(checkpoint, filepath, storage_options)
            return
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def _slicing_state(self, gather: bool) -> dict[str, Any]:
        """Every rank's slicing record (``per_rank``; a collective with several processes), so that each rank resumes
        with its own slice size; this rank's alone when the others cannot be reached."""
        mine = self._slicer.log.state_dict()
        rows: list[Any] = [mine]
        world = int(getattr(self, "world_size", 1))
        if gather and world > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            rows = [None] * world
            torch.distributed.all_gather_object(rows, mine)
        return {**mine, "per_rank": rows}

    def _trainer_rank(self) -> int:
        # Lightning restores checkpoints before `setup`: the rank comes from the strategy's cluster environment.
        return int(getattr(self, "global_rank", 0))

    def _save_without_peers(self, checkpoint: dict[str, Any], filepath: _Path, storage_options: Any | None) -> None:
        """Every surviving rank writes the checkpoint (rank zero, which alone writes otherwise, may be the dead one):
        a private file first, then an atomic rename, so that concurrent writers leave one whole file."""
        path = str(filepath)
        if "://" in path:  # a remote file system: no atomic rename to rely on
            self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        partial = f"{path}.rank{getattr(self, 'global_rank', 0)}.partial"
        self.checkpoint_io.save_checkpoint(checkpoint, partial, storage_options=storage_options)
        os.replace(partial, path)

    @override
    def load_checkpoint(self, checkpoint_path: _Path, weights_only: bool | None = None) -> dict[str, Any]:
        # Lightning < 2.5 has no `weights_only` (and never passes it): call its method as it is declared there.
        checkpoint: dict[str, Any] = (
            super().load_checkpoint(checkpoint_path)
            if weights_only is None
            else super().load_checkpoint(checkpoint_path, weights_only)
        )
        if CHECKPOINT_KEY not in checkpoint:
            rank_zero_warn(
                f"lightning_accum: the checkpoint {str(checkpoint_path)!r} holds no {CHECKPOINT_KEY!r} entry (written"
                " by another strategy, or the entry was removed): the ledger starts again at 0, the unit is chosen"
                " again, and if it was written inside an accumulation group, the micro-batches of that group before"
                " it are not in its update (the group is closed as a full one, not dropped as a partial one)."
            )
            self._resumed_group = {"microbatches": 0, "unknown": True}
            return checkpoint
        state = _validated_state(checkpoint[CHECKPOINT_KEY])
        written_unit = (state.get("ledger") or {}).get("normalization")
        self._engine.load_state_dict(state)
        if self._slicer.enabled and state.get("slicing") is not None:
            self._slicer.log.load_state_dict(_own_slicing(state["slicing"], self._trainer_rank()))
        group = dict(state.get("open_group") or {"microbatches": 0})
        self._honour_normalize(written_unit, group)
        # Checked against the loop's position at the first micro-batch of the resumed run.
        group["config"] = dict(state.get("config") or {})
        self._resumed_group = group
        return checkpoint

    def _honour_normalize(self, written_unit: str | None, group: dict[str, Any]) -> None:
        """An explicit ``normalize=`` that differs from the unit the checkpoint's run used wins at an update boundary
        (announced; ``M`` is measured again in the new unit); inside a carried group it is an error, since that
        group's gradient is already weighted by the other unit."""
        wanted = self._engine.normalize
        if wanted == "auto" or written_unit is None or wanted == written_unit:
            return
        if group.get("gradients") is not None:
            raise ValueError(
                f"`normalize={wanted!r}` conflicts with the checkpoint: it was written inside an accumulation group"
                f" whose gradient is weighted by {written_unit}. Resume with `normalize={written_unit!r}` (or"
                " 'auto') to finish that group exactly, or resume from a checkpoint written at an update boundary to"
                " change the unit."
            )
        self._engine.ledger.normalization = wanted
        self._engine.scale_ref = None
        rank_zero_info(
            f"lightning_accum: the checkpoint's run weighted micro-batches by {written_unit}; from now on they are"
            f" weighted by {wanted} (`normalize={wanted!r}` given to the strategy wins at an update boundary)."
        )

    def _check_group_start(self, trainer: Trainer, batch_idx: int) -> None:
        """At the first micro-batch after a resume, reopen the group the checkpoint carries; at a group's first
        micro-batch, discard a group Lightning never stepped. Runs in ``training_step``, before Lightning zeroes the
        gradient at a group's start (no hook of its own on every micro-batch)."""
        if self._resumed_group is not None:
            group, self._resumed_group = self._resumed_group, None
            self._reopen_group(group, batch_idx)
        if self._engine.microbatches_in_group and group_position(batch_idx, trainer.accumulate_grad_batches) == 0:
            # Lightning starts a group (and zeroes the gradient) while the previous one never reached an optimizer
            # step: the loader yielded fewer batches than its length announced, so Lightning's epoch ended early.
            lost = self._engine.discard_open_group()
            rank_zero_warn(
                f"lightning_accum: {lost} micro-batch(es) at the end of the previous epoch never reached an optimizer"
                " step: the training loader ended before the number of batches it announced (`len()`), and Lightning"
                " only steps on the batch it expects to be last. Their gradient is discarded and the ledger does not"
                " count them. Make the loader's length match what it yields."
            )

    def _announce_changes(self, written: dict[str, Any], position: int) -> None:
        """Say which of ``A``, ``D`` and ``partial_group`` differ from the run that wrote the checkpoint."""
        now = self._configuration()
        changes = [
            f"{label} {written[key]!r} -> {now[key]!r}"
            for key, label in (
                ("accumulate", "accumulate_grad_batches"),
                ("replicas", "data-parallel replicas"),
                ("partial_group", "partial_group"),
            )
            if key in written and written[key] != now[key]
        ]
        if not changes:
            return
        where = (
            f" Lightning groups micro-batches by their index in the epoch, so the first group after the resume already"
            f" counts {position} place(s) of {now['accumulate']} as done: it closes after"
            f" {now['accumulate'] - position} more micro-batch(es) per replica and is updated with its real"
            " denominator (a full group, not a partial one)."
            if position
            else ""
        )
        rank_zero_info(f"lightning_accum: resumed with {', '.join(changes)}; the new values apply from here on.{where}")

    def _reopen_group(self, group: dict[str, Any], batch_idx: int) -> None:
        """Finish, exactly, the group a checkpoint was written in; or say which micro-batches are lost."""
        trainer = self._trainer()
        position = group_position(batch_idx, trainer.accumulate_grad_batches)  # ran by Lightning already
        self._announce_changes(group.get("config") or {}, position)
        per_replica = int(group["microbatches"])
        written_replicas = int(group.get("replicas", self.data_parallel_replicas))
        total = int(group.get("total_microbatches", per_replica * written_replicas))
        if group.get("unknown"):
            if position:
                self._engine.note_missing_microbatches(position)
                rank_zero_warn(
                    f"lightning_accum: resumed at micro-batch {position + 1} of an accumulation group from a checkpoint"
                    f" without {CHECKPOINT_KEY!r} state: the group's first {position} micro-batch(es) per replica,"
                    " which Lightning does not run again, are not in its update (normalized by what remains)."
                )
            return
        if total == 0:
            if position:
                self._engine.note_missing_microbatches(position)  # a shorter first group after a change of A
            return
        if "gradients" in group:
            holder = self.is_global_zero  # one replica carries the sums and the gradient; DDP adds the others'
            gradients = _checked_gradients(group, self._group_parameters())
            self._engine.resume_open_group(group, holds_sums=holder, position=position, total=total)
            self._carried_gradients = gradients if holder else {}
            rank_zero_info(
                f"lightning_accum: resumed inside an accumulation group; its first {total} micro-batch(es) (over all"
                " replicas) come from the checkpoint (gradient and counters), so the group closes exactly."
            )
            return
        self._engine.note_missing_microbatches(position)
        # Lightning runs again the micro-batch whose step was running when the checkpoint was written (one per
        # replica); checkpoints of earlier versions did not say, their count is the place in the group.
        rerun = int(group.get("rerun", max(per_replica - position, 0)))
        lost = max(total - rerun * written_replicas, 0)
        reason = group.get("reason") or "no consistent gradient"
        rank_zero_warn(
            f"lightning_accum: resumed inside an accumulation group, but the checkpoint does not carry the"
            f" {total} micro-batch(es) of that group it holds (over {written_replicas} replica(s); {reason}):"
            f" {lost} of them, which Lightning does not run again, are lost (not in the update, normalized by what"
            " remains, and not counted by the ledger). Checkpoints written between micro-batches"
            " (on_train_batch_end, OnExceptionCheckpoint after a failed hook there, SIGTERM) or at update boundaries"
            " resume exactly."
        )

    def _install_carried_gradients(self) -> None:
        """Add the gradient a resumed group carries, right before its first backward after the resume (after
        Lightning's ``zero_grad`` at a group's start, so it survives a group that starts at the resume)."""
        gradients, self._carried_gradients = self._carried_gradients, None
        if not gradients:
            return
        for name, p in self._group_parameters():
            saved = gradients.get(name)
            if saved is None:
                continue
            saved = saved.to(device=p.device, dtype=p.dtype, copy=True)
            p.grad = saved if p.grad is None else p.grad.add_(saved)


# ---------------------------------------------------------------------- the checkpoint's entry, checked

_UNITS = tuple(UNIT_CODES)  # the units a run can be weighted by


def _malformed(key: str, expected: str, found: Any) -> ValueError:
    shown = repr(found)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return ValueError(
        f"The checkpoint's {CHECKPOINT_KEY!r} entry is damaged: `{key}` should be {expected}, but it is {shown}."
        f" Resume from another checkpoint, or remove the {CHECKPOINT_KEY!r} entry to start the ledger again at 0"
        " (announced when loading)."
    )


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check(state: Mapping[str, Any], key: str, prefix: str, test: Callable[[Any], bool], expected: str) -> None:
    if key in state and not test(state[key]):
        raise _malformed(prefix + key, expected, state[key])


def _validated_state(state: Any) -> dict[str, Any]:
    """The package's checkpoint entry after checking every field it reads: a ``ValueError`` naming the key, the
    expected form and what was found, never a silent change. Entries of earlier versions (no ``config``, an open group
    without ``replicas``, ``sums`` as five numbers) pass."""
    if not isinstance(state, Mapping):
        raise _malformed(CHECKPOINT_KEY, "a dict", state)
    ledger = state.get("ledger")
    if not isinstance(ledger, Mapping):
        raise _malformed("ledger", "a dict of the ledger's counters", ledger)
    for name in COUNTERS:
        _check(ledger, name, "ledger.", _is_count, "an int >= 0")
    skipped = ledger.get("updates_skipped", {})
    if not isinstance(skipped, Mapping) or not all(isinstance(k, str) and _is_count(v) for k, v in skipped.items()):
        raise _malformed("ledger.updates_skipped", "a dict of reason -> int >= 0", skipped)
    _check(ledger, "normalization", "ledger.", lambda u: u is None or u in _UNITS, f"None or one of {_UNITS}")
    last = ledger.get("last_group")
    if last is not None:
        fields = {"loss", "tokens", "samples", "microbatches", "applied"}
        if not isinstance(last, Mapping) or not fields <= set(last):
            raise _malformed("ledger.last_group", f"None or a dict with {sorted(fields)}", last)
    _check(state, "scale_ref", "", lambda v: v is None or (_is_number(v) and v > 0), "None or a number > 0")
    _check(state, "consecutive_skips", "", _is_count, "an int >= 0")
    _check(state, "open_group_microbatches", "", _is_count, "an int >= 0")
    config = state.get("config")
    if config is not None:
        if not isinstance(config, Mapping):
            raise _malformed("config", "a dict", config)
        _check(config, "accumulate", "config.", lambda v: _is_count(v) and v > 0, "an int >= 1")
        _check(config, "replicas", "config.", lambda v: _is_count(v) and v > 0, "an int >= 1")
        _check(config, "normalize", "config.", lambda v: v in ("auto", *_UNITS), f"one of {('auto', *_UNITS)}")
        _check(config, "partial_group", "config.", lambda v: v in ("rescale", "drop"), "'rescale' or 'drop'")
    group = state.get("open_group")
    if group is not None:
        _validate_group(group)
    slicing = state.get("slicing")
    if slicing is not None:
        if not isinstance(slicing, Mapping):
            raise _malformed("slicing", "a dict", slicing)
        _check(slicing, "size", "slicing.", lambda v: v is None or (_is_count(v) and v > 0), "None or an int >= 1")
        sizes = slicing.get("slice_sizes", {})
        if not isinstance(sizes, Mapping) or not all(_is_count(v) for v in sizes.values()):
            raise _malformed("slicing.slice_sizes", "a dict of size -> int >= 0", sizes)
        _check(slicing, "retries", "slicing.", lambda v: isinstance(v, list), "a list")
        _check(slicing, "per_rank", "slicing.", lambda v: isinstance(v, list), "a list of each rank's record")
    return dict(state)


def _validate_group(group: Any) -> None:
    if not isinstance(group, Mapping):
        raise _malformed("open_group", "None or a dict", group)
    if not _is_count(group.get("microbatches")):
        raise _malformed("open_group.microbatches", "an int >= 0", group.get("microbatches"))
    for key in ("replicas", "accumulate"):
        _check(group, key, "open_group.", lambda v: _is_count(v) and v > 0, "an int >= 1")
    _check(group, "total_microbatches", "open_group.", _is_count, "an int >= 0")
    _check(group, "scale_ref", "open_group.", lambda v: v is None or (_is_number(v) and v > 0), "None or a number > 0")
    if "gradients" not in group:
        return
    sums = group.get("sums")
    names = [slot.name.lower() for slot in CARRIED]
    if isinstance(sums, Mapping):
        if set(sums) != set(names) or not all(_is_number(v) for v in sums.values()):
            raise _malformed("open_group.sums", f"a dict of finite numbers with keys {names}", sums)
    elif not (isinstance(sums, list | tuple) and len(sums) == 5 and all(_is_number(v) for v in sums)):
        raise _malformed("open_group.sums", f"a dict of finite numbers with keys {names} (or 5 numbers)", sums)
    gradients = group["gradients"]
    if not isinstance(gradients, Mapping) or not all(
        isinstance(k, str) and isinstance(v, Tensor) for k, v in gradients.items()
    ):
        raise _malformed("open_group.gradients", "a dict of parameter name -> tensor", gradients)
    _check(
        group,
        "no_gradient",
        "open_group.",
        lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v),
        "a list of parameter names",
    )


def _own_slicing(state: Mapping[str, Any], rank: int) -> Mapping[str, Any]:
    """This rank's slicing record in a checkpoint's entry (rank zero's, or the only one, otherwise)."""
    rows = state.get("per_rank")
    if isinstance(rows, list) and rank < len(rows) and isinstance(rows[rank], Mapping):
        return rows[rank]  # type: ignore[no-any-return]
    return state


def _checked_gradients(group: Mapping[str, Any], parameters: list[tuple[str, Tensor]]) -> dict[str, Tensor]:
    """The carried gradient, checked against the parameters it is added to (names, shapes, completeness)."""
    gradients: dict[str, Tensor] = dict(group["gradients"])
    shapes = {name: tuple(p.shape) for name, p in parameters}
    for name, gradient in gradients.items():
        if name not in shapes:
            raise _malformed(
                f"open_group.gradients[{name!r}]", f"the gradient of one of the parameters {sorted(shapes)}", name
            )
        if tuple(gradient.shape) != shapes[name]:
            raise _malformed(f"open_group.gradients[{name!r}]", f"a tensor of shape {shapes[name]}", gradient.shape)
    if "no_gradient" in group:  # written by this version: every parameter is either carried or named as unused
        known = set(gradients) | set(group["no_gradient"])
        for name in shapes:
            if name not in known:
                raise _malformed(
                    f"open_group.gradients[{name!r}]",
                    "a tensor (the parameter is neither carried nor listed in `open_group.no_gradient`)",
                    "missing",
                )
    else:
        absent = [name for name in shapes if name not in gradients]
        if absent:
            rank_zero_warn(
                f"lightning_accum: the checkpoint's open group carries no gradient for {absent} (a checkpoint of an"
                " earlier version, which did not record unused parameters): they are taken as unused in that group."
            )
    return gradients
