"""The arithmetic of exact accumulation, independent of Lightning's loops.

Every accumulation strategy delegates to one :class:`AccumulationEngine`; tests drive it without a ``Trainer``.
It composes small parts: :mod:`~lightning_accum.microbatch` reads a micro-batch,
:mod:`~lightning_accum.group` keeps a group's sums, :mod:`~lightning_accum.decision` decides from the reduced
values, :mod:`~lightning_accum.gradients` holds the kernels, :mod:`~lightning_accum.ledger` the counters.

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
act, and constant within a group. Any such ``c`` is exact; it only sets the magnitude of what is
back-propagated, which matters under fp16 (a GradScaler skips the update when an intermediate gradient
overflows). Lightning back-propagates ``loss / A``; this engine back-propagates::

    loss · w / c  =  (loss / A) · (w / M),        c = A · M

so a micro-batch's magnitude is Lightning's times its weight relative to a reference weight ``M``:

* ``M`` is the largest mean micro-batch weight of any group closed so far in the run (``W_g`` over the
  group's micro-batches on all replicas), taken from the per-update all-reduce, hence identical on every
  replica and never lowered by a small group. A micro-batch no heavier than the heaviest group's mean
  back-propagates at most Lightning's magnitude, whatever the order of group sizes (the previous
  group's count alone, used before, let a 1-token group make the next full group's magnitudes 128 times
  Lightning's and overflow);
* on one device (nothing to agree on), ``M`` is also raised to the group's first micro-batch's weight,
  on the device (no host read), which covers a heavy group that comes before any heavy history;
* the run's first group under DDP has no history: ``M`` is the replicas' mean weight of their first
  micro-batch (one all-reduce, once per run).

A lighter micro-batch back-propagates less than Lightning's ``loss / A`` (by ``w / M``); that is its
share of the update, and GradScaler's scale covers the range.

A group known to hold one micro-batch on one replica (automatic optimization with ``A = 1``, the batch not cut
into slices: the caller says so with ``add_microbatch(sole=True)``) takes ``c = w``: the micro-batch
back-propagates its loss as it is, which is what Lightning back-propagates (``loss / 1``), and the factor
``c · D / W = w / w`` is exactly 1, so the close multiplies nothing (it only checks for NaN/Inf): one tensor
operation per micro-batch (the detached loss the close reads), two at the close (issue #20: at ``A = 1`` the
per-update cost is the whole cost). No other micro-batch can join such a group (an error); closed with another
``A`` it is a partial group with ``c = w``.

All per-micro-batch work stays on the device: counts that arrive as tensors are kept as tensors and checked
(sign, agreement between replicas) only at the close. On several replicas the close sums a small float64 vector
(one fused all-reduce) and reads it once. On one replica there is nothing to sum: the close reads the reported
device values as they are (one host read) and forms the group's sums on the host, exactly (Python integers for
counts, ``math.fsum`` for ``Σ w·loss``), with the fewest tensor operations: the factor ``c / W`` (on the device
only where a weight or ``c`` is), the rescale with its check, and one stack, or one fused copy per dtype, to read.

The engine imports nothing from Lightning: the strategies bind it to their replicas (:meth:`AccumulationEngine.bind`)
and route its messages (:attr:`AccumulationEngine.info`, :attr:`AccumulationEngine.warn`) to rank zero.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_accum.decision import GroupOutcome, check_agreement, classify
from lightning_accum.gradients import GradientsByKind, cached_scalar, rescale_gradients
from lightning_accum.group import COUNT_SPLIT, UNIT_CODES, VECTOR_SIZE, GroupSums, ReducedGroup, Slot, combine
from lightning_accum.ledger import AccumulationLedger, GroupRecord
from lightning_accum.microbatch import Count, as_count, choose_unit, infer_num_samples, parse_step_output, unit_weight
from lightning_accum.options import AccumulationOptions
from lightning_accum.tokens import TokenWeightingWarning, token_weighting_hint

__all__ = ["AccumulationEngine", "GroupListener", "GroupOutcome", "Replicas"]

#: ``listener(record, batch_samples)``: see :meth:`AccumulationEngine.add_listener`.
GroupListener = Callable[[GroupRecord, Sequence[int]], None]
ReduceSum = Callable[[Tensor], Tensor]

_log = logging.getLogger("lightning_accum")


def _warn(message: str, category: type[Warning] = UserWarning) -> None:
    warnings.warn(message, category, stacklevel=3)


@dataclass(frozen=True)
class Replicas:
    """The data-parallel replicas a group is summed over.

    Attributes:
        size: ``D``, the number of replicas that see different data and whose gradients are averaged.
        reduce_sum: Sum-all-reduce over those replicas, in place; ``None`` on one replica.
        check_sum: Sum-all-reduce, in place, of the gradient's NaN/Inf check over every rank that holds a different
            part of the gradient (the whole mesh when gradients are sharded); ``None`` when every rank checks the
            same gradient (one device, DDP).
    """

    size: int = 1
    reduce_sum: ReduceSum | None = None
    check_sum: ReduceSum | None = None

    def sum_(self, tensor: Tensor) -> Tensor:
        """Sum ``tensor`` over the replicas, in place (nothing to do on one)."""
        if self.reduce_sum is not None and self.size > 1:
            self.reduce_sum(tensor)
        return tensor


class AccumulationEngine:
    """Exact weighted accumulation over micro-batches and replicas, one group at a time.

    The strategies :meth:`bind` it to their device and replicas, call :meth:`add_microbatch` after every
    ``training_step``, back-propagate the tensor it returns, call :meth:`close_group` after the last backward of a
    group and before unscaling, clipping and the optimizer, act on the returned :class:`GroupOutcome`, and report
    the result with :meth:`finish_group`.

    Args:
        normalize: See :class:`~lightning_accum.options.AccumulationOptions` (as are the other arguments).
        count_tokens: ``batch -> int | Tensor``, used when the step does not return ``num_tokens``.
        partial_group: ``"rescale"`` or ``"drop"``.
        schedule_on: ``"applied"`` or ``"attempted"``.
        on_nonfinite: ``"skip"``, ``"raise"`` or ``"ignore"``.
        max_consecutive_skips: A positive int, or ``None``.

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
        self.options = AccumulationOptions(
            normalize=normalize,
            count_tokens=count_tokens,
            partial_group=partial_group,
            schedule_on=schedule_on,
            on_nonfinite=on_nonfinite,
            max_consecutive_skips=max_consecutive_skips,
        )
        self.ledger = AccumulationLedger()
        #: ``M`` of the module docstring (the reference micro-batch weight; ``c = A · M``), once a group with units
        #: has closed.
        self.scale_ref: float | None = None
        self.consecutive_skips = 0
        #: Where messages go (the strategies route them to rank zero through Lightning's utilities).
        self.info: Callable[[str], None] = _log.info
        self.warn: Callable[..., None] = _warn  # warn(message, category=UserWarning)
        self.device = torch.device("cpu")
        self.replicas = Replicas()
        self._group_ref: float | Tensor | None = None
        self._sums = GroupSums()
        self._pending_backward: Tensor | None = None
        #: The weight ``w`` of the micro-batch recorded last (its units; 1 for "batches").
        self.last_weight: Count = 0
        self._backward_running = False
        self._warned_partial = False
        self._warned_empty = False
        self._listeners: list[GroupListener] = []
        self._clean_flag: Tensor | None = None  # a NaN/Inf flag read as zero, for the next check to write into
        # What a close on one replica reads (`_read`): a float64 buffer and, for each run of items that share a dtype
        # and a device, its place and elements (the copies' destinations); by the buffer's device and the runs.
        self._read_buffers: dict[Any, tuple[Tensor, list[tuple[int, int, list[Tensor]]]]] = {}
        self._flag_view: tuple[Tensor, Tensor] | None = None  # (flag, its 0-d view) for that read

    # ------------------------------------------------------------------ options and binding

    normalize = property(lambda self: self.options.normalize, doc="See :class:`AccumulationOptions`.")
    count_tokens = property(lambda self: self.options.count_tokens, doc="See :class:`AccumulationOptions`.")
    partial_group = property(lambda self: self.options.partial_group, doc="See :class:`AccumulationOptions`.")
    schedule_on = property(lambda self: self.options.schedule_on, doc="See :class:`AccumulationOptions`.")
    on_nonfinite = property(lambda self: self.options.on_nonfinite, doc="See :class:`AccumulationOptions`.")
    max_consecutive_skips = property(
        lambda self: self.options.max_consecutive_skips, doc="See :class:`AccumulationOptions`."
    )

    def bind(
        self,
        device: torch.device | str = "cpu",
        replicas: Replicas | None = None,
        info: Callable[[str], None] | None = None,
        warn: Callable[..., None] | None = None,
    ) -> None:
        """Set the device the group's vector lives on, the replicas it is summed over, and where messages go."""
        self.device = torch.device(device)
        if replicas is not None:
            self.replicas = replicas
        if info is not None:
            self.info = info
        if warn is not None:
            self.warn = warn

    def scratch(self, on_nonfinite: str = "ignore") -> AccumulationEngine:
        """A fresh engine with the same options, binding, unit and ``c``, whose groups do not touch this ledger
        (for :class:`~lightning_accum.AccumulationCheck`)."""
        other = AccumulationEngine(
            normalize=self.normalize,
            count_tokens=self.count_tokens,
            partial_group=self.partial_group,
            schedule_on=self.schedule_on,
            on_nonfinite=on_nonfinite,
            max_consecutive_skips=None,
        )
        other.bind(self.device, self.replicas, self.info, self.warn)
        other.scale_ref = self.scale_ref
        other.ledger.normalization = self.ledger.normalization
        return other

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
        self, output: Any, batch: Any, accumulate: int, continues: bool = False, sole: bool = False
    ) -> Tensor | None:
        """Record one micro-batch's ``training_step`` output and return the tensor to back-propagate.

        Args:
            output: What ``training_step`` returned: a loss tensor, a mapping with ``"loss"`` and
                optionally ``"num_tokens"`` / ``"num_samples"``, or ``None``.
            batch: The micro-batch (used for ``count_tokens`` and to infer the number of samples).
            accumulate: ``A``, the configured number of micro-batches per group.
            continues: ``batch`` is a further slice of the micro-batch recorded last (``microbatch_size=``): it is
                weighted like any micro-batch (exact: a slice's weight is its own units), but the group's
                micro-batch count does not grow. :meth:`retract_microbatch` forgets the last call.
            sole: The caller knows that this micro-batch is its group's only one (automatic optimization with
                ``A = 1``, the batch not cut into slices). On one replica, with an empty open group, ``c = w``: the
                loss itself is returned and the close needs no multiplication (see the module docstring); ignored
                otherwise.

        Returns:
            ``loss · w / c`` (the loss itself for a sole micro-batch), or ``None`` when the step returned no loss.
        """
        if self._sums.sole:
            raise RuntimeError(
                "AccumulationEngine.add_microbatch: the open group holds a micro-batch recorded with `sole=True` (its"
                " group's only one, back-propagated with c = w), so no other micro-batch can join it. Close the group"
                " first (`close_group`), or record the first micro-batch with `sole=False`."
            )
        loss, tokens, samples = parse_step_output(output, batch, self.options.count_tokens)
        if loss is None:
            self._sums.add(None, None, None, infer_num_samples(batch), continues)
            return None
        device = loss.device
        tokens_c = as_count("num_tokens", tokens, device) if tokens is not None else None
        # A non-negative int (the common inferred case) needs no checks.
        samples_c = (
            samples
            if type(samples) is int and samples >= 0
            else as_count("num_samples", samples, device)
            if samples is not None
            else None
        )
        # The micro-batch's number of samples as a host int when known without a device read (for the listeners).
        size = samples_c if type(samples_c) is int else infer_num_samples(batch)
        # A step that reports `num_samples` itself chose samples: no hint that tokens were probably intended.
        reported = (type(output) is dict or isinstance(output, Mapping)) and output.get("num_samples") is not None
        unit = self.ledger.normalization or self._decide_unit(
            tokens_c is not None, samples_c is not None, None if reported else batch
        )
        weight = (
            tokens_c
            if unit == "tokens" and tokens_c is not None
            else samples_c
            if unit == "samples" and samples_c is not None
            else unit_weight(unit, self.options.normalize, tokens_c, samples_c)
        )
        sums = self._sums
        if sole and not continues and not sums.microbatches and self._reads_here() and sums.carried_nothing:
            sums.add(loss, tokens_c, samples_c, size)
            sums.sole = True
            self.last_weight = weight
            # c = w: what the general close uses too, should this group close with another `accumulate`.
            self._group_ref = weight if isinstance(weight, Tensor) else float(weight)
            self._pending_backward = loss
            return loss
        sums.add(loss, tokens_c, samples_c, size, continues)
        self.last_weight = weight

        if self._group_ref is None:
            self._group_ref = self._group_scale(weight, accumulate, device)
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

    def _reads_here(self) -> bool:
        """Whether a group's values are read on this replica as they are (one replica, nothing to sum or check)."""
        replicas = self.replicas
        return (replicas.reduce_sum is None or replicas.size == 1) and replicas.check_sum is None

    def retract_microbatch(self) -> None:
        """Forget the micro-batch (or slice) :meth:`add_microbatch` recorded last, whose backward did not complete
        (out of memory): it is recorded again when it runs again. ``c`` of the group stays as it is (any ``c`` that
        is constant within the group is exact); after a sole micro-batch (``c = w`` of that one) it is formed again."""
        sole = self._sums.sole
        self._sums.retract()
        if sole:
            self._group_ref = None
        self._pending_backward = None
        self._backward_running = False

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

    def _decide_unit(self, has_tokens: bool, has_samples: bool, batch: Any = None) -> str:
        unit, reason = choose_unit(self.options.normalize, has_tokens, has_samples)
        if reason is not None:
            self.info(f"lightning_accum: micro-batches are weighted by {unit} (normalize='auto': {reason}).")
            hint = token_weighting_hint(unit, batch) if batch is not None else None  # one device read, once a run
            if hint is not None:
                self.warn(hint, category=TokenWeightingWarning)
        self.ledger.normalization = unit
        return unit

    def _group_scale(self, weight: Count, accumulate: int, device: torch.device) -> float | Tensor:
        """``c = A · M`` for the group the micro-batch of ``weight`` opens (see the module docstring)."""
        reference = self.scale_ref
        one_replica = self.replicas.size == 1 or self.replicas.reduce_sum is None
        if one_replica:
            floor = 1.0 if reference is None else reference
            if isinstance(weight, Tensor):  # max(w, M) on the device: no host read
                return accumulate * weight.to(torch.float64).clamp(min=floor)
            return float(accumulate * max(weight, floor))
        if reference is not None:
            return float(accumulate * reference)
        # The run's first group on several replicas: the mean over replicas of the first micro-batch's weight.
        shared = torch.as_tensor(weight, dtype=torch.float64, device=device).reshape(1).clone()
        self.replicas.sum_(shared)
        return accumulate * (shared[0] / self.replicas.size).clamp(min=1.0)

    # ------------------------------------------------------------------ group close

    def close_group(
        self,
        accumulate: int,
        ends_epoch: bool = False,
        gradients: Sequence[Tensor] | GradientsByKind | None = None,
        check_gradients: bool = False,
        describe_nonfinite: Callable[[], str] | None = None,
    ) -> GroupOutcome:
        """Reduce the group's sums over replicas (one all-reduce, one host read) and decide what to do.

        Args:
            accumulate: ``A``, the configured number of micro-batches per group.
            ends_epoch: Whether this replica's data ends with this group. Replicas must agree: one whose data
                ended while others go on would leave them waiting in a collective forever.
            gradients: The group's accumulated gradients (what the strategies pass). They are multiplied in place
                by ``c · D / W`` on the device, before the host read, and the outcome says so (``scaled``); the
                caller zeroes them when the outcome is not ``"apply"``. Under DDP they are the gradients DDP has
                already averaged over replicas, identical on every replica. A flat sequence, or a mapping by device
                and dtype (:data:`~lightning_accum.gradients.GradientsByKind`, as the strategies keep it per run).
            check_gradients: With ``gradients``: check them for NaN/Inf in the same pass as the rescale (the
                kernel GradScaler unscales with; checked before multiplying), for ``on_nonfinite`` "skip" and
                "raise". Every replica checks the same averaged gradient, so all take the same decision.
            describe_nonfinite: Names the first offending parameter, for ``on_nonfinite="raise"``.

        Raises:
            ValueError: A reported count was negative (on every replica alike, so none of them hangs).
            RuntimeError: Replicas disagree on the number of micro-batches or on the unit; or the gradient
                is non-finite under ``on_nonfinite="raise"``.
        """
        sums, unit = self._sums, self.ledger.normalization
        if self._reads_here():
            # One replica: nothing to sum over replicas. The device values are read as they are, the sums are formed
            # on the host (see `_close_here`).
            return self._close_here(sums, unit, accumulate, ends_epoch, gradients, check_gradients, describe_nonfinite)
        k = sums.microbatches
        ref = self._group_ref if self._group_ref is not None else accumulate * (self.scale_ref or 1.0)
        extra = {
            Slot.MICROBATCHES: float(k),
            Slot.UNIT_CODE: UNIT_CODES.get(unit or "", 0.0),
            Slot.LAST: 1.0 if ends_epoch else 0.0,
        }
        device_extra: Mapping[Slot, Tensor] = _NO_DEVICE_VALUES
        if isinstance(ref, Tensor):
            device_extra = {Slot.SCALE_REF: ref}
        else:
            extra[Slot.SCALE_REF] = float(ref)
        device = self.device
        host, positions, source = sums.parts(device, unit, extra, device_extra)
        vector = self.replicas.sum_(combine(host, positions, source, device))
        found: Tensor | None = None
        if gradients:
            # c · D / W on the device: the gradient is rescaled before anything is read on the host.
            found = rescale_gradients(gradients, vector[_SCALE_REF] / vector[_UNITS], check_gradients)
            if found is not None and self.replicas.check_sum is not None:
                # Sharded gradients: each rank checked its own shard; every rank must take the same decision.
                found = self.replicas.check_sum(found.to(torch.float64).sum().reshape(1))
        values = (torch.cat((vector, found)) if found is not None else vector).tolist()  # the one host read
        reduced = ReducedGroup.from_values(values)
        nonfinite = found is not None and sum(values[VECTOR_SIZE:]) > 0
        return self._decide(sums, reduced, accumulate, ends_epoch, nonfinite, bool(gradients), describe_nonfinite)

    def _close_here(
        self,
        sums: GroupSums,
        unit: str | None,
        accumulate: int,
        ends_epoch: bool,
        gradients: Sequence[Tensor] | GradientsByKind | None,
        check: bool,
        describe_nonfinite: Callable[[], str] | None,
    ) -> GroupOutcome:
        """:meth:`close_group` on one replica: the device values (losses, counts reported as tensors, ``c`` where it
        is a device scalar, the NaN/Inf flag) are read as they are, in one host read, and the group's sums are formed
        on the host: counts as Python integers, ``Σ w·loss`` as the correctly rounded float64 sum (``math.fsum``) of
        the products that several replicas sum on the device (in the device's order, which may round the last bit
        differently).

        Only the factor ``c / W`` is formed on the device, where a weight or ``c`` is a device value (the gradient
        is rescaled before the read); with ``c`` and the weights on the host it is a float. A sole micro-batch
        (``c = w = W``, see :meth:`add_microbatch`) has the factor exactly 1: nothing is multiplied, and the check,
        where it runs, runs alone. The read is :meth:`_read`. Issue #20: formed on the device, the sums took a dozen
        small tensor operations per close, each tens of microseconds right after a model's backward.
        """
        losses = sums.losses
        weights = sums.tokens if unit == "tokens" else sums.samples if unit == "samples" else None
        carried = sums.carried
        ref = self._group_ref if self._group_ref is not None else accumulate * (self.scale_ref or 1.0)
        ref_read = isinstance(ref, Tensor) and not sums.sole
        found: Tensor | None = None
        # A sole micro-batch (c = w = W) has nothing to multiply: only the check, where one runs, reads its gradient.
        if gradients and (check or not sums.sole):
            factor: float | Tensor = 1.0
            if not sums.sole:
                host_units = carried.get(Slot.UNITS, 0.0)
                device_units: list[Tensor] = []
                if weights is None:
                    host_units += len(losses)
                else:
                    for w in weights:
                        if isinstance(w, Tensor):
                            device_units.append(w)
                        else:
                            host_units += w
                # c / W in one float64 division, both operands on the device where either is (as the vector of
                # several replicas divides): a Python float beside a tensor would be multiplied by its reciprocal
                # (two roundings; torch does so for `float / tensor`, and CUDA for `tensor / float`).
                if device_units:
                    units_here: Tensor = (
                        device_units[0].to(torch.float64)
                        if len(device_units) == 1
                        else torch.stack(device_units).sum(dtype=torch.float64)
                    )
                    total = units_here + host_units if host_units else units_here
                    c = ref if isinstance(ref, Tensor) else cached_scalar(float(ref), total.device, torch.float64)
                    factor = c / total
                elif isinstance(ref, Tensor):
                    factor = ref / cached_scalar(float(host_units), ref.device, torch.float64)
                else:
                    factor = ref / host_units if host_units != 0 else math.inf  # as c / 0 on the device
            flag = self._clean_flag
            self._clean_flag = None  # kept again below once read as zero
            found = rescale_gradients(gradients, factor, check, flag)
        # The device values to read: the losses, the flag (a float32 loss and flag make one run of one dtype, see
        # `_read`), c where it is a device scalar, the counts reported as tensors.
        items = list(losses)
        own_flag = False
        if found is not None:
            if found.numel() == 1:
                own_flag = True
                view = self._flag_view
                if view is None or view[0] is not found:  # the flag as a 0-d tensor, kept with the reused flag
                    view = self._flag_view = (found, found.view(()))
                items.append(view[1])
            else:  # several kinds of gradient: rare
                items.append(found.to(torch.float64).sum())
        if ref_read:
            items.append(ref)  # type: ignore[arg-type]
        items += [count for count in (*sums.tokens, *sums.samples) if isinstance(count, Tensor)]
        values = self._read(items)

        # The sums, from the host values and the device values read (in the order of `items`).
        position = len(losses)
        nonfinite = found is not None and values[position] > 0
        position += found is not None
        scale_ref = 0.0
        if ref_read:
            scale_ref = values[position]
            position += 1
        if own_flag and not nonfinite:
            self._clean_flag = found  # still zero: the next check writes into it (no new tensor)
        negative = 0
        totals = [0, 0]
        unit_weights: list[int] = []
        for which, counts in enumerate((sums.tokens, sums.samples)):
            if not counts:
                continue
            if position == len(values):  # no count tensor left to read: host ints, checked (>= 0) when reported
                totals[which] = sum(counts)  # type: ignore[arg-type]
                if counts is weights:
                    unit_weights = counts  # type: ignore[assignment]
                continue
            exact: list[int] = []
            for count in counts:
                if isinstance(count, Tensor):
                    value = values[position]
                    position += 1
                    # A count beyond float64's integers is read again, exactly: a second read, never seen in practice.
                    count = int(value) if -_EXACT_FLOATS < value < _EXACT_FLOATS else int(count.item())
                exact.append(count)
                negative += count < 0
            totals[which] = sum(exact)
            if counts is weights:
                unit_weights = exact
        loss_values = values[: len(losses)]
        if weights is None:  # every micro-batch weighs 1
            products = loss_values
            units = float(len(losses))
        else:  # an empty micro-batch (w = 0, a NaN mean) is left out, as where(w > 0) leaves it out on the device
            products = [w * loss for w, loss in zip(unit_weights, loss_values, strict=True) if w > 0]
            units = float(sum(unit_weights))
        if sums.sole:
            scale_ref = units  # c = w
        elif not ref_read:
            scale_ref = float(ref)  # type: ignore[arg-type]
        microbatches = sums.microbatches
        if carried:  # what a checkpoint written inside this group carried (on this, the only, replica)
            base = [0.0] * VECTOR_SIZE
            for slot, value in carried.items():
                base[slot] += value
            negative += round(base[Slot.NEGATIVE])
            totals[0] += int(base[Slot.TOKENS_HI]) * COUNT_SPLIT + int(base[Slot.TOKENS_LO])
            totals[1] += int(base[Slot.SAMPLES_HI]) * COUNT_SPLIT + int(base[Slot.SAMPLES_LO])
            products = [*products, base[Slot.WEIGHTED_LOSS]]
            units += base[Slot.UNITS]
            microbatches += round(base[Slot.MICROBATCHES])
        weighted = _sum_exactly_rounded(products)
        reduced = ReducedGroup(
            units=units,
            weighted_loss=weighted,
            tokens=totals[0],
            samples=totals[1],
            negative=negative,
            scale_ref_times_d=scale_ref,
            microbatches=microbatches,
            unit_code=UNIT_CODES.get(unit or "", 0.0),
            ended=int(ends_epoch),
        )
        return self._decide(sums, reduced, accumulate, ends_epoch, nonfinite, bool(gradients), describe_nonfinite)

    def _read(self, items: list[Tensor]) -> list[float]:
        """The values of the 0-d tensors ``items`` as float64 values, in one host read.

        One stack where they share one floating dtype and device (a float32 loss and flag): read as they are, each
        value exact as a float. Else they are copied into the elements of a float64 buffer kept for the run, on the
        first item's device (the losses'), exact for losses of any floating dtype and for counts below 2^53: one
        ``torch._foreach_copy_`` per run of items that share a dtype and a device, the form a GPU fuses into one
        kernel (a list of mixed dtypes is copied tensor by tensor there). Issue #20: right after a model's backward
        a ``stack`` that converts dtypes costs twice these copies (53 against 25 µs on this CPU).
        """
        if not items:
            return []
        first = items[0]
        device, dtype = first.device, first.dtype
        if dtype.is_floating_point and all(item.dtype is dtype and item.device == device for item in items):
            return torch.stack(items).tolist()  # type: ignore[no-any-return]
        # Runs of items that share a dtype and a device: (end, dtype, device), in order.
        runs: list[tuple[int, torch.dtype, torch.device]] = []
        for index, item in enumerate(items):
            if item.dtype is not dtype or item.device != device:
                runs.append((index, dtype, device))
                dtype, device = item.dtype, item.device
        runs.append((len(items), dtype, device))
        key = (first.device, tuple(runs))
        kept = self._read_buffers.get(key)
        if kept is None:
            if len(self._read_buffers) >= 64:  # layouts that vary (sliced batches' counts): kept few
                self._read_buffers.clear()
            buffer = torch.empty(len(items), dtype=torch.float64, device=first.device)
            elements = buffer.unbind()
            starts = [0] + [end for end, _, _ in runs[:-1]]
            kept = self._read_buffers[key] = (
                buffer,
                [(start, end, list(elements[start:end])) for start, (end, _, _) in zip(starts, runs, strict=True)],
            )
        buffer, copies = kept
        for start, end, destinations in copies:
            torch._foreach_copy_(destinations, items[start:end])
        return buffer.tolist()  # type: ignore[no-any-return]

    def _decide(
        self,
        sums: GroupSums,
        reduced: ReducedGroup,
        accumulate: int,
        ends_epoch: bool,
        nonfinite: bool,
        scaled: bool,
        describe_nonfinite: Callable[[], str] | None,
    ) -> GroupOutcome:
        """The group's record and decision from its reduced values (every close ends here); opens a new group."""
        self._sums = GroupSums()
        self._group_ref = None
        k, unit = sums.microbatches, self.ledger.normalization
        carried = sums.carried_microbatches  # known alike on every replica (from the checkpoint)
        checked = dataclasses.replace(reduced, microbatches=reduced.microbatches - carried) if carried else reduced
        check_agreement(checked, k, self.replicas.size, ends_epoch, unit)
        units = reduced.units
        record = GroupRecord(
            loss=reduced.weighted_loss / units if units > 0 else math.nan,
            tokens=reduced.tokens,
            samples=reduced.samples,
            microbatches=reduced.microbatches,
            applied=False,
        )
        # M for the next groups: never lowered, raised by a group whose mean micro-batch weight is larger.
        if units > 0 and reduced.microbatches > 0:
            mean_weight = units / reduced.microbatches
            self.scale_ref = mean_weight if self.scale_ref is None else max(self.scale_ref, mean_weight)

        partial = k + sums.missing < accumulate
        if partial:
            self.ledger.partial_groups += 1
            self._note_partial(k, accumulate)
        action, reason = classify(reduced, partial, self.options.partial_group, nonfinite)
        record.dropped = action == "drop"
        record.skip_reason = reason
        if reason == "empty":
            self._note_empty()
        elif reason == "nonfinite":
            self._note_nonfinite(record, describe_nonfinite)
        factor = reduced.scale_ref_times_d / units if action == "apply" else 1.0
        return GroupOutcome(action, factor, record, scaled=scaled, batch_samples=sums.batch_samples)

    def _note_nonfinite(self, record: GroupRecord, describe_nonfinite: Callable[[], str] | None) -> None:
        update = self.ledger.updates_attempted + 1
        where = describe_nonfinite() if describe_nonfinite is not None else "a parameter"
        if self.options.on_nonfinite == "raise":
            raise RuntimeError(
                f"The gradient of update {update} is not finite (first non-finite gradient: {where}; group loss"
                f" {record.loss}). Find the NaN/Inf source, or pass `on_nonfinite='skip'` to skip such updates."
            )
        self.warn(
            f"lightning_accum: skipped update {update}: its gradient is not finite (first non-finite gradient:"
            f" {where}). Parameters and optimizer state are unchanged (on_nonfinite='skip')."
        )

    def _note_empty(self) -> None:
        if self._warned_empty:
            return
        self._warned_empty = True
        self.warn(
            f"lightning_accum: update {self.ledger.updates_attempted + 1} is skipped: its group holds no"
            f" {self.ledger.normalization or 'unit'} at all (every micro-batch on every replica reported 0). Likely"
            " causes: every label of these micro-batches is ignored (`ignore_index`), or `num_tokens` is computed"
            " on the wrong tensor (e.g. the input ids' padding instead of the labels). Such updates are counted in"
            " `ledger.updates_skipped['empty']`; this is said once."
        )

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
        if self.options.schedule_on == "applied":
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
        limit = self.options.max_consecutive_skips
        if limit is not None and self.consecutive_skips >= limit:
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

    def _note_partial(self, k: int, accumulate: int) -> None:
        if self._warned_partial:
            return
        self._warned_partial = True
        what = (
            "updated with its real denominator (partial_group='rescale')"
            if self.options.partial_group == "rescale"
            else "dropped without an update; its examples are recorded in the ledger (partial_group='drop')"
        )
        self.info(f"lightning_accum: an epoch ended with a partial group of {k} of {accumulate} micro-batches; {what}.")

    def warn_short_epoch(self, batches_per_epoch: float, accumulate: int) -> None:
        """Warn (or raise under ``"drop"``) when an epoch holds fewer batches than one group."""
        if not math.isfinite(batches_per_epoch) or batches_per_epoch >= accumulate or batches_per_epoch <= 0:
            return
        if self.options.partial_group == "drop":
            raise ValueError(
                f"An epoch has {int(batches_per_epoch)} training batches but `accumulate_grad_batches={accumulate}`;"
                " with `partial_group='drop'` no update would ever happen. Lower `accumulate_grad_batches` to at most"
                f" {int(batches_per_epoch)}, or use `partial_group='rescale'`."
            )
        self.warn(
            f"An epoch has {int(batches_per_epoch)} training batches but `accumulate_grad_batches={accumulate}`: every"
            f" update uses a partial group of {int(batches_per_epoch)} micro-batches (normalized by its real"
            " denominator). Lower `accumulate_grad_batches` if that is not what you intended."
        )

    # ------------------------------------------------------------------ groups across a checkpoint

    def open_group_state(self) -> dict[str, Any]:
        """The open group's counters summed over replicas, for a checkpoint written inside a group.

        A collective with several replicas (every replica must call it, as every replica takes part in writing a
        checkpoint); one host read. The gradient accumulated so far is saved by the strategy next to it.

        Returns:
            ``microbatches`` (per replica), ``sums`` (the carried sums over all replicas by name: units, Σ w·loss,
            the count parts and negative counts, floats), ``scale_ref`` (the group's ``c``, or ``None`` if no
            micro-batch reported a loss) and ``consistent`` (see :attr:`group_consistent`).
        """
        vector = self.replicas.sum_(self._sums.local_vector(self.device, self.ledger.normalization, {}, {}))
        ref = self._group_ref
        return {
            "microbatches": self._sums.microbatches,
            "sums": GroupSums.carry_state(vector.tolist()),
            "scale_ref": float(ref) if ref is not None else None,
            # The first group of a run computes w / c with c as a float64 tensor: resumed, it must do the same.
            "scale_ref_is_tensor": isinstance(ref, Tensor),
            "consistent": self.group_consistent,
        }

    def resume_open_group(
        self, state: Mapping[str, Any], holds_sums: bool, position: int | None = None, total: int | None = None
    ) -> None:
        """Reopen the group a checkpoint was written in, so that it closes exactly as if never interrupted.

        Args:
            state: What :meth:`open_group_state` returned when the checkpoint was written.
            holds_sums: Whether this replica carries the group's counters (exactly one replica does, like the
                one that carries the accumulated gradient; the all-reduce at the close adds them to the others').
            position: Where the resumed run stands in Lightning's grouping now (micro-batches of the group it does
                not run again). Given, the carried micro-batches are counted as ``total`` wherever they fall (another
                ``A`` or world size than when written), and the group is full when it reaches ``A`` places.
            total: The carried micro-batches over all replicas of the run that wrote the checkpoint.
        """
        microbatches = int(state["microbatches"])
        if position is None:
            if holds_sums:
                self._sums = GroupSums.from_carried(microbatches, state["sums"])
            else:
                self._sums = GroupSums()
                self._sums.microbatches = microbatches
        else:
            # Regrouped: the carried micro-batches count as `total` (all replicas of the written run), and the
            # group's first `position` places (Lightning's grouping now) as present, whatever the grouping then.
            carried_total = int(total if total is not None else microbatches * self.replicas.size)
            self._sums = GroupSums.from_carried(0, state["sums"]) if holds_sums else GroupSums()
            self._sums.missing = position
            self._sums.carried_microbatches = carried_total
            if holds_sums:
                self._sums.carried[Slot.MICROBATCHES] = float(carried_total)
        ref = state.get("scale_ref")
        if ref is None:
            self._group_ref = None
        elif state.get("scale_ref_is_tensor"):
            self._group_ref = torch.tensor(float(ref), dtype=torch.float64)  # a 0-d CPU tensor works on any device
        else:
            self._group_ref = float(ref)

    @property
    def carried_microbatches(self) -> int:
        """Micro-batches of the open group carried over from a checkpoint, over all replicas of the run that wrote it
        (0 unless the group was reopened with a ``position``)."""
        return self._sums.carried_microbatches

    def discard_open_group(self) -> int:
        """Forget the open group (its gradient was discarded by ``zero_grad``); return its micro-batch count."""
        count = self._sums.microbatches
        self._sums = GroupSums()
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
        """Plain-data state: the ledger and ``M``; loadable with ``torch.load(weights_only=True)``."""
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


_ZEROS: dict[tuple[torch.device, torch.dtype], Tensor] = {}


def _sum_exactly_rounded(values: list[float]) -> float:
    """``Σ values``, exactly rounded (``math.fsum``): the same float whatever the order of the micro-batches (the
    device sum of several replicas may differ from it in the last bit). NaN or an infinity: the plain sum's value."""
    if len(values) == 1:
        return values[0]
    try:
        return math.fsum(values)
    except (ValueError, OverflowError):  # inf - inf (a NaN), or finite values whose sum overflows (an infinity)
        return sum(values)


_NO_DEVICE_VALUES: Mapping[Slot, Tensor] = {}
_SCALE_REF, _UNITS = int(Slot.SCALE_REF), int(Slot.UNITS)
#: Integers up to this magnitude are exact as float64 values (a count read as float64 beyond it is read again).
_EXACT_FLOATS = float(2**53)


def _zero(device: torch.device, dtype: torch.dtype) -> Tensor:
    """A cached 0-d zero of ``device`` and ``dtype`` (the addend of ``addcmul``)."""
    key = (device, dtype)
    cached = _ZEROS.get(key)
    if cached is None:
        cached = _ZEROS[key] = torch.zeros((), device=device, dtype=dtype)
    return cached
