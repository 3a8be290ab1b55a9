"""Running a loader batch as slices inside Lightning's step (``microbatch_size=``), and recovering from out of memory
(docs/internals.md, "Slices inside Lightning's step")."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
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
from lightning_accum.strategies.slice_gradients import SliceGradients
from lightning_accum.token_batches import TokenBatchSampler, _cost, even_cut

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

    from lightning_accum.engine import AccumulationEngine
    from lightning_accum.ledger import AccumulationLedger
    from lightning_accum.strategies.trainer_side import TrainerSide

__all__ = ["BatchSlicer", "SliceHost"]


class SliceHost(Protocol):
    """What the slicer uses of the strategy that runs it: Lightning's public strategy members and the accumulation
    strategy's engine and ledger (what differs per engine is its ``TrainerSide``, handed to the slicer)."""

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
    @property
    def token_sampler(self) -> TokenBatchSampler | None: ...
    def no_backward_sync(self, enabled: bool = True) -> AbstractContextManager[Any]: ...
    def pre_backward(self, closure_loss: Tensor) -> None: ...
    def post_backward(self, closure_loss: Tensor) -> None: ...


@dataclass
class _Part:
    loss: Tensor | None
    weight: Count
    tokens: Any
    samples: Any
    documents: Any = None


@dataclass
class _Running:
    """The running loader batch: where its next slice starts (then the last slice's), the slices run, its output."""

    batch: Any
    num_samples: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    start: int = 0
    sizes: list[int] = field(default_factory=list)
    parts: list[_Part] = field(default_factory=list)
    retried: bool = False  # the last slice's forward ran out of memory: the strategy is told before it runs again
    output: Any = None
    lengths: Any = None  # under `token_batches=` and "auto": its rows' lengths (longest first), to cut by tokens
    padded: bool = True  # how they count (`TokenBatches.count`)

    def note_part(self, engine: AccumulationEngine, microbatch: Microbatch) -> None:
        loss = microbatch.loss.detach() if microbatch.loss is not None else None
        weight = engine.last_weight if loss is not None else 0
        samples = microbatch.samples if microbatch.reports_samples else None
        self.parts.append(_Part(loss, weight, microbatch.tokens, samples, microbatch.documents))


class _OutOfMemory(Exception):  # internal: a slice ran out of memory in its `phase` (the original error is chained)
    def __init__(self, phase: str) -> None:
        super().__init__(phase)
        self.phase = phase


class BatchSlicer:
    """The per-strategy state of ``microbatch_size=``: the option, this rank's :class:`SlicingLog`, the running batch
    and its slices' gradients (:class:`~lightning_accum.strategies.slice_gradients.SliceGradients`); ``side``: the
    strategy's (the slice count agreed over the ranks, a forward run again); ``normalize``: the run's option."""

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
        self.gradients = SliceGradients()
        self._running: _Running | None = None  # the batch whose last slice's backward Lightning calls next
        #: Whether loader batches are cut into slices (an attribute, read twice per micro-batch on the hot path).
        self.enabled = self.log.configured is not None

    @contextmanager
    def aside(self, enabled: bool) -> Iterator[None]:
        """A block run on another engine (``use_engine``): the run's record and running batch are kept aside, and
        slicing is off unless ``enabled``."""
        saved = (self.log, self.gradients, self._running, self.enabled)
        self.log = dataclasses.replace(self.log, slice_sizes=dict(self.log.slice_sizes), retries=list(self.log.retries))
        self.gradients, self._running = SliceGradients(), None
        self.enabled = self.enabled and enabled
        try:
            yield
        finally:
            self.log, self.gradients, self._running, self.enabled = saved

    @property
    def auto(self) -> bool:
        return self.log.configured == "auto"

    def reset(self) -> None:
        """Forget the run's parameters and any running batch (``setup`` / ``teardown``)."""
        self.gradients = SliceGradients()
        self._running = None

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
        ``forward``: the strategy's own ``training_step`` path, for the last slice; ``position``: the batch's in its
        group."""
        batch = args[0] if args else kwargs["batch"]
        running = _Running(batch, count_samples(batch, self.split_batch), args, kwargs)
        sampler = strategy.token_sampler if self.auto else None
        if sampler is not None and len(rows := sampler.rows(batch_idx)) == running.num_samples:
            running.lengths, running.padded = sampler.lengths[rows], sampler.count == "padded"
        # Lightning zeroes the gradient after the step of a group's first batch (its place in the epoch, and no
        # micro-batch in the open group yet: AccumulationCheck runs a group's batches without Lightning's loop).
        first_of_group = position == 0 and strategy.engine.microbatches_in_group == 0
        released = False
        ends = self._plan(strategy, running.num_samples)
        outputs: list[Any] = []
        while not outputs:
            stop = self._stop(ends, running)
            if stop == running.num_samples:
                outputs = self._last_slice(strategy, forward, running, batch_idx, accumulate)
                continue
            if first_of_group and not released:
                # The previous group's gradient is released now, the slices' kept aside until `install_pending`.
                released = True
                self.gradients.release(strategy.optimizers)
            self._local_step(strategy, running, stop, batch_idx, accumulate)
        output = outputs.pop()
        self._running = running
        if released:
            self.gradients.keep_aside(strategy.optimizers)
        self.log.note_slices(running.sizes)
        running.output = combined_output(running.parts, output)
        return running.output

    def _last_slice(
        self, strategy: SliceHost, forward: Callable[..., Any], running: _Running, batch_idx: int, accumulate: int
    ) -> list[Any]:
        """The last slice's forward, on the strategy's own path: ``[output]``, or ``[]`` after out of memory."""
        start, n = running.start, running.num_samples
        piece = self._cut(running.batch, start, n, n)
        args, kwargs = _with_batch(running.args, running.kwargs, piece)
        if running.retried:
            self.side.before_forward_retry()
        outputs: list[Any] = []
        if not self._attempt(
            strategy, running, n, batch_idx, lambda _: outputs.append(_forward(forward, args, kwargs, self.auto))
        ):
            running.retried = True
            return outputs
        microbatch = strategy.engine.read(outputs[-1], piece, num_samples=n - start)
        strategy.engine.record(microbatch, accumulate, continues=start > 0)
        running.note_part(strategy.engine, microbatch)
        running.sizes.append(n - start)
        return outputs

    def _local_step(self, strategy: SliceHost, running: _Running, stop: int, batch_idx: int, accumulate: int) -> None:
        """A slice up to ``stop``, forward and backward here; ``running`` moves past it once it ran."""
        start = running.start
        piece = self._cut(running.batch, start, stop, running.num_samples)
        args, kwargs = _with_batch(running.args, running.kwargs, piece)
        run = partial(self._local_slice, strategy, running, piece, args, kwargs, accumulate)
        if self._attempt(strategy, running, stop, batch_idx, run):
            running.sizes.append(stop - start)
            running.start = stop

    def _local_slice(
        self,
        strategy: SliceHost,
        running: _Running,
        piece: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        accumulate: int,
        size: int,
    ) -> None:
        """Forward and backward of one slice without gradient synchronisation; ``_OutOfMemory`` under ``"auto"``."""
        engine = strategy.engine
        module = strategy.lightning_module
        assert module is not None
        with strategy.no_backward_sync():
            with strategy.precision_plugin.train_step_context():
                output = _forward(module.training_step, args, kwargs, self.auto)
            microbatch = engine.read(output, piece, num_samples=size)
            del output
            tensor = engine.record(microbatch, accumulate, continues=running.start > 0)
            running.note_part(engine, microbatch)
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
            failed = self.gradients.protected(strategy.optimizers, backward)
            if failed is not None:
                engine.retract_microbatch()
                running.parts.pop()
                raise _OutOfMemory("backward") from failed
            # The group stays "backward running" (not carried by a checkpoint) until the batch's last backward: a
            # checkpoint written after an error in a later slice would otherwise carry part of a batch that Lightning
            # runs again on resume.

    def _attempt(
        self, strategy: SliceHost, running: _Running, stop: int, batch_idx: int, run: Callable[[int], None]
    ) -> bool:
        """``run(size)`` for the slice of ``running`` up to ``stop``; ``False`` when it ran out of memory under
        ``"auto"`` (then the size is halved, or a slice of one sample is an error)."""
        try:
            run(stop - running.start)
            return True
        except _OutOfMemory as failure:
            phase, cause = failure.phase, _released(failure)
        # Outside the `except` block: the attempt's frames are gone.
        self._shrink(strategy, running, stop, phase, batch_idx, cause)
        return False

    # ------------------------------------------------------------------ cutting

    def _plan(self, strategy: SliceHost, n: int) -> list[int] | None:
        """The slices' ends for a fixed ``microbatch_size``: the fewest slices of at most that many samples (the
        largest count any rank needs, where ranks must agree), as even as possible; ``None`` under ``"auto"``."""
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

    def _stop(self, ends: list[int] | None, running: _Running) -> int:
        """Where the next slice of ``running`` ends: at the plan's next end, or after the size in force (``"auto"``:
        by tokens, the first of the fewest even slices under it)."""
        if ends is not None:
            return ends[len(running.sizes)]
        start, size = running.start, self.log.size
        if running.lengths is not None and size is not None and self.log.unit == "tokens":
            return start + even_cut(running.lengths[start:], size, running.padded)[0][1]
        return min(start + self.log.limit(running.num_samples), running.num_samples)

    def _cut(self, batch: Any, start: int, stop: int, n: int) -> Any:
        if start == 0 and stop == n:
            return batch
        if self.split_batch is not None:
            return self.split_batch(batch, start, stop)
        return slice_batch(batch, start, stop, n)

    def _shrink(
        self, strategy: SliceHost, running: _Running, stop: int, phase: str, batch_idx: int, cause: BaseException | None
    ) -> None:
        """Slices of at most half the failed slice of ``running`` (up to ``stop``) from now on, in samples or, for
        rows cut by tokens, in tokens (a slice of one: an error); the retry recorded and warned."""
        free_memory(strategy.root_device)
        trainer, rows, lengths = _trainer(strategy), stop - running.start, running.lengths
        failed = rows if lengths is None else _cost(lengths[running.start : stop], running.padded)
        unit = "samples" if lengths is None else "tokens"
        retry = OutOfMemoryRetry(
            update=strategy.ledger.updates_attempted + 1,
            epoch=trainer.current_epoch,
            batch_idx=batch_idx,
            rank=_rank(strategy),
            phase=phase,
            failed_size=failed,
            new_size=max(1, failed // 2),
        )
        if rows <= 1:
            raise RuntimeError(
                f"Out of memory in the {phase} of a slice of 1 sample (rank {retry.rank}, batch {batch_idx} of epoch"
                f" {retry.epoch}; slice sizes run so far on this rank: {self.log.slice_sizes or 'none'}; retries:"
                f" {len(self.log.retries)}). `microbatch_size='auto'` cannot cut further: one sample does not fit in"
                " memory with this model. Lower the sequence length or the model's memory (activation checkpointing, a"
                " lower precision, sharding with strategy='accum_fsdp')."
            ) from cause
        self.log.size, self.log.unit = retry.new_size, unit
        self.log.retries.append(retry)
        strategy.engine.warn(
            f"lightning_accum: out of memory in the {phase} of a slice of {rows} sample(s) on rank {retry.rank}"
            f" (batch {batch_idx}, update {retry.update}); running it again as slices of {retry.new_size}"
            f"{' tokens' if unit == 'tokens' else ''} (microbatch_size='auto'; the group's update is unchanged)."
        )

    # ------------------------------------------------------------------ backward

    def install_pending(self) -> None:
        """Put the slices' gradients kept aside at a group's first batch back, after Lightning's ``zero_grad``."""
        self.gradients.install()

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
        running, self._running = self._running, None
        self.install_pending()
        if not self.auto or running is None:
            return default(tensor)
        size = running.num_samples - running.start
        if synchronised:
            return _synchronised_backward(partial(default, tensor), size, _rank(strategy))
        module = strategy.lightning_module
        assert module is not None
        # Lightning's `Strategy.backward`, with the backward itself protected.
        strategy.pre_backward(tensor)
        closure_loss = strategy.precision_plugin.pre_backward(tensor, module)
        failed = self.gradients.protected(
            strategy.optimizers,
            lambda: strategy.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs),
        )
        if failed is not None:
            # Lightning's closure still holds the step's loss, and with it the failed slice's graph and activations:
            # detached in place, they are released before the slice runs again, smaller.
            _release_graphs([tensor, closure_loss, lightning_loss, running.output])  # Lightning's loss / A too
            strategy.engine.retract_microbatch()
            running.parts = []
            batch_idx = _trainer(strategy).fit_loop.epoch_loop.batch_idx
            self._shrink(strategy, running, running.num_samples, "backward", batch_idx, failed)
            del failed
            self._run_local(strategy, running, batch_idx)
        closure_loss = strategy.precision_plugin.post_backward(closure_loss, module)
        strategy.post_backward(closure_loss)
        return closure_loss

    def _run_local(self, strategy: SliceHost, running: _Running, batch_idx: int) -> None:
        """The rest of a batch, from its last slice's start, as slices with their own backward (one replica)."""
        accumulate = _trainer(strategy).accumulate_grad_batches
        failed = running.num_samples - running.start
        running.sizes = []
        while running.start < running.num_samples:
            self._local_step(strategy, running, self._stop(None, running), batch_idx, accumulate)
        self.log.note_slices(running.sizes)
        self.log.slice_sizes[failed] -= 1  # the failed last slice was counted when its forward ran
        if not self.log.slice_sizes[failed]:
            del self.log.slice_sizes[failed]


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


def _forward(forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], auto: bool) -> Any:
    """``forward(*args, **kwargs)``; under ``"auto"`` its out-of-memory error as an ``_OutOfMemory``."""
    try:
        return forward(*args, **kwargs)
    except BaseException as error:
        if auto and is_out_of_memory(error):
            raise _OutOfMemory("forward") from error
        raise


def _released(failure: _OutOfMemory) -> BaseException | None:
    """The out-of-memory error behind ``failure``, both without their tracebacks (which hold the attempt's memory)."""
    cause = failure.__cause__
    failure.__traceback__ = None
    if cause is not None:
        cause.__traceback__ = None
        cause.__context__ = None
    return cause


def _release_graphs(values: Iterable[Any]) -> None:
    """Detach in place the tensors ``values`` hold at their top level (a loss, a step's output, e.g. its logits)."""
    for value in values:
        for tensor in value.values() if isinstance(value, Mapping) else [value]:
            if not isinstance(tensor, Tensor) or tensor.grad_fn is None:
                continue
            try:
                tensor.detach_()
            except RuntimeError:  # a view cannot be detached in place; its graph goes when Lightning drops it
                pass


def _synchronised_backward(backward: Callable[[], Tensor], size: int, rank: int) -> Tensor:
    """``backward()`` that synchronises over the replicas: it cannot run again, its out-of-memory error says why."""
    try:
        return backward()
    except BaseException as error:
        if not is_out_of_memory(error):
            raise
        raise RuntimeError(
            f"Out of memory in the backward that synchronises gradients over the replicas (the last slice,"
            f" {size} sample(s), of the group's last batch; rank {rank}). It cannot be run"
            " again: the other replicas are inside its all-reduce (the launcher stops them when this process"
            " exits). Resume from the last checkpoint with `microbatch_size="
            f"{max(1, size // 2)}` on the strategy (a fixed slice size), or free memory."
        ) from error


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
