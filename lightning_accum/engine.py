"""The arithmetic of exact accumulation, independent of Lightning's loops.

Every accumulation strategy delegates to one :class:`AccumulationEngine`; tests drive it without a ``Trainer``.
It composes :mod:`~lightning_accum.microbatch` (reading a micro-batch), :mod:`~lightning_accum.group` (a group's
sums), :mod:`~lightning_accum.decision` (what to do with the reduced values), :mod:`~lightning_accum.gradients`
(the kernels) and :mod:`~lightning_accum.ledger` (the counters).

Update ``g`` minimises ``L_g = Σ_{r,i} w_{r,i} · loss_{r,i} / W`` with ``W = Σ_{r,i} w_{r,i}`` over the group's
micro-batches ``i`` on every replica ``r``. ``W`` is known only at the close, so each micro-batch back-propagates
``loss · w / c`` and the group's gradient is multiplied once by ``c · D / W`` when it closes (``D`` because DDP
averages). ``c = A · M`` is the same on every replica and constant within a group: any such ``c`` is exact, and ``M``
(the largest mean micro-batch weight of any group closed so far, with the first group's and, on one device, the
first micro-batch's weight as floors) keeps the magnitudes near Lightning's ``loss / A`` for fp16. A group known to
hold one micro-batch on one replica (``add_microbatch(sole=True)``) takes ``c = w``: its factor is exactly 1.
docs/concepts.md ("The arithmetic") derives it.

All per-micro-batch work stays on the device. On several replicas the close sums a small float64 vector
(:meth:`GroupSums.local_vector <lightning_accum.group.GroupSums.local_vector>`) in one all-reduce, rescales the
gradient with its NaN/Inf check in the same pass and reads the vector once; on one replica the values are read as
reported, in one host read (:func:`_local_close`). The engine imports nothing from Lightning: the strategies
:meth:`~AccumulationEngine.bind` it to their replicas and route its messages to rank zero.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_accum.carry import Carried, carried_state
from lightning_accum.decision import (
    GroupDecisions,
    GroupListener,
    GroupOutcome,
    raised_reference,
)
from lightning_accum.devices import require_float64
from lightning_accum.gradients import GradientsByKind, rescale_gradients
from lightning_accum.group import UNIT_CODES, VECTOR_SIZE, GroupSums, ReducedGroup, Slot
from lightning_accum.ledger import AccumulationLedger, GroupRecord
from lightning_accum.microbatch import (
    Count,
    Microbatch,
    read_microbatch,
    unit_weight,
    weighting_unit,
)
from lightning_accum.options import AccumulationOptions
from lightning_accum.tokens import TokenWeightingWarning, token_weighting_hint

__all__ = ["AccumulationEngine", "GroupListener", "GroupOutcome", "Replicas"]

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

    @property
    def alone(self) -> bool:
        """Whether a group is neither summed over replicas nor checked over shards (one device)."""
        return (self.reduce_sum is None or self.size == 1) and self.check_sum is None

    def sum_(self, tensor: Tensor) -> Tensor:
        """Sum ``tensor`` over the replicas, in place (nothing to do on one)."""
        if self.reduce_sum is not None and self.size > 1:
            self.reduce_sum(tensor)
        return tensor


class AccumulationEngine:
    """Exact weighted accumulation over micro-batches and replicas, one group at a time.

    The strategies :meth:`bind` it to their device and replicas, :meth:`read` every ``training_step``'s output once
    and :meth:`record` it (:meth:`add_microbatch` does both), back-propagate the tensor it returns, call
    :meth:`close_group` after a group's last backward and before unscaling, clipping and the optimizer, act on the
    returned :class:`GroupOutcome`, and report the result with :meth:`finish_group`.

    Args:
        **options: The options (``normalize=``, ...), see :class:`~lightning_accum.options.AccumulationOptions`.

    Raises:
        TypeError: A keyword that is not an option.

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

    def __init__(self, **options: Any) -> None:
        self._start(AccumulationOptions.split(type(self).__name__, options)[0])

    @classmethod
    def from_options(cls, options: AccumulationOptions) -> AccumulationEngine:
        """An engine with the options a strategy validated."""
        engine = cls.__new__(cls)
        engine._start(options)
        return engine

    @classmethod
    def unweighted(cls) -> AccumulationEngine:
        """An engine that weighs every micro-batch 1 with ``M = 1`` (``c = A``, no first-group collective): the hooks
        back-propagate Lightning's ``loss / A`` on it (see :meth:`ExactAccumulation.one_batch_reference`)."""
        engine = cls(normalize="batches")
        engine.reference_weight = 1.0
        return engine

    def _start(self, options: AccumulationOptions) -> None:
        self.options = options
        self.ledger = AccumulationLedger()
        #: What happens to each closed group: the decision, its messages, the ledger, the listeners.
        self.decisions = GroupDecisions(options, self.ledger)
        #: ``M``, the reference micro-batch weight (``c = A · M``), once a group with units has closed.
        self.reference_weight: float | None = None
        #: Where messages go (the strategies route them to rank zero through Lightning's utilities).
        self.info: Callable[[str], None] = _log.info
        self.warn: Callable[..., None] = _warn  # warn(message, category=UserWarning)
        self.device = torch.device("cpu")
        self.replicas = Replicas()
        self._group_scale: float | Tensor | None = None
        self._cast_scale: tuple[Tensor, Tensor] | None = None  # c as a tensor, and in the loss's dtype (`_divisor`)
        self._sums = GroupSums()
        self._pending_backward: Tensor | None = None
        #: The weight ``w`` of the micro-batch recorded last (its units; 1 for "batches").
        self.last_weight: Count = 0
        self._backward_running = False

    # ------------------------------------------------------------------ binding

    def bind(
        self,
        device: torch.device | str | None = None,
        replicas: Replicas | None = None,
        info: Callable[[str], None] | None = None,
        warn: Callable[..., None] | None = None,
    ) -> None:
        """Set the device the group's vector lives on, the replicas it is summed over, where messages go (if given)."""
        if device is not None:
            self.device = torch.device(device)
            require_float64(self.device)  # the group's sums are float64 there: refused now, not mid-run
        if replicas is not None:
            self.replicas = replicas
        if info is not None:
            self.info = info
        if warn is not None:
            self.warn = warn

    def scratch(self, on_nonfinite: str = "ignore") -> AccumulationEngine:
        """A fresh engine with the same options (but ``on_nonfinite`` and no skip limit), binding, unit and ``M``, whose
        groups do not touch this ledger (for :class:`~lightning_accum.AccumulationCheck`)."""
        options = dataclasses.replace(self.options, on_nonfinite=on_nonfinite, max_consecutive_skips=None)
        other = AccumulationEngine.from_options(options)
        other.bind(self.device, self.replicas, self.info, self.warn)
        other.reference_weight = self.reference_weight
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

    @property
    def holds_sole_microbatch(self) -> bool:
        """The open group holds a ``sole=True`` one."""
        return self._sums.sole

    def read(self, output: Any, batch: Any, num_samples: int | None = None) -> Microbatch:
        """Read a step's ``output`` for ``batch`` once (:func:`~lightning_accum.microbatch.read_microbatch`, with
        this engine's ``count_tokens``): what :meth:`record` takes."""
        return read_microbatch(output, batch, self.options.count_tokens, num_samples)

    def add_microbatch(
        self, output: Any, batch: Any, accumulate: int, continues: bool = False, sole: bool = False
    ) -> Tensor | None:
        """Read one micro-batch's ``training_step`` ``output`` for ``batch`` and record it: :meth:`record` of
        :meth:`read`."""
        return self.record(self.read(output, batch), accumulate, continues, sole)

    def record(
        self, microbatch: Microbatch, accumulate: int, continues: bool = False, sole: bool = False
    ) -> Tensor | None:
        """Record one micro-batch, as read, in the open group and return the tensor to back-propagate.

        Args:
            microbatch: The micro-batch as :meth:`read` gave it.
            accumulate: ``A``, the configured number of micro-batches per group.
            continues: The micro-batch is a further slice of the one recorded last (``microbatch_size=``): it is
                weighted like any micro-batch (exact: a slice's weight is its own units), but the group's micro-batch
                count does not grow. :meth:`retract_microbatch` forgets the last call.
            sole: The caller knows that this micro-batch is its group's only one (automatic optimization with
                ``A = 1``, the batch not cut into slices, nothing carried from a checkpoint). On one replica, with an
                empty open group, ``c = w``: the loss itself is returned and the close's factor is exactly 1; else
                ignored.

        Returns:
            ``loss · w / c`` (the loss itself for a sole micro-batch), or ``None`` when the step returned no loss.
        """
        sums = self._sums
        if sums.sole:
            raise RuntimeError(
                "AccumulationEngine.add_microbatch: the open group holds a micro-batch recorded with `sole=True` (its"
                " group's only one, back-propagated with c = w), so no other micro-batch can join it. Close the group"
                " first (`close_group`), or record the first micro-batch with `sole=False`."
            )
        loss = microbatch.loss
        if loss is None:
            sums.add(microbatch, continues)
            return None
        tokens, samples, documents = microbatch.tokens, microbatch.samples, microbatch.documents
        unit = weighting_unit(self.ledger.normalization, self.options.normalize, microbatch, self._fix_unit)
        weight = unit_weight(unit, self.options.normalize, tokens, samples, documents)
        self.last_weight = weight
        sums.add(microbatch, continues)
        if sole and not continues and sums.microbatches == 1 and self.replicas.alone:
            # c = w: the loss itself is back-propagated, and the close's factor c · D / W is exactly 1.
            sums.sole = True
            self._group_scale = weight if isinstance(weight, Tensor) else float(weight)
            self._pending_backward = loss
            return loss
        scale = self._group_scale
        if scale is None:
            scale = self._group_scale = self._first_group_scale(weight, accumulate, loss.device)
        backward = weighted_loss(loss, weight, self._divisor(scale, loss))
        self._pending_backward = backward
        return backward

    def _divisor(self, scale: float | Tensor, loss: Tensor) -> float | Tensor:
        """``c`` as :func:`weighted_loss` divides by it: a device scalar cast once per group to the loss's dtype."""
        if not isinstance(scale, Tensor):
            return scale
        cast, dtype = self._cast_scale, torch.float32 if loss.dtype in (torch.float16, torch.bfloat16) else loss.dtype
        if cast is None or cast[0] is not scale or cast[1].dtype != dtype:
            cast = self._cast_scale = (scale, scale.to(device=loss.device, dtype=dtype))
        return cast[1]

    def retract_microbatch(self) -> None:
        """Forget the micro-batch (or slice) :meth:`add_microbatch` recorded last, whose backward did not complete
        (out of memory): it is recorded again when it runs again. ``c`` of the group stays as it is (any ``c`` that
        is constant within the group is exact); after a sole micro-batch (``c = w`` of that one) it is formed again."""
        sole = self._sums.sole
        self._sums.retract()
        if sole:
            self._group_scale = None
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

    def _fix_unit(self, unit: str, reason: str | None, batch: Any) -> None:
        """The run's unit, chosen by its first micro-batch: said once under ``"auto"`` (with the hint that tokens were
        probably meant, read once a run), then fixed in the ledger."""
        if reason is not None:
            self.info(f"lightning_accum: micro-batches are weighted by {unit} (normalize='auto': {reason}).")
            hint = token_weighting_hint(unit, batch) if batch is not None else None  # one device read, once a run
            if hint is not None:
                self.warn(hint, category=TokenWeightingWarning)
        self.ledger.normalization = unit

    def _first_group_scale(self, weight: Count, accumulate: int, device: torch.device) -> float | Tensor:
        """``c = A · M`` for the group the micro-batch of ``weight`` opens (docs/concepts.md, "The arithmetic")."""
        reference = self.reference_weight
        if self.replicas.size == 1 or self.replicas.reduce_sum is None:
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
        stale: Tensor | None = None,
        carried: Carried | None = None,
    ) -> GroupOutcome:
        """Reduce the group's sums over replicas (one all-reduce, one host read) and decide what to do.

        Args:
            accumulate: ``A``, the configured number of micro-batches per group.
            ends_epoch: Whether this replica's data ends with this group. Replicas must agree: one whose data
                ended while others go on would leave them waiting in a collective forever.
            gradients: The group's accumulated gradients (under DDP already averaged, identical on every replica), a
                flat sequence or grouped (:data:`~lightning_accum.gradients.GradientsByKind`): multiplied in place by
                ``c · D / W`` on the device before the host read (``scaled``); the caller zeroes them unless "apply".
            check_gradients: With ``gradients``: check them for NaN/Inf in the same pass as the rescale (the
                kernel GradScaler unscales with; checked before multiplying), for ``on_nonfinite`` "skip" and
                "raise". Every replica checks the same averaged gradient, so all take the same decision.
            describe_nonfinite: Names the first offending parameter, for ``on_nonfinite="raise"``.
            stale: A manual group that opened on gradients already there: how many of them are nonzero (a device
                scalar), read with the group's values (:attr:`GroupOutcome.stale
                <lightning_accum.decision.GroupOutcome.stale>`, summed over the replicas).
            carried: What a checkpoint written inside the group carried into it (the lifecycle's).

        Raises:
            ValueError: A reported count was negative (on every replica alike, so none of them hangs).
            RuntimeError: Replicas disagree on the number of micro-batches or on the unit; or the gradient is non-finite
                under ``on_nonfinite="raise"``.
        """
        sums, unit = self._sums, self.ledger.normalization
        sums.stale = stale
        scale = self._group_scale if self._group_scale is not None else accumulate * (self.reference_weight or 1.0)
        if self.replicas.alone and carried is None:  # nothing to sum: the values read as they are
            reduced, nonfinite = _local_close(sums, unit, ends_epoch, scale, gradients, check_gradients)
        else:
            reduced, nonfinite = self._reduce(sums, unit, ends_epoch, scale, gradients, check_gradients, carried)
        # The next group opens (whatever the decision raises); M is raised by the closed one.
        self._sums, self._group_scale = GroupSums(), None
        self.reference_weight = raised_reference(self.reference_weight, reduced)
        size, scaled = self.replicas.size, bool(gradients)
        say = (self.info, self.warn)
        return self.decisions.decide(
            sums, reduced, accumulate, size, ends_epoch, nonfinite, scaled, describe_nonfinite, say, carried
        )

    def _reduce(
        self,
        sums: GroupSums,
        unit: str | None,
        ends_epoch: bool,
        scale: float | Tensor,
        gradients: Any,
        check: bool,
        carried: Carried | None,
    ) -> tuple[ReducedGroup, bool]:
        """The general close: the vector, its sum over the replicas, the rescale with its check, one host read."""
        extra = {
            Slot.MICROBATCHES: float(sums.microbatches),
            Slot.UNIT_CODE: UNIT_CODES.get(unit or "", 0.0),
            Slot.UNIT_CODE_SQUARED: UNIT_CODES.get(unit or "", 0.0) ** 2,
            Slot.LAST: 1.0 if ends_epoch else 0.0,
        }
        vector = self.replicas.sum_(
            sums.local_vector(self.device, unit, extra, scale, None if carried is None else carried.sums)
        )
        found: Tensor | None = None
        if gradients:
            # c · D / W on the device: the gradient is rescaled before anything is read on the host.
            found = rescale_gradients(gradients, vector[Slot.GROUP_SCALE] / vector[Slot.UNITS], check)
            if found is not None and self.replicas.check_sum is not None:
                # Sharded gradients: each rank checked its own shard; every rank must take the same decision.
                found = self.replicas.check_sum(found)
        values = (torch.cat((vector, found.to(vector.device).reshape(1))) if found is not None else vector).tolist()
        return ReducedGroup.from_values(values), any(flag > 0 for flag in values[VECTOR_SIZE:])

    def finish_group(self, outcome: GroupOutcome, applied: bool, skip_reason: str | None = None) -> GroupRecord:
        """Complete the outcome's record once the optimizer ran (or did not): the ledger, the listeners."""
        return self.decisions.finish(outcome, applied, skip_reason)

    # ------------------------------------------------------------------ groups across a checkpoint

    def open_group_state(self, carried: Carried | None = None) -> dict[str, Any]:
        """The open group's counters summed over replicas (:func:`~lightning_accum.carry.carried_state`), with what
        ``carried`` brought into it, for a checkpoint written inside a group: a collective with several replicas."""
        sums = self._sums.local_vector(
            self.device, self.ledger.normalization, carried=None if carried is None else carried.sums
        )
        vector = self.replicas.sum_(sums)
        return carried_state(self._sums.microbatches, vector.tolist(), self._group_scale, self.group_consistent)

    def resume_open_group(self, scale: float | Tensor | None) -> None:
        """Open a group that continues the one a checkpoint was written in: its ``c`` is ``scale``, the written one
        (what the checkpoint carried is handed to the close: :class:`~lightning_accum.carry.Carried`)."""
        self._sums, self._group_scale = GroupSums(), scale

    def discard_open_group(self) -> int:
        """Forget the open group (its gradient was discarded by ``zero_grad``); return its micro-batch count."""
        count = self._sums.microbatches
        self._sums, self._group_scale = GroupSums(), None
        return count

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Plain-data state: the ledger and ``M``; loadable with ``torch.load(weights_only=True)``."""
        return {
            "ledger": self.ledger.state_dict(),
            "scale_ref": self.reference_weight,  # M, under the key it was always written with
            "consecutive_skips": self.decisions.consecutive_skips,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.ledger.load_state_dict(dict(state.get("ledger", {})))
        ref = state.get("scale_ref")
        self.reference_weight = float(ref) if ref is not None else None
        self.decisions.consecutive_skips = int(state.get("consecutive_skips", 0))


def _local_close(
    sums: GroupSums,
    unit: str | None,
    ends_epoch: bool,
    scale: float | Tensor,
    gradients: Sequence[Tensor] | GradientsByKind | None,
    check: bool,
) -> tuple[ReducedGroup, bool]:
    """:meth:`AccumulationEngine.close_group` on one replica, of a group holding nothing from a checkpoint: its reduced
    values and whether its gradient is non-finite. Nothing is summed over replicas, so no vector is formed: the gradient
    is rescaled by ``c / W`` (:func:`_one_replica_factor`), the losses, the check's flag, ``c`` and the counts reported
    as tensors are read as they are, in one host read, and the group's values formed on the host (counts as ints,
    exact; ``Σ w·loss`` in float64). A group of one micro-batch recorded as its only one (``sole``, ``c = w``) has the
    factor ``w / w``, exactly 1: its gradient is only checked. The close's one specialised path, kept for its measured
    cost (``benchmarks/RESULTS.md``, issue #28).
    """
    factor = 1.0 if sums.sole else _one_replica_factor(scale, sums.weights(unit), len(sums.losses))
    found = rescale_gradients(gradients, factor, check) if gradients and factor is not None else None
    read_scale = scale if isinstance(scale, Tensor) and not sums.sole else None  # a sole c = w is read as a count
    counts = [c for c in (*sums.tokens, *sums.samples, *sums.documents) if isinstance(c, Tensor)]
    stale = sums.stale
    # Starred conditionals, not a comprehension: a comprehension is one more call on the hot path (its frame).
    items = [
        *sums.losses,
        *([found] if found is not None else []),
        *([read_scale] if read_scale is not None else []),
        *([stale] if stale is not None else []),
        *counts,
    ]
    read, exact_below = _read_once(items)
    losses = [next(read) for _ in sums.losses]
    nonfinite = found is not None and next(read) > 0
    read_c = next(read) if read_scale is not None else None
    stale_count = round(next(read)) if stale is not None else 0
    tokens, samples, documents = (
        [c if not isinstance(c, Tensor) else _exact(next(read), c, exact_below) for c in kind]
        for kind in (sums.tokens, sums.samples, sums.documents)
    )
    units_of = {"tokens": tokens, "samples": samples, "documents": documents}.get(unit or "")
    if units_of is None:  # every micro-batch with a loss weighs 1
        units, weighted = float(len(losses)), float(sum(losses))
    else:  # an empty micro-batch's NaN mean is left out
        units = float(sum(units_of))
        weighted = float(sum(w * loss for w, loss in zip(units_of, losses, strict=True) if w > 0))
    reduced = ReducedGroup(
        units=units,
        weighted_loss=weighted,
        tokens=sum(tokens),
        samples=sum(samples),
        negative=sum(c < 0 for c in (*tokens, *samples, *documents)),
        group_scale_times_d=units if sums.sole else read_c if read_c is not None else float(scale),  # c; D = 1
        microbatches=sums.microbatches,
        unit_code=UNIT_CODES.get(unit or "", 0.0),
        unit_code_squared=UNIT_CODES.get(unit or "", 0.0) ** 2,
        ended=int(ends_epoch),
        excess=sum(p is not None and c > p for c, p in zip(tokens, sums.positions, strict=True)),
        documents=sum(documents),
        stale=stale_count,
    )
    return reduced, nonfinite


def _read_once(items: list[Tensor]) -> tuple[Iterator[float], int]:
    """The values of 0-d tensors in one host read (one stack, in their common dtype: at least float32, float64 where
    one is), and the count below which every integer is exact in that dtype (2^24 in float32, 2^53 in float64)."""
    if not items:
        return iter(()), 2**53
    if items[0].dtype in (torch.float16, torch.bfloat16):
        items = [items[0].float(), *items[1:]]
    stacked = torch.stack(items)
    return iter(stacked.tolist()), 2**53 if stacked.dtype == torch.float64 else 2**24


def _one_replica_factor(scale: float | Tensor, weights: list[Count] | None, losses: int) -> float | Tensor | None:
    """``c / W`` on one replica: a float where ``c`` and the weights are known on the host, else a device scalar
    (float64, as the vector's slots divide); ``None`` where the host knows ``W = 0`` (an empty group, skipped: nothing
    to rescale). ``weights``: the unit's counts, or ``None`` when every micro-batch with a loss weighs 1."""
    host = losses if weights is None else sum(w for w in weights if not isinstance(w, Tensor))
    on_device = [w for w in weights if isinstance(w, Tensor)] if weights is not None else []
    if not on_device:
        return scale / host if host else None
    units = torch.stack(on_device).sum()
    if host:
        units = units + host
    numerator = scale if isinstance(scale, Tensor) else torch.full((), scale, dtype=torch.float64, device=units.device)
    return numerator / units


def _exact(value: float, count: Tensor, below: int = 2**53) -> int:
    """A count read as a float, exact: read again as an integer from ``below`` on, where the read's dtype has no longer
    every integer (2^24 in float32, over 16 million units in one micro-batch; 2^53 in float64; neither seen in
    practice)."""
    return int(value) if abs(value) < below else int(count.item())


def weighted_loss(loss: Tensor, weight: Count, group_scale: float | Tensor) -> Tensor:
    """``loss · w / c``, formed in the loss's dtype (float32 for a half-precision loss, whose factor ``w / c`` would be
    rounded by ~1e-3 otherwise).

    Example:
        >>> weighted_loss(torch.tensor(2.0, dtype=torch.float64), torch.tensor(5), 7.0).item() == 2.0 * 5 / 7
        True
    """
    if loss.dtype in (torch.float16, torch.bfloat16):
        loss = loss.float()
    if not isinstance(weight, Tensor) and not isinstance(group_scale, Tensor):
        return loss * (weight / group_scale)  # w / c in float64 on the host, rounded once to the loss's dtype
    c = group_scale.to(device=loss.device, dtype=loss.dtype) if isinstance(group_scale, Tensor) else group_scale
    if isinstance(weight, Tensor) and isinstance(c, Tensor):
        # w / c in the loss's dtype (the integer count promoted inside the division), outside the graph: the backward
        # holds one product, as Lightning's holds one division.
        return loss * (weight / c)
    return loss * weight / c  # an integer count is promoted to the loss's dtype inside the product
