"""Running a loader batch as slices inside Lightning's step (``microbatch_size=``), and recovering from out of memory.

Lightning's automatic optimization calls ``training_step`` once per loader batch, then (at a group's first batch)
``zero_grad``, then ``backward`` on what the step returned; the group's last batch does both inside the optimizer's
``step`` with DDP's gradient synchronisation on. The slicer keeps that shape:

* in ``training_step``, every slice but the last runs its forward *and* backward, without gradient synchronisation
  (``no_backward_sync``; under DDP the forward calls the module directly, not DDP's wrapper, so that it starts no
  collective whatever the number of slices on each rank); the last slice runs its forward only, through the
  strategy's own path (DDP's wrapper), and its output goes back to Lightning with ``"loss"`` replaced by the whole
  batch's weighted mean loss;
* at a group's first batch, Lightning's ``zero_grad`` comes after ``training_step``: the slices' gradients are kept
  aside there (the previous group's stale gradients are released first) and put back right before the last slice's
  backward, which Lightning calls as usual (synchronised on the group's last batch);
* ``on_before_backward`` / ``on_after_backward`` run once per loader batch, around the last slice's backward, as
  without slicing.

Every slice is read once (:meth:`AccumulationEngine.read`, its samples the slice's ``stop - start``) and recorded in
the open group with its own units (:meth:`AccumulationEngine.record` with ``continues=True``), so the update is exact
by construction; the ledger still counts loader batches as micro-batches.

``"auto"`` (docs/howto.md, "Cut batches into slices") halves a slice that ran out of memory and runs it again; what
the group accumulated before is untouched, because every backward that can be retried writes into fresh gradient
tensors, added to the accumulated ones once it completed. The backward that synchronises gradients over replicas
cannot be retried (the other replicas are inside its all-reduce): its error names the size to resume with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from lightning_accum.microbatch import Count, Microbatch
from lightning_accum.slicing import (
    MicrobatchSize,
    OutOfMemoryRetry,
    SlicingLog,
    SplitBatch,
    count_samples,
    free_memory,
    is_out_of_memory,
    slice_batch,
    validate_microbatch_size,
)

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

    from lightning_accum.engine import AccumulationEngine
    from lightning_accum.ledger import AccumulationLedger
    from lightning_accum.strategies.trainer_side import TrainerSide

__all__ = ["BatchSlicer", "SliceHost"]


class SliceHost(Protocol):
    """What the slicer uses of the strategy that runs it: Lightning's public strategy members and the accumulation
    strategy's engine and ledger (what differs per engine is the strategy's
    :class:`~lightning_accum.strategies.trainer_side.TrainerSide`, handed to the slicer)."""

    @property
    def engine(self) -> AccumulationEngine: ...
    @property
    def ledger(self) -> AccumulationLedger: ...
    @property
    def lightning_module(self) -> Any: ...
    @property
    def precision_plugin(self) -> Any: ...
    @property
    def optimizers(self) -> list[Any]: ...
    @property
    def gradient_scaler(self) -> torch.amp.GradScaler | None: ...
    @property
    def root_device(self) -> torch.device: ...
    def no_backward_sync(self, enabled: bool = True) -> AbstractContextManager[Any]: ...
    def pre_backward(self, closure_loss: Tensor) -> None: ...
    def post_backward(self, closure_loss: Tensor) -> None: ...


@dataclass
class _Final:
    """The last slice of the running loader batch, whose backward Lightning calls next."""

    batch: Any
    num_samples: int
    start: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any = None  # what went back to Lightning for the batch


@dataclass
class _Part:
    loss: Tensor | None
    weight: Count
    tokens: Any
    samples: Any
    documents: Any = None


class _OutOfMemory(Exception):  # internal: a slice ran out of memory (the original error is chained)
    def __init__(self, phase: str) -> None:
        super().__init__(phase)
        self.phase = phase


class BatchSlicer:
    """The per-strategy state of ``microbatch_size=``: the option, this rank's :class:`SlicingLog`, and the running
    batch's pieces; ``side``: the strategy's (the slice count agreed over the ranks, a forward run again);
    ``normalize``: the run's option (a slice weighs its units, never 1)."""

    def __init__(
        self, microbatch_size: MicrobatchSize, split_batch: SplitBatch | None, side: TrainerSide, normalize: str
    ) -> None:
        if microbatch_size is not None and normalize == "batches":
            raise ValueError(
                f"`microbatch_size={microbatch_size!r}` cannot be combined with `normalize='batches'`: a loader batch"
                " cut into slices must keep its weight, but 'batches' would weigh every slice 1. Use"
                " `normalize='samples'` (a mean loss over samples), 'tokens' (report `num_tokens`), or 'auto'."
            )
        microbatch_size = validate_microbatch_size(microbatch_size)
        if split_batch is not None and not callable(split_batch):
            raise TypeError(
                f"`split_batch` must be a callable `(batch, start, stop) -> batch` or None, got"
                f" {type(split_batch).__name__}."
            )
        self.log = SlicingLog(
            configured=microbatch_size, size=microbatch_size if isinstance(microbatch_size, int) else None
        )
        self.split_batch = split_batch
        self.side = side
        self._parameters: list[Tensor] | None = None
        self._layout: tuple[int, ...] = ()
        self._pending: list[tuple[Tensor, Tensor]] | None = None
        self._final: _Final | None = None
        self._parts: list[_Part] = []
        #: Whether loader batches are cut into slices (an attribute, read twice per micro-batch on the hot path).
        self.enabled = self.log.configured is not None

    @contextmanager
    def aside(self, enabled: bool) -> Iterator[None]:
        """A block run on another engine (``use_engine``): the run's record and running batch are kept aside, and
        slicing is off unless ``enabled``."""
        saved = (self.log, self._pending, self._final, self._parts, self.enabled)
        self.log = dataclasses.replace(self.log, slice_sizes=dict(self.log.slice_sizes), retries=list(self.log.retries))
        self._pending, self._final, self._parts = None, None, []
        self.enabled = self.enabled and enabled
        try:
            yield
        finally:
            self.log, self._pending, self._final, self._parts, self.enabled = saved

    @property
    def auto(self) -> bool:
        return self.log.configured == "auto"

    def reset(self) -> None:
        """Forget the run's parameters and any running batch (``setup`` / ``teardown``)."""
        self._parameters = None
        self._pending = None
        self._final = None
        self._parts = []

    # ------------------------------------------------------------------ training_step

    def training_step(
        self,
        strategy: SliceHost,
        forward: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        batch_idx: int,
        accumulate: int,
        position: int,
    ) -> Any:
        """Run the loader batch in ``args``/``kwargs`` as slices; return the last slice's output (the batch's loss).

        ``forward(*args, **kwargs)`` is the strategy's own ``training_step`` path (DDP's wrapper), used for the last
        slice, whose backward Lightning calls next. ``position``: the batch's in its group (the strategy's groups').
        """
        batch = args[0] if args else kwargs["batch"]
        n = count_samples(batch, self.split_batch)
        engine = strategy.engine
        self._parts = []
        sizes: list[int] = []
        # Lightning zeroes the gradient after the step of a group's first batch (its place in the epoch, and no
        # micro-batch in the open group yet: AccumulationCheck runs a group's batches without Lightning's loop).
        first_of_group = position == 0 and engine.microbatches_in_group == 0
        released = False
        retry_forward = False
        plan = self._plan(strategy, n)
        start = 0
        while True:
            stop = plan[len(sizes)] if plan is not None else min(start + self.log.limit(n), n)
            piece = self._cut(batch, start, stop, n)
            piece_args, piece_kwargs = _with_batch(args, kwargs, piece)
            if stop < n:
                if first_of_group and not released:
                    # The previous group's gradient is released now, the slices' kept aside until `install_pending`.
                    released = True
                    for p in self._params(strategy):
                        p.grad = None
                run = partial(self._local_slice, strategy, piece, piece_args, piece_kwargs, accumulate, start > 0)
                if self._attempt(strategy, stop - start, batch_idx, run):
                    sizes.append(stop - start)
                    start = stop
                continue
            if retry_forward:
                self.side.before_forward_retry()
            outputs: list[Any] = []
            run = partial(_forward, forward, piece_args, piece_kwargs, self.auto, outputs)
            if not self._attempt(strategy, stop - start, batch_idx, run):
                retry_forward = True
                continue
            output = outputs.pop()
            microbatch = engine.read(output, piece, num_samples=stop - start)
            engine.record(microbatch, accumulate, continues=start > 0)
            self._note_part(engine, microbatch)
            sizes.append(stop - start)
            self._final = _Final(batch, n, start, args, kwargs)
            break
        if released:
            params = self._params(strategy)
            self._pending = [(p, p.grad) for p in params if p.grad is not None]
            for p in params:
                p.grad = None
        self.log.note_slices(sizes)
        result = combined_output(self._parts, output)
        if self._final is not None:
            self._final.output = result
        return result

    def _plan(self, strategy: SliceHost, n: int) -> list[int] | None:
        """The slices' ends for a fixed ``microbatch_size``: the fewest slices of at most that many samples, as even as
        possible (8 samples at 3: 3 + 3 + 2; 4 at 3: 2 + 2, whose largest slice, which sets the peak, is smaller than
        3 + 1's). Where the ranks must agree on the number (FSDP2 / tensor parallelism: collectives in every
        forward), the largest any rank needs. ``None`` under ``"auto"`` (sizes follow the retries)."""
        if self.auto:
            return None
        size = self.log.limit(n)
        count = self.side.agree_slice_count(-(-n // size), n)
        base, extra = divmod(n, count)
        ends, end = [], 0
        for index in range(count):
            end += base + (1 if index < extra else 0)
            ends.append(end)
        return ends

    def _cut(self, batch: Any, start: int, stop: int, n: int) -> Any:
        if start == 0 and stop == n:
            return batch
        if self.split_batch is not None:
            return self.split_batch(batch, start, stop)
        return slice_batch(batch, start, stop, n)

    def _note_part(self, engine: AccumulationEngine, microbatch: Microbatch) -> None:
        loss = microbatch.loss.detach() if microbatch.loss is not None else None
        weight = engine.last_weight if loss is not None else 0
        samples = microbatch.samples if microbatch.reports_samples else None
        self._parts.append(_Part(loss, weight, microbatch.tokens, samples, microbatch.documents))

    def _local_slice(
        self,
        strategy: SliceHost,
        piece: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        accumulate: int,
        continues: bool,
        size: int,
    ) -> None:
        """Forward and backward of one slice without gradient synchronisation; ``_OutOfMemory`` under ``"auto"``."""
        engine = strategy.engine
        module = strategy.lightning_module
        assert module is not None
        with strategy.no_backward_sync():
            try:
                with strategy.precision_plugin.train_step_context():
                    output = module.training_step(*args, **kwargs)
            except BaseException as error:
                if self.auto and is_out_of_memory(error):
                    raise _OutOfMemory("forward") from error
                raise
            microbatch = engine.read(output, piece, num_samples=size)
            del output
            tensor = engine.record(microbatch, accumulate, continues)
            self._note_part(engine, microbatch)
            del microbatch
            engine.take_backward_tensor()  # the group's gradient is incomplete until the last slice's backward
            if tensor is None:
                return
            scaler = strategy.gradient_scaler
            scaled = scaler.scale(tensor) if scaler is not None else tensor
            del tensor
            backward = partial(strategy.precision_plugin.backward, scaled, module, None)
            if not self.auto:
                backward()
                return
            failed = self._protected_backward(strategy, backward)
            if failed is not None:
                engine.retract_microbatch()
                self._parts.pop()
                raise _OutOfMemory("backward") from failed
            # The group stays "backward running" (not carried by a checkpoint) until the batch's last backward: a
            # checkpoint written after an error in a later slice would otherwise carry part of a batch that Lightning
            # runs again on resume.

    def _protected_backward(self, strategy: SliceHost, run: Callable[[], None]) -> BaseException | None:
        """Run a backward into fresh gradient tensors and add them to the accumulated ones only once it completed;
        ``None``, or the out-of-memory error (without its traceback; the accumulated gradients untouched)."""
        params = self._params(strategy)
        held = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            run()
        except BaseException as error:
            for p, h in zip(params, held, strict=True):
                p.grad = h  # the partial gradient of the failed backward is dropped
            if is_out_of_memory(error):
                error.__traceback__ = None  # its frames hold the failed backward's graph
                return error
            raise
        for p, h in zip(params, held, strict=True):
            if h is None:
                continue
            fresh = p.grad
            if fresh is not None:
                h.add_(fresh)
            p.grad = h
        return None

    def _attempt(self, strategy: SliceHost, size: int, batch_idx: int, run: Callable[[int], None]) -> bool:
        """``run(size)`` for a slice of ``size`` samples; ``False`` when it ran out of memory under ``"auto"`` (then
        the size is halved, or a slice of one sample is an error)."""
        try:
            run(size)
            return True
        except _OutOfMemory as failure:
            phase, cause = failure.phase, _released(failure)
        # Outside the `except` block: the attempt's frames are gone.
        self._shrink(strategy, size, phase, batch_idx, cause)
        return False

    def _shrink(
        self, strategy: SliceHost, failed: int, phase: str, batch_idx: int, cause: BaseException | None
    ) -> None:
        free_memory(strategy.root_device)
        trainer = _trainer(strategy)
        if failed <= 1:
            raise RuntimeError(
                f"Out of memory in the {phase} of a slice of 1 sample (rank {_rank(strategy)}, batch {batch_idx}"
                f" of epoch {trainer.current_epoch}; slice sizes run so far on this rank:"
                f" {self.log.slice_sizes or 'none'}; retries: {len(self.log.retries)}). `microbatch_size='auto'`"
                " cannot cut further: one sample does not fit in memory with this model. Lower the sequence length"
                " or the model's memory (activation checkpointing, a lower precision, sharding with"
                " strategy='accum_fsdp')."
            ) from cause
        new = max(1, failed // 2)
        self.log.size = new
        self.log.retries.append(
            OutOfMemoryRetry(
                update=strategy.ledger.updates_attempted + 1,
                epoch=trainer.current_epoch,
                batch_idx=batch_idx,
                rank=_rank(strategy),
                phase=phase,
                failed_size=failed,
                new_size=new,
            )
        )
        strategy.engine.warn(
            f"lightning_accum: out of memory in the {phase} of a slice of {failed} sample(s) on rank"
            f" {_rank(strategy)} (batch {batch_idx}, update {strategy.ledger.updates_attempted + 1}); running it"
            f" again as slices of {new} (microbatch_size='auto'; the group's update is unchanged)."
        )

    # ------------------------------------------------------------------ backward

    def install_pending(self) -> None:
        """Put the slices' gradients kept aside at a group's first batch back, after Lightning's ``zero_grad``."""
        pending, self._pending = self._pending, None
        for p, g in pending or ():
            p.grad = g if p.grad is None else p.grad.add_(g)

    def backward(
        self,
        strategy: SliceHost,
        tensor: Tensor,
        optimizer: Any,
        default: Callable[[Tensor], Tensor],
        synchronised: bool,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        lightning_loss: Tensor | None = None,
    ) -> Tensor:
        """The last slice's backward: ``default(tensor)`` is the strategy's usual one. Under ``"auto"`` on one replica
        it is protected and, out of memory, the last slice runs again as smaller slices; a synchronised backward cannot
        be run again (the other replicas are inside its all-reduce): its error says what to do."""
        final, self._final = self._final, None
        self.install_pending()
        if not self.auto or final is None:
            return default(tensor)
        size = final.num_samples - final.start
        if synchronised:
            try:
                return default(tensor)
            except BaseException as error:
                if not is_out_of_memory(error):
                    raise
                raise RuntimeError(
                    f"Out of memory in the backward that synchronises gradients over the replicas (the last slice,"
                    f" {size} sample(s), of the group's last batch; rank {_rank(strategy)}). It cannot be run"
                    " again: the other replicas are inside its all-reduce (the launcher stops them when this process"
                    " exits). Resume from the last checkpoint with `microbatch_size="
                    f"{max(1, size // 2)}` on the strategy (a fixed slice size), or free memory."
                ) from error
        module = strategy.lightning_module
        assert module is not None
        # Lightning's `Strategy.backward`, with the backward itself protected.
        strategy.pre_backward(tensor)
        closure_loss = strategy.precision_plugin.pre_backward(tensor, module)
        failed = self._protected_backward(
            strategy, lambda: strategy.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
        )
        if failed is not None:
            # Lightning's closure still holds the step's loss, and with it the failed slice's graph and activations:
            # detached in place, they are released before the slice runs again, smaller.
            held = [tensor, closure_loss, lightning_loss, *_tensors_of(final.output)]  # Lightning's loss / A too
            for value in held:
                _detach_in_place(value)
            del held
            strategy.engine.retract_microbatch()
            self._parts = []
            batch_idx = _trainer(strategy).fit_loop.epoch_loop.batch_idx
            self._shrink(strategy, size, "backward", batch_idx, failed)
            del failed
            self._run_local(strategy, final, batch_idx)
        closure_loss = strategy.precision_plugin.post_backward(closure_loss, module)
        strategy.post_backward(closure_loss)
        return closure_loss

    def _run_local(self, strategy: SliceHost, final: _Final, batch_idx: int) -> None:
        """The rest of a batch, from ``final.start``, as slices with their own backward (one replica: no sync)."""
        trainer = _trainer(strategy)
        start, n = final.start, final.num_samples
        sizes: list[int] = []
        while start < n:
            stop = min(start + self.log.limit(n), n)
            piece = self._cut(final.batch, start, stop, n)
            args, kwargs = _with_batch(final.args, final.kwargs, piece)
            run = partial(self._local_slice, strategy, piece, args, kwargs, trainer.accumulate_grad_batches, start > 0)
            if self._attempt(strategy, stop - start, batch_idx, run):
                sizes.append(stop - start)
                start = stop
        self.log.note_slices(sizes)
        self.log.slice_sizes[n - final.start] -= 1  # the failed last slice was counted when its forward ran
        if not self.log.slice_sizes[n - final.start]:
            del self.log.slice_sizes[n - final.start]

    # ------------------------------------------------------------------ parameters

    def _params(self, strategy: SliceHost) -> list[Tensor]:
        """The optimized parameters; rebuilt when a parameter group was added since (e.g. ``BackboneFinetuning``)."""
        optimizers = strategy.optimizers
        layout = tuple(len(group["params"]) for optimizer in optimizers for group in optimizer.param_groups)
        if self._parameters is None or layout != self._layout:
            # Each parameter once, in the order the optimizers first hold it.
            by_id = {id(p): p for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]}
            self._parameters, self._layout = list(by_id.values()), layout
        return self._parameters


def combined_output(parts: list[_Part], output: Any) -> Any:
    """What Lightning sees of a sliced loader batch: the last slice's ``output`` with ``"loss"`` (and the counts it
    reports) of the whole batch, the slices' losses weighted by their units (gradients flow only through the last
    slice's loss; the others' backwards already ran)."""
    if len(parts) <= 1:
        return output
    loss = output if isinstance(output, Tensor) else output.get("loss") if isinstance(output, Mapping) else None
    if not isinstance(loss, Tensor):
        return output
    weighted = [(p.loss, p.weight) for p in parts if p.loss is not None]
    numerator = sum(part.to(torch.float64) * w for part, w in weighted)
    total = sum(w for _, w in weighted)
    mean: Tensor | float
    if isinstance(total, Tensor):
        mean = torch.where(total > 0, numerator / total.clamp(min=1), loss.detach().to(torch.float64))
    else:
        mean = numerator / total if total else loss.detach().to(torch.float64)
    combined = loss + (torch.as_tensor(mean, device=loss.device).to(loss.dtype) - loss.detach())
    if isinstance(output, Tensor):
        return combined
    result = dict(output)
    result["loss"] = combined
    for key, attribute in (("num_tokens", "tokens"), ("num_samples", "samples"), ("num_documents", "documents")):
        values = [getattr(p, attribute) for p in parts]
        if output.get(key) is not None and all(v is not None for v in values):
            result[key] = sum(values)
    return result


def _forward(
    forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], auto: bool, into: list[Any], size: int
) -> None:
    """The strategy's own forward path for a batch's last slice; its out-of-memory error as ``_OutOfMemory``."""
    try:
        into.append(forward(*args, **kwargs))
    except BaseException as error:
        if auto and is_out_of_memory(error):
            raise _OutOfMemory("forward") from error
        raise


def _released(failure: _OutOfMemory) -> BaseException | None:
    """The out-of-memory error behind ``failure``, without its traceback (whose frames hold the failed attempt's
    activations), so that the memory is free before the slice runs again; its type and message are kept."""
    cause = failure.__cause__
    failure.__traceback__ = None
    if cause is not None:
        cause.__traceback__ = None
        cause.__context__ = None
    return cause


def _tensors_of(output: Any) -> list[Tensor]:
    """The tensors a step's output holds at its top level (the loss, and e.g. logits kept for a callback)."""
    if isinstance(output, Tensor):
        return [output]
    if isinstance(output, Mapping):
        return [v for v in output.values() if isinstance(v, Tensor)]
    return []


def _detach_in_place(tensor: Tensor | None) -> None:
    if tensor is None or tensor.grad_fn is None:
        return
    try:
        tensor.detach_()
    except RuntimeError:  # a view cannot be detached in place; its graph goes when Lightning drops it
        pass


def _rank(strategy: SliceHost) -> int:
    return int(_trainer(strategy).global_rank)


def _trainer(strategy: SliceHost) -> Trainer:
    module = strategy.lightning_module
    assert module is not None  # the slicer runs inside a fit
    return module.trainer  # type: ignore[no-any-return]


def _with_batch(args: tuple[Any, ...], kwargs: dict[str, Any], batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if args:
        return (batch, *args[1:]), kwargs
    return args, {**kwargs, "batch": batch}
