"""The arithmetic of exact accumulation, independent of Lightning's loops.

Both strategies delegate to one :class:`AccumulationEngine`; tests drive it without a ``Trainer``.

The objective of update ``g`` is the weighted mean over every micro-batch ``i`` on every replica ``r``
of the group::

    L_g = Σ_{r,i} w_{r,i} · loss_{r,i} / W,        W = Σ_{r,i} w_{r,i}

where ``loss`` is the micro-batch's mean loss and ``w`` its count of units (supervised tokens, samples
or 1). ``W`` is only known when the group closes, and streaming data allows no look-ahead, so each
micro-batch back-propagates ``loss · w / c`` for a constant ``c`` and the group's gradient is
multiplied once by ``c · D / W`` when it closes (``D`` because DDP *averages* the replicas'
gradients)::

    (1/D) Σ_r Σ_i ∇(loss_{r,i} · w_{r,i} / c) · (c · D / W) = Σ_{r,i} w_{r,i} ∇loss_{r,i} / W

``c`` must be identical on every replica, since DDP averages before any per-replica correction could
act. It is the previous group's global unit count divided by ``D`` (an estimate of one replica's
group weight, so back-propagated magnitudes stay close to Lightning's ``loss / A`` and fp16 overflow
behaves as users expect), and for the first group ``A`` times the replicas' mean weight of their first
micro-batch (the only extra collective outside group closes, once per run).

All per-micro-batch work stays on the device: counts that arrive as tensors are accumulated as
tensors and checked (sign, agreement between replicas) only at the close, where one fused all-reduce
of a small float64 vector and one host read happen per update.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor

from lightning_accum.ledger import AccumulationLedger, GroupRecord
from lightning_accum.tokens import TokenWeightingWarning, token_weighting_hint

__all__ = [
    "NORMALIZE_CHOICES",
    "ON_NONFINITE_CHOICES",
    "PARTIAL_GROUP_CHOICES",
    "SCHEDULE_ON_CHOICES",
    "AccumulationEngine",
    "GroupOutcome",
    "infer_num_samples",
    "scale_gradients",
    "validate_choice",
]

NORMALIZE_CHOICES: tuple[str, ...] = ("auto", "tokens", "samples", "batches")
PARTIAL_GROUP_CHOICES: tuple[str, ...] = ("rescale", "drop")
SCHEDULE_ON_CHOICES: tuple[str, ...] = ("applied", "attempted")
ON_NONFINITE_CHOICES: tuple[str, ...] = ("skip", "raise", "ignore")

Count = int | Tensor
AllReduce = Callable[[Tensor], Tensor]
#: ``listener(record, batch_samples)``: see :meth:`AccumulationEngine.add_listener`.
GroupListener = Callable[[GroupRecord, Sequence[int]], None]

# Positions in the vector that is all-reduced (summed) once per group.
_UNITS, _WEIGHTED_LOSS, _TOKENS, _SAMPLES, _NEGATIVE, _SCALE_REF, _MICROBATCHES, _UNIT_CODE, _NONFINITE, _LAST = range(
    10
)
_VECTOR_SIZE = 10
# The additive positions a checkpoint written inside a group carries (the others are recomputed at the close).
_CARRIED = (_UNITS, _WEIGHTED_LOSS, _TOKENS, _SAMPLES, _NEGATIVE)
_UNIT_CODES = {"tokens": 1.0, "samples": 2.0, "batches": 3.0}


def validate_choice(argument: str, value: object, choices: Iterable[str]) -> str:
    """Return ``value`` if it is one of ``choices``, else raise a ``ValueError`` that lists them.

    Example:
        >>> validate_choice("partial_group", "drop", PARTIAL_GROUP_CHOICES)
        'drop'
        >>> validate_choice("partial_group", "keep", PARTIAL_GROUP_CHOICES)
        Traceback (most recent call last):
        ...
        ValueError: `partial_group` must be one of 'rescale', 'drop'; got 'keep'. Pass one of those values.
    """
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"`{argument}` must be one of {listed}; got {value!r}. Pass one of those values.")
    return value


def infer_num_samples(batch: Any) -> int | None:
    """The leading dimension shared by every tensor of ``batch``, or ``None`` when it is ambiguous or absent.

    Reads only tensor shapes, so it never synchronizes with the device.

    Example:
        >>> infer_num_samples({"input_ids": torch.zeros(4, 7), "labels": torch.zeros(4, 7)})
        4
        >>> infer_num_samples({"input_ids": torch.zeros(4, 7), "lengths": torch.zeros(3)}) is None
        True
    """
    # Fast path for the common flat batch (a dict, list or tuple of tensors): this runs on every micro-batch.
    kind = type(batch)
    flat = batch.values() if kind is dict else batch if kind is tuple or kind is list else None
    if flat is not None:
        sizes = {value.shape[0] for value in flat if type(value) is Tensor and value.ndim}
        if all(type(value) is Tensor for value in flat):
            return sizes.pop() if len(sizes) == 1 else None
    sizes = set()
    pending = [batch]
    while pending:  # iterative, for nested batches
        obj = pending.pop()
        if isinstance(obj, Tensor):
            if obj.ndim:
                sizes.add(obj.shape[0])
        elif isinstance(obj, (dict, Mapping)):
            pending.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            pending.extend(obj)
    return sizes.pop() if len(sizes) == 1 else None


def _as_count_slow(name: str, value: Tensor, device: torch.device) -> Tensor:
    """The checks and conversions of a count tensor that is not already a 0-d integer on ``device``."""
    if value.dtype == torch.bool:
        raise TypeError(
            f"`{name}` must be an integer count, got a boolean ({value!r}). "
            f"Return the number of units, e.g. `(labels != -100).sum()`."
        )
    if value.is_floating_point() or value.is_complex():
        raise TypeError(
            f"`{name}` must be an integer count, got a tensor of dtype {value.dtype}. "
            f"Return an integer tensor, e.g. `(labels != -100).sum()`, not a mean or a float."
        )
    if value.numel() != 1:
        raise ValueError(
            f"`{name}` must be a single count (a 0-d tensor or an int), got a tensor of shape "
            f"{tuple(value.shape)}. Sum it: `{name}=mask.sum()`."
        )
    if value.device.type == "meta":
        raise ValueError(
            f"`{name}` is a tensor on the meta device, which holds no value. Compute it from the micro-batch's"
            " real data, e.g. `(batch['labels'] != -100).sum()`."
        )
    # A count on another device than the loss (e.g. computed on the CPU before the batch moved) is copied to
    # the loss's device without blocking; nothing is read on the host until the group closes.
    return value.reshape(()).to(device, non_blocking=True)


def _as_count(name: str, value: object, device: torch.device) -> Count:
    """Validate a reported count without reading device memory; negatives in tensors are caught at the close."""
    if isinstance(value, Tensor):
        dtype = value.dtype
        if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool or value.ndim or value.device != device:
            value = _as_count_slow(name, value, device)
        return value
    if isinstance(value, bool):
        raise TypeError(
            f"`{name}` must be an integer count, got a boolean ({value!r}). "
            f"Return the number of units, e.g. `(labels != -100).sum()`."
        )
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"`{name}` must be >= 0, got {value}. Return the number of units in the micro-batch.")
        return value
    raise TypeError(
        f"`{name}` must be an int or a 0-d integer tensor, got {type(value).__name__} ({value!r}). "
        f"Return e.g. `(labels != -100).sum()`."
    )


def scale_gradients(parameters: Iterable[Tensor], factor: float) -> None:
    """Multiply every existing gradient in place by ``factor``, one fused kernel per device and dtype.

    Rounded once: half-precision gradients are multiplied in float32 by the float32 factor (torch's
    ``_foreach_mul_`` with a Python float rounds the factor to the gradient's dtype first on the CPU).

    Example:
        >>> p = torch.nn.Parameter(torch.ones(2)); p.grad = torch.tensor([1.0, 2.0])
        >>> scale_gradients([p], 0.5); p.grad
        tensor([0.5000, 1.0000])
    """
    for (device, dtype), grads in _by_kind(p.grad for p in parameters if p.grad is not None).items():
        if dtype in (torch.float16, torch.bfloat16):
            torch._foreach_mul_(grads, torch.tensor(factor, dtype=torch.float32, device=device))
        else:
            torch._foreach_mul_(grads, factor)


def _by_kind(tensors: Iterable[Tensor]) -> dict[tuple[torch.device, torch.dtype], list[Tensor]]:
    """``tensors`` grouped by device and dtype (one fused kernel each)."""
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    return groups


@dataclass
class GroupOutcome:
    """What to do with a closed group.

    Attributes:
        action: ``"apply"`` (scale the gradients by ``factor``, unless :attr:`scaled`, and update), ``"skip"``
            (an attempt that makes no update) or ``"drop"`` (a partial final group dropped by policy; not an
            attempt).
        factor: The multiplier ``c · D / W`` for the accumulated gradients (1.0 unless ``"apply"``).
        record: The group's record, to be completed and added to the ledger by
            :meth:`AccumulationEngine.finish_group`.
        scaled: Whether :meth:`AccumulationEngine.close_group` already multiplied the ``gradients`` it was given
            by ``factor`` (then the caller scales nothing; a group that is not applied holds no update, and the
            caller zeroes its gradients).
        batch_samples: The group's micro-batch sizes in samples on this replica, where known on the host
            (reported as ints or read from the batch's tensor shapes), in order; handed to the listeners.
    """

    action: Literal["apply", "skip", "drop"]
    factor: float
    record: GroupRecord
    scaled: bool = False
    batch_samples: list[int] = field(default_factory=list)


class _GroupSums:
    """What one group's micro-batches reported, kept as they arrived until the group closes.

    Nothing is computed per micro-batch: appending references costs no kernel launch, and the group's
    sums (units, Σ w·loss, tokens, samples, negative counts) are formed once, vectorized, in
    :meth:`local_vector`. Losses are detached (no graph is kept). The weights are the ``tokens`` or the
    ``samples`` list, whichever the unit is (every micro-batch with a loss reports it), or 1 each.
    """

    def __init__(self) -> None:
        self.microbatches = 0
        #: Host sums [units, Σ w·loss, tokens, samples, negatives] of micro-batches carried over from a checkpoint
        #: written inside this group (on one replica only; see :meth:`AccumulationEngine.resume_open_group`).
        self.carried: list[float] | None = None
        #: Micro-batches of this group that ran before a checkpoint but could not be carried over (lost).
        self.missing = 0
        self.losses: list[Tensor] = []
        self.tokens: list[Count] = []
        self.samples: list[Count] = []
        self.batch_samples: list[int] = []

    @staticmethod
    def _total(values: list[Count], device: torch.device) -> tuple[float, Tensor | None, Tensor | None]:
        """(sum of the ints, the tensors stacked as float64 on ``device``, count of negative tensors)."""
        host = float(sum(v for v in values if not isinstance(v, Tensor)))
        tensors = [v for v in values if isinstance(v, Tensor)]
        if not tensors:
            return host, None, None
        stacked = torch.stack(tensors).to(device=device, dtype=torch.float64)
        return host, stacked, (stacked < 0).sum(dtype=torch.float64)

    def local_vector(
        self, device: torch.device, unit: str | None, extra: dict[int, float], device_extra: dict[int, Tensor]
    ) -> Tensor:
        """This replica's contribution to the group's reduced vector.

        ``extra`` adds host values and ``device_extra`` device scalars by position. About a dozen tensor
        operations whatever the number of micro-batches.
        """
        host = [0.0] * _VECTOR_SIZE
        for index, value in extra.items():
            host[index] += value
        if self.carried is not None:
            for index, value in zip(_CARRIED, self.carried, strict=True):
                host[index] += value
        parts: list[tuple[int, Tensor]] = list(device_extra.items())
        stacked: dict[int, tuple[Tensor, Tensor]] = {}
        host_totals: dict[int, float] = {}
        for index, values in ((_TOKENS, self.tokens), (_SAMPLES, self.samples)):
            total, tensors, negatives = self._total(values, device)
            host[index] += total
            host_totals[index] = total
            if tensors is not None and negatives is not None:
                stacked[index] = (tensors, tensors.sum())
                parts += [(index, stacked[index][1]), (_NEGATIVE, negatives)]
        if self.losses:
            losses = torch.stack(self.losses).to(device=device, dtype=torch.float64)
            source = {"tokens": _TOKENS, "samples": _SAMPLES}.get(unit or "")
            if source is None:  # every micro-batch weighs 1
                host[_UNITS] += len(self.losses)
                parts.append((_WEIGHTED_LOSS, losses.sum()))
            else:
                values = self.tokens if source == _TOKENS else self.samples
                host[_UNITS] += host_totals[source]
                weights: Tensor | None = None
                if source in stacked:
                    weights, total_tensor = stacked[source]
                    parts.append((_UNITS, total_tensor))
                if weights is None or len(weights) != len(values):  # ints, or ints and tensors mixed: rare
                    weights = _as_float64_vector(values, device)
                # Σ w·loss in micro-batch order; where() keeps an empty micro-batch's NaN mean out.
                parts.append((_WEIGHTED_LOSS, torch.dot(torch.where(weights > 0, losses, 0.0), weights)))
        vector = torch.tensor(host, dtype=torch.float64, device=device)
        if parts:
            positions = tuple(index for index, _ in parts)
            vector.index_add_(0, _positions(positions, device), torch.stack([part for _, part in parts]))
        return vector


_POSITIONS: dict[tuple[tuple[int, ...], torch.device], Tensor] = {}


def _positions(positions: tuple[int, ...], device: torch.device) -> Tensor:
    """A cached index tensor (a group's layout repeats every update)."""
    key = (positions, device)
    cached = _POSITIONS.get(key)
    if cached is None:
        cached = _POSITIONS[key] = torch.tensor(positions, dtype=torch.int64, device=device)
    return cached


_ZEROS: dict[tuple[torch.device, torch.dtype], Tensor] = {}


def _zero(device: torch.device, dtype: torch.dtype) -> Tensor:
    """A cached 0-d zero of ``device`` and ``dtype`` (the addend of ``addcmul``)."""
    key = (device, dtype)
    cached = _ZEROS.get(key)
    if cached is None:
        cached = _ZEROS[key] = torch.zeros((), device=device, dtype=dtype)
    return cached


def _as_float64_vector(values: list[Count], device: torch.device) -> Tensor:
    if not any(isinstance(v, Tensor) for v in values):
        return torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    return torch.stack(
        [torch.as_tensor(v, device=device).to(torch.float64) for v in values]  # mixed ints and tensors: rare
    )


class AccumulationEngine:
    """Exact weighted accumulation over micro-batches and replicas, one group at a time.

    The strategies call :meth:`add_microbatch` after every ``training_step``, back-propagate the
    tensor it returns, call :meth:`close_group` after the last backward of a group and before
    unscaling, clipping and the optimizer, act on the returned :class:`GroupOutcome`, and report the
    result with :meth:`finish_group`.

    Args:
        normalize: The unit each micro-batch is weighted by: ``"tokens"``, ``"samples"``, ``"batches"``,
            or ``"auto"`` (tokens if the step reports them, else samples, else batches).
        count_tokens: Optional ``batch -> int | Tensor`` used when the step does not return
            ``num_tokens``.
        partial_group: ``"rescale"`` updates a partial final group with its real denominator;
            ``"drop"`` makes no update for it and records what it held.
        schedule_on: ``"applied"``: step-interval schedules advance once per applied update;
            ``"attempted"``: once per attempt (skipped ones included), as Lightning does.
        on_nonfinite: Without a GradScaler, what a non-finite group gradient does: ``"skip"`` the
            update (counted as ``"nonfinite"``), ``"raise"`` an error, or ``"ignore"`` it (update anyway).
        max_consecutive_skips: Stop the run with an error after this many consecutive skipped updates
            (whatever the reason), instead of spinning without progress; ``None`` never stops.

    Example:
        One replica, two micro-batches of the seed document: 512 supervised tokens with mean loss 2 and
        1,536 with mean loss 4. The group loss is the token-weighted 3.5, not the mean of means 3.0:

        >>> engine = AccumulationEngine(normalize="tokens")
        >>> for n, loss in [(512, 2.0), (1536, 4.0)]:
        ...     _ = engine.add_microbatch({"loss": torch.tensor(loss), "num_tokens": n}, batch=None, accumulate=2)
        >>> outcome = engine.close_group(accumulate=2)
        >>> outcome.action, outcome.record.loss, outcome.record.tokens
        ('apply', 3.5, 2048)
    """

    def __init__(
        self,
        normalize: str = "auto",
        count_tokens: Callable[[Any], Count] | None = None,
        partial_group: str = "rescale",
        schedule_on: str = "applied",
        on_nonfinite: str = "skip",
        max_consecutive_skips: int | None = 100,
    ) -> None:
        if max_consecutive_skips is not None and (
            isinstance(max_consecutive_skips, bool)
            or not isinstance(max_consecutive_skips, int)
            or max_consecutive_skips < 1
        ):
            raise ValueError(
                f"`max_consecutive_skips` must be a positive int or None, got {max_consecutive_skips!r}."
                " Pass e.g. `max_consecutive_skips=100`, or None to never stop."
            )
        self.max_consecutive_skips = max_consecutive_skips
        self.consecutive_skips = 0
        self.normalize = validate_choice("normalize", normalize, NORMALIZE_CHOICES)
        self.partial_group = validate_choice("partial_group", partial_group, PARTIAL_GROUP_CHOICES)
        self.schedule_on = validate_choice("schedule_on", schedule_on, SCHEDULE_ON_CHOICES)
        self.on_nonfinite = validate_choice("on_nonfinite", on_nonfinite, ON_NONFINITE_CHOICES)
        if count_tokens is not None and not callable(count_tokens):
            raise TypeError(
                f"`count_tokens` must be a callable `batch -> int | Tensor` or None, got "
                f"{type(count_tokens).__name__}. Pass e.g. `count_tokens=lambda b: (b['labels'] != -100).sum()`."
            )
        self.count_tokens = count_tokens
        self.ledger = AccumulationLedger()
        #: ``c`` of the module docstring, as a float once any group has closed.
        self.scale_ref: float | None = None
        self._group_ref: float | Tensor | None = None
        self._sums = _GroupSums()
        self._pending_backward: Tensor | None = None
        self._backward_running = False
        self._warned_partial = False
        self._listeners: list[GroupListener] = []

    # ------------------------------------------------------------------ micro-batches

    @property
    def unit(self) -> str | None:
        """The unit chosen for this run, once the first micro-batch decided it."""
        return self.ledger.normalization

    @property
    def microbatches_in_group(self) -> int:
        """Micro-batches of the open group on this replica."""
        return self._sums.microbatches

    def add_microbatch(
        self,
        output: Any,
        batch: Any,
        accumulate: int,
        all_reduce: AllReduce | None = None,
        replicas: int = 1,
    ) -> Tensor | None:
        """Record one micro-batch's ``training_step`` output and return the tensor to back-propagate.

        Args:
            output: What ``training_step`` returned: a loss tensor, a mapping with ``"loss"`` and
                optionally ``"num_tokens"`` / ``"num_samples"``, or ``None``.
            batch: The micro-batch (used for ``count_tokens`` and to infer the number of samples).
            accumulate: ``A``, the configured number of micro-batches per group.
            all_reduce: Sum-all-reduce over replicas, in place; ``None`` on one device.
            replicas: ``D``, the number of data-parallel replicas.

        Returns:
            ``loss · w / c``, or ``None`` when the step returned no loss.
        """
        sums = self._sums
        sums.microbatches += 1
        loss, tokens, samples = self._parse(output, batch)
        if loss is None:
            size = infer_num_samples(batch)
            if size is not None:
                sums.batch_samples.append(size)
            return None
        device = loss.device
        tokens_c = _as_count("num_tokens", tokens, device) if tokens is not None else None
        # A non-negative int (the common inferred case) needs no checks.
        samples_c = (
            samples
            if type(samples) is int and samples >= 0
            else _as_count("num_samples", samples, device)
            if samples is not None
            else None
        )
        # The micro-batch's number of samples as a host int when known without a device read (for the listeners).
        size = samples_c if type(samples_c) is int else infer_num_samples(batch)
        if size is not None:
            sums.batch_samples.append(size)
        unit = self.ledger.normalization or self._decide_unit(tokens_c is not None, samples_c is not None, batch)
        weight = (
            tokens_c
            if unit == "tokens" and tokens_c is not None
            else samples_c
            if unit == "samples" and samples_c is not None
            else self._weight(unit, tokens_c, samples_c)
        )

        sums.losses.append(loss.detach())
        if tokens_c is not None:
            sums.tokens.append(tokens_c)
        if samples_c is not None:
            sums.samples.append(samples_c)

        if self._group_ref is None:
            self._group_ref = self._first_scale_ref(weight, accumulate, device, all_reduce, replicas)
        ref = self._group_ref
        # w / c in float32 at least: a half-precision factor would round the weights by ~1e-3.
        if loss.dtype in (torch.float16, torch.bfloat16):
            loss = loss.float()
        if isinstance(ref, Tensor):  # the first group of the run: c is a device scalar
            backward = loss * (torch.as_tensor(weight, device=device) / ref).to(loss.dtype)
        elif isinstance(weight, Tensor):
            # One kernel, 0 + loss · w · (1/c): half the cost of forming w/c first (measured inside a fit).
            backward = torch.addcmul(_zero(device, loss.dtype), loss, weight, value=1.0 / ref)
        else:
            backward = loss * (weight / ref)
        self._pending_backward = backward
        return backward

    def take_backward_tensor(self) -> Tensor | None:
        """Hand over (and forget) the tensor to back-propagate for the last recorded micro-batch."""
        tensor, self._pending_backward = self._pending_backward, None
        self._backward_running = tensor is not None
        return tensor

    def backward_finished(self) -> None:
        """Note that the backward of the last recorded micro-batch completed (its gradient is accumulated)."""
        self._backward_running = False

    @property
    def group_consistent(self) -> bool:
        """Whether the open group's gradient holds exactly the recorded micro-batches.

        False between ``training_step`` and the end of its backward (a checkpoint written then, from an exception
        in a backward hook, cannot be carried: the gradient is missing or holds part of that micro-batch).
        """
        return self._pending_backward is None and not self._backward_running

    def _parse(self, output: Any, batch: Any) -> tuple[Tensor | None, object, object]:
        tokens: object = None
        samples: object = None
        if output is None:
            return None, None, None
        loss: object
        if isinstance(output, Tensor):
            loss = output
        elif type(output) is dict or isinstance(output, Mapping):
            loss = output.get("loss")
            tokens = output.get("num_tokens")
            samples = output.get("num_samples")
        else:
            raise TypeError(
                f"`training_step` must return a loss tensor or a dict with 'loss' (and optionally 'num_tokens',"
                f" 'num_samples'); got {type(output).__name__}."
            )
        if not isinstance(loss, Tensor):
            raise TypeError(
                f"`training_step` must return the micro-batch's mean loss as a tensor under 'loss', got "
                f"{type(loss).__name__}."
            )
        if loss.ndim and loss.numel() != 1:
            raise ValueError(
                f"`training_step` must return a scalar (mean) loss, got a tensor of shape {tuple(loss.shape)}. "
                f"Reduce it with `.mean()` over the micro-batch's units and report their count."
            )
        if tokens is None and self.count_tokens is not None:
            tokens = self.count_tokens(batch)
        if samples is None:
            samples = infer_num_samples(batch)
        return (loss.reshape(()) if loss.ndim else loss), tokens, samples

    def _decide_unit(self, has_tokens: bool, has_samples: bool, batch: Any = None) -> str:
        unit = self.normalize
        if unit == "auto":
            unit = "tokens" if has_tokens else "samples" if has_samples else "batches"
            reason = {
                "tokens": "the training step reports token counts",
                "samples": "no token count is reported; the number of samples is known",
                "batches": "neither token counts nor the number of samples are known",
            }[unit]
            rank_zero_info(f"lightning_accum: micro-batches are weighted by {unit} (normalize='auto': {reason}).")
            hint = token_weighting_hint(unit, batch)  # reads the device once, at the run's first micro-batch
            if hint is not None:
                rank_zero_warn(hint, category=TokenWeightingWarning)
        self.ledger.normalization = unit
        return unit

    def _weight(self, unit: str, tokens: Count | None, samples: Count | None) -> Count:
        if unit == "tokens":
            if tokens is None:
                raise ValueError(
                    "The run normalizes by tokens (`normalize="
                    f"{self.normalize!r}`) but this micro-batch reports no token count. Return "
                    "`{'loss': loss, 'num_tokens': (labels != ignore_index).sum()}` from `training_step`, "
                    "or pass `count_tokens=` to the strategy."
                )
            return tokens
        if unit == "samples":
            if samples is None:
                raise ValueError(
                    f"The run normalizes by samples (`normalize={self.normalize!r}`) but the number of samples of "
                    "this micro-batch cannot be inferred (no tensor, or tensors with different leading sizes). "
                    "Return `{'loss': loss, 'num_samples': n}` from `training_step`."
                )
            return samples
        return 1

    def _first_scale_ref(
        self, weight: Count, accumulate: int, device: torch.device, all_reduce: AllReduce | None, replicas: int
    ) -> float | Tensor:
        if self.scale_ref is not None:
            return self.scale_ref
        # First group of the run: A · (mean over replicas of the first micro-batch's weight), at least A.
        if all_reduce is None or replicas == 1:
            if isinstance(weight, Tensor):
                return accumulate * weight.to(torch.float64).clamp(min=1.0)
            return float(accumulate * max(weight, 1))
        shared = torch.as_tensor(weight, dtype=torch.float64, device=device).reshape(1).clone()
        all_reduce(shared)
        return accumulate * (shared[0] / replicas).clamp(min=1.0)

    # ------------------------------------------------------------------ group close

    def close_group(
        self,
        accumulate: int,
        device: torch.device | str = "cpu",
        all_reduce: AllReduce | None = None,
        replicas: int = 1,
        nonfinite: Tensor | None = None,
        describe_nonfinite: Callable[[], str] | None = None,
        ends_epoch: bool = False,
        gradients: Sequence[Tensor] | None = None,
        check_gradients: bool = False,
    ) -> GroupOutcome:
        """Reduce the group's sums over replicas (one all-reduce, one host read) and decide what to do.

        Args:
            accumulate: ``A``, the configured number of micro-batches per group.
            device: Where the reduced vector lives (the replica's device).
            all_reduce: Sum-all-reduce over replicas, in place; ``None`` on one device.
            replicas: ``D``.
            nonfinite: A device scalar that is not finite when the group's gradient holds a NaN or Inf, for callers
                that check the gradient themselves. Folded into the same all-reduce (a NaN or Inf on any replica
                makes the sum non-finite), so every replica takes the same decision.
            describe_nonfinite: Names the first offending parameter, for ``on_nonfinite="raise"``.
            ends_epoch: Whether this replica's data ends with this group. Replicas must agree: one whose data
                ended while others go on would leave them waiting in a collective forever.
            gradients: The group's accumulated gradients (what the strategies pass). They are multiplied in place
                by ``c · D / W`` on the device, before the host read, and the outcome says so (``scaled``); the
                caller zeroes them when the outcome is not ``"apply"``. Under DDP they are the gradients DDP has
                already averaged over replicas, identical on every replica.
            check_gradients: With ``gradients``: check them for NaN/Inf in the same pass as the rescale (the
                kernel GradScaler unscales with; checked before multiplying), for ``on_nonfinite`` "skip" and
                "raise". Every replica checks the same averaged gradient, so all take the same decision.

        Raises:
            ValueError: A reported count was negative (on every replica alike, so none of them hangs).
            RuntimeError: Replicas disagree on the number of micro-batches or on the unit; or the gradient
                is non-finite under ``on_nonfinite="raise"``.
        """
        sums = self._sums
        device = torch.device(device)
        k = sums.microbatches
        missing = sums.missing
        ref = self._group_ref if self._group_ref is not None else (self.scale_ref or 1.0)
        extra = {
            _MICROBATCHES: float(k),
            _UNIT_CODE: _UNIT_CODES.get(self.ledger.normalization or "", 0.0),
            _LAST: 1.0 if ends_epoch else 0.0,
        }
        device_extra: dict[int, Tensor] = {}
        if isinstance(ref, Tensor):
            device_extra[_SCALE_REF] = ref.to(device=device, dtype=torch.float64)
        else:
            extra[_SCALE_REF] = float(ref)
        if nonfinite is not None:
            device_extra[_NONFINITE] = nonfinite.to(device=device, dtype=torch.float64)
        vector = sums.local_vector(device, self.ledger.normalization, extra, device_extra)
        if all_reduce is not None and replicas > 1:
            all_reduce(vector)
        found: Tensor | None = None
        if gradients:
            # c · D / W on the device: the gradient is rescaled before anything is read on the host.
            found = self._rescale(gradients, vector[_SCALE_REF] / vector[_UNITS], check_gradients)
        values = (torch.cat((vector, found)) if found is not None else vector).tolist()  # the one host read

        self._sums = _GroupSums()
        self._group_ref = None
        units, weighted_loss = values[_UNITS], values[_WEIGHTED_LOSS]
        self._check_agreement(values, k, replicas, ends_epoch)
        if values[_NEGATIVE] > 0:
            raise ValueError(
                f"A negative `num_tokens` or `num_samples` was reported in this group ({int(values[_NEGATIVE])} "
                "micro-batch counts below zero over all replicas). Counts must be >= 0: return the number of "
                "supervised units, e.g. `(labels != -100).sum()`."
            )

        scale_ref_times_d = values[_SCALE_REF]
        record = GroupRecord(
            loss=weighted_loss / units if units > 0 else math.nan,
            tokens=round(values[_TOKENS]),
            samples=round(values[_SAMPLES]),
            microbatches=round(values[_MICROBATCHES]),
            applied=False,
        )
        # The next group's c: this group's global weight per replica (keep the old one after an empty group).
        self.scale_ref = units / replicas if units > 0 else scale_ref_times_d / replicas

        partial = k + missing < accumulate
        if partial:
            self.ledger.partial_groups += 1
            self._note_partial(k, accumulate)
            if self.partial_group == "drop":
                record.dropped = True
                return GroupOutcome("drop", 1.0, record, batch_samples=sums.batch_samples)
        if units <= 0:
            record.skip_reason = "empty"
            return GroupOutcome("skip", 1.0, record, batch_samples=sums.batch_samples)
        if not math.isfinite(values[_NONFINITE]) or sum(values[_VECTOR_SIZE:]) > 0:
            update = self.ledger.updates_attempted + 1
            where = describe_nonfinite() if describe_nonfinite is not None else "a parameter"
            if self.on_nonfinite == "raise":
                raise RuntimeError(
                    f"The gradient of update {update} is not finite (first non-finite gradient: {where}; group loss"
                    f" {record.loss}). Find the NaN/Inf source, or pass `on_nonfinite='skip'` to skip such updates."
                )
            rank_zero_warn(
                f"lightning_accum: skipped update {update}: its gradient is not finite (first non-finite gradient:"
                f" {where}). Parameters and optimizer state are unchanged (on_nonfinite='skip')."
            )
            record.skip_reason = "nonfinite"
            return GroupOutcome("skip", 1.0, record, batch_samples=sums.batch_samples)
        return GroupOutcome(
            "apply", scale_ref_times_d / units, record, scaled=bool(gradients), batch_samples=sums.batch_samples
        )

    def _rescale(self, gradients: Sequence[Tensor], factor: Tensor, check: bool) -> Tensor | None:
        """Multiply ``gradients`` in place by the device scalar ``factor``; with ``check``, also return a tensor
        whose sum is positive when a gradient held a NaN/Inf before the multiplication (no host read).

        One kernel per device and dtype: GradScaler's fused check-and-multiply for floating-point gradients up to
        32 bits (float32 arithmetic with the float32 factor, rounded once, as :func:`scale_gradients`), a multiply
        plus norms for float64.
        """
        flags: list[Tensor] = []
        for (device, dtype), grads in _by_kind(gradients).items():
            if dtype == torch.float64:
                if check:
                    norms = torch.stack(torch._foreach_norm(grads)).sum()
                    flags.append((~torch.isfinite(norms)).to(torch.float64).reshape(1))
                torch._foreach_mul_(grads, factor.to(device))
            elif check:
                flag = torch.zeros(1, dtype=torch.float32, device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, factor.to(device, torch.float32))
                flags.append(flag)
            else:
                torch._foreach_mul_(grads, factor.to(device, torch.float32))
        if not flags:
            return None
        return flags[0] if len(flags) == 1 else torch.cat([f.to(flags[0].device, torch.float64) for f in flags])

    def schedule_due(self, record: GroupRecord, frequency: int = 1) -> bool:
        """Whether a step-interval schedule of ``frequency`` advances after ``record`` (already in the ledger).

        Under ``schedule_on="applied"`` the schedule counts applied updates, under ``"attempted"`` attempts;
        it advances on every ``frequency``-th of them. A dropped group is neither.

        Example:
            >>> skipped = GroupRecord(1.0, tokens=9, samples=1, microbatches=1, applied=False, skip_reason="overflow")
            >>> for schedule_on in ("applied", "attempted"):
            ...     engine = AccumulationEngine(schedule_on=schedule_on)
            ...     engine.ledger.record(skipped)
            ...     print(schedule_on, engine.schedule_due(skipped))
            applied False
            attempted True
        """
        if record.dropped:
            return False
        if self.schedule_on == "applied":
            return record.applied and self.ledger.updates_applied % frequency == 0
        return self.ledger.updates_attempted % frequency == 0

    def finish_group(self, outcome: GroupOutcome, applied: bool, skip_reason: str | None = None) -> GroupRecord:
        """Complete the outcome's record after the optimizer ran (or did not) and add it to the ledger."""
        record = outcome.record
        record.applied = applied
        if not applied and record.skip_reason is None and not record.dropped:
            record.skip_reason = skip_reason
        self.ledger.record(record)
        if not record.dropped:
            self.consecutive_skips = 0 if applied else self.consecutive_skips + 1
        for listener in self._listeners:
            listener(record, outcome.batch_samples)
        if self.max_consecutive_skips is not None and self.consecutive_skips >= self.max_consecutive_skips:
            raise RuntimeError(
                f"{self.consecutive_skips} consecutive updates were skipped (the last for {record.skip_reason!r};"
                f" skipped so far: {self.ledger.updates_skipped}): the run makes no progress. Find the source of the"
                " NaN/Inf (or the empty groups), or raise `max_consecutive_skips=` on the strategy."
            )
        return record

    def add_listener(self, listener: GroupListener) -> None:
        """Call ``listener(record, batch_samples)`` after every group is added to the ledger (by
        :meth:`finish_group`): updates, skipped attempts and dropped groups alike (``record.dropped``).

        ``batch_samples`` are the group's micro-batch sizes known on the host (see :attr:`GroupOutcome.batch_samples`).
        This is how the callbacks act once per group without a hook on every micro-batch. Adding a listener twice
        has no effect.
        """
        if listener not in self._listeners:
            self._listeners.append(listener)

    def remove_listener(self, listener: GroupListener) -> None:
        """Stop calling ``listener`` (no effect if it was not added)."""
        if listener in self._listeners:
            self._listeners.remove(listener)

    def _check_agreement(self, values: list[float], k: int, replicas: int, ends_epoch: bool) -> None:
        ended = round(values[_LAST])
        if 0 < ended < replicas:
            raise RuntimeError(
                f"The training data of {ended} of {replicas} replicas ended with this accumulation group while the"
                f" others have more batches (this replica's data {'ended' if ends_epoch else 'goes on'}). Replicas"
                " must see the same number of batches per epoch, or the others would wait in a collective forever:"
                " shard the iterable dataset evenly (drop the remainder), or use a DistributedSampler."
            )
        if round(values[_MICROBATCHES]) != k * replicas:
            raise RuntimeError(
                f"Replicas closed an accumulation group with different numbers of micro-batches (this replica: {k},"
                f" all {replicas} replicas: {round(values[_MICROBATCHES])}). Every replica must see the same number of"
                " batches per epoch: use a DistributedSampler (Lightning adds one for map-style datasets) or make"
                " the iterable dataset yield equally many batches on every rank."
            )
        code = _UNIT_CODES.get(self.ledger.normalization or "", 0.0)
        if values[_UNIT_CODE] != code * replicas:
            raise RuntimeError(
                f"Replicas weight micro-batches by different units (this replica: {self.ledger.normalization!r}). "
                "Report `num_tokens` on every rank, or set `normalize=` explicitly on the strategy."
            )

    def _note_partial(self, k: int, accumulate: int) -> None:
        if self._warned_partial:
            return
        self._warned_partial = True
        what = (
            "updated with its real denominator (partial_group='rescale')"
            if self.partial_group == "rescale"
            else "dropped without an update; its examples are recorded in the ledger (partial_group='drop')"
        )
        rank_zero_info(
            f"lightning_accum: an epoch ended with a partial group of {k} of {accumulate} micro-batches; {what}."
        )

    def warn_short_epoch(self, batches_per_epoch: float, accumulate: int) -> None:
        """Warn (or raise under ``"drop"``) when an epoch holds fewer batches than one group."""
        if not math.isfinite(batches_per_epoch) or batches_per_epoch >= accumulate or batches_per_epoch <= 0:
            return
        if self.partial_group == "drop":
            raise ValueError(
                f"An epoch has {int(batches_per_epoch)} training batches but `accumulate_grad_batches={accumulate}`;"
                " with `partial_group='drop'` no update would ever happen. Lower `accumulate_grad_batches` to at most"
                f" {int(batches_per_epoch)}, or use `partial_group='rescale'`."
            )
        rank_zero_warn(
            f"An epoch has {int(batches_per_epoch)} training batches but `accumulate_grad_batches={accumulate}`: every"
            f" update uses a partial group of {int(batches_per_epoch)} micro-batches (normalized by its real"
            " denominator). Lower `accumulate_grad_batches` if that is not what you intended."
        )

    # ------------------------------------------------------------------ groups across a checkpoint

    def open_group_state(
        self, device: torch.device | str = "cpu", all_reduce: AllReduce | None = None, replicas: int = 1
    ) -> dict[str, Any]:
        """The open group's counters summed over replicas, for a checkpoint written inside a group.

        A collective under DDP (every replica must call it, as every replica takes part in writing a checkpoint);
        one host read. The gradient accumulated so far is saved by the strategy next to it.

        Returns:
            ``microbatches`` (per replica), ``sums`` (units, Σ w·loss, tokens, samples and negative counts over all
            replicas, floats), ``scale_ref`` (the group's ``c``, or ``None`` if no micro-batch reported a loss) and
            ``consistent`` (see :attr:`group_consistent`).
        """
        device = torch.device(device)
        vector = self._sums.local_vector(device, self.ledger.normalization, {}, {})
        if all_reduce is not None and replicas > 1:
            all_reduce(vector)
        values = vector.tolist()
        ref = self._group_ref
        return {
            "microbatches": self._sums.microbatches,
            "sums": [values[i] for i in _CARRIED],
            "scale_ref": float(ref) if ref is not None else None,
            # The first group of a run computes w / c with c as a float64 tensor: resumed, it must do the same.
            "scale_ref_is_tensor": isinstance(ref, Tensor),
            "consistent": self.group_consistent,
        }

    def resume_open_group(self, state: Mapping[str, Any], holds_sums: bool) -> None:
        """Reopen the group a checkpoint was written in, so that it closes exactly as if never interrupted.

        Args:
            state: What :meth:`open_group_state` returned when the checkpoint was written.
            holds_sums: Whether this replica carries the group's counters (exactly one replica does, like the
                one that carries the accumulated gradient; the all-reduce at the close adds them to the others').
        """
        sums = _GroupSums()
        sums.microbatches = int(state["microbatches"])
        if holds_sums:
            sums.carried = [float(v) for v in state["sums"]]
        self._sums = sums
        ref = state.get("scale_ref")
        if ref is None:
            self._group_ref = None
        elif state.get("scale_ref_is_tensor"):
            self._group_ref = torch.tensor(float(ref), dtype=torch.float64)  # a 0-d CPU tensor works on any device
        else:
            self._group_ref = float(ref)

    def discard_open_group(self) -> int:
        """Forget the open group (its gradient was discarded by ``zero_grad``); return its micro-batch count."""
        count = self._sums.microbatches
        self._sums = _GroupSums()
        self._group_ref = None
        return count

    def note_missing_microbatches(self, count: int) -> None:
        """The open group lost its first ``count`` micro-batches (a checkpoint that could not carry them).

        The group still counts as a full one (not a partial group, so ``partial_group="drop"`` does not drop
        the micro-batches that remain); the ledger counts only the micro-batches that reached the update.
        """
        self._sums.missing = count

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Plain-data state: the ledger and ``c``; loadable with ``torch.load(weights_only=True)``."""
        return {
            "ledger": self.ledger.state_dict(),
            "scale_ref": self.scale_ref,
            "consecutive_skips": self.consecutive_skips,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.ledger.load_state_dict(dict(state.get("ledger", {})))
        ref = state.get("scale_ref")
        self.scale_ref = float(ref) if ref is not None else None
        self.consecutive_skips = int(state.get("consecutive_skips", 0))
