"""Where a fit's groups start and end, told to Lightning's loop where their sizes vary: docs/internals.md, "Group
boundaries"; the hook that would replace the two patched methods: docs/upstream.md."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from lightning_accum.patching import InstancePatch

__all__ = ["GroupBoundaries", "GroupSizer", "UnknownUpdates"]

_SCHEDULED = (
    "under `batch_schedule=`: each group's size follows the run's position, so the number of updates is not known"
    " before the groups run"
)

#: ``sizer(batch, batch_idx, resumed) -> int``: the micro-batches per replica of the group starting with ``batch`` at
#: ``batch_idx``; ``resumed``: at a fit's first group, the size of the checkpoint's open group it continues, else None.
GroupSizer = Callable[[Any, int, "int | None"], int]


class GroupBoundaries:
    """The groups of a fit: Lightning's, or sized by a sizer at each group's start (:meth:`begin`) until
    :meth:`release`.
    """

    def __init__(self) -> None:
        self.first = self.size = 0  # the open group's first batch in the epoch, its size (0: Lightning's groups)
        self.sizer: GroupSizer | None = None
        self.accumulate: int | None = None  # `trainer.accumulate_grad_batches` as the groups left it
        self._given, self._patches = 1, list[InstancePatch]()
        self._loop: Any = None  # the fit loop's epoch loop, for the fit

    def install(self, trainer: Any, sizer: GroupSizer | None) -> None:
        """For a fit: groups sized by ``sizer`` (``None``: Lightning's)."""
        self.first, self.size, self.sizer, self.accumulate = 0, 0, sizer, None
        if sizer is not None:
            self._given = self.accumulate = trainer.accumulate_grad_batches
            self._loop = loop = trainer.fit_loop.epoch_loop
            self._patches = [
                InstancePatch(loop, "_accumulated_batches_reached", self._ends),
                InstancePatch(loop.automatic_optimization, "_make_zero_grad_fn", self._zero_grad_fn),
            ]

    def release(self, trainer: Any) -> None:
        """Give Lightning's loop its methods back, and the Trainer its ``accumulate_grad_batches``."""
        for patch in self._patches:
            patch.release()
        if self.sizer is not None and trainer is not None:
            trainer.accumulate_grad_batches = self._given
        self._patches, self._loop, self.sizer, self.size, self.accumulate = [], None, None, 0, None

    def position(self, batch_idx: int, accumulate: int) -> int:
        """The micro-batches of its group before batch ``batch_idx``."""
        return batch_idx - self.first if self.size else batch_idx % accumulate

    def begin(self, trainer: Any, batch: Any, batch_idx: int, loaded: Mapping[str, Any] | None = None) -> None:
        """A group starts at ``batch_idx``, sized; at a fit's first, a checkpoint's open group ``loaded`` continues."""
        assert self.sizer is not None
        done = int(loaded.get("microbatches", 0)) if loaded and not self.size else 0
        entry = loaded or {}
        as_written = entry.get("accumulate") or (entry.get("config") or {}).get("accumulate") or 1
        size = self.sizer(batch, batch_idx, int(as_written) if done else None)
        self.first, self.size = batch_idx - done, size
        trainer.accumulate_grad_batches = self.accumulate = size

    def written(self, trainer: Any, batch_idx: int) -> None:
        """``trainer.accumulate_grad_batches`` changed: taken at an epoch's start without a sizer, else refused."""
        before, after = self.accumulate, trainer.accumulate_grad_batches
        if self.sizer is None and (batch_idx == 0 or before is None):
            self.accumulate = after
            return
        where = "which the strategy sets at each group's start" if self.sizer else "inside the epoch"
        raise RuntimeError(
            f"`trainer.accumulate_grad_batches` changed from {before} to {after} before batch {batch_idx} of epoch"
            f" {trainer.current_epoch}, {where}: Lightning would end the open group elsewhere. Likely writers: a"
            " `GradientAccumulationScheduler` keyed by steps (Lightning's PR #21583), a callback's or the module's"
            " `on_train_batch_start`, `StochasticWeightAveraging`'s batch-norm epoch under `batch_schedule=`. Change it"
            " at an epoch's start, or state the sizes as `batch_schedule=` and let it set them."
        )

    def _ends(self, below: Callable[[], bool]) -> bool:  # `_accumulated_batches_reached`
        return bool(self._loop.batch_progress.current.ready - self.first == self.size) if self.size else below()

    def _zero_grad_fn(self, below: Callable[..., Any], batch_idx: int, optimizer: Any) -> Any:  # `_make_zero_grad_fn`
        if not self.size:
            return below(batch_idx, optimizer)
        steps = self._loop.automatic_optimization
        if batch_idx != self.first or steps._skip_backward:
            return None

        def zero_grad_fn() -> None:
            steps._on_before_zero_grad(optimizer)
            steps._optimizer_zero_grad(batch_idx, optimizer)

        return zero_grad_fn


class UnknownUpdates:
    """``trainer.accumulate_grad_batches`` in ``configure_optimizers`` where groups are sized as they start: any
    arithmetic on it raises ``RuntimeError`` saying ``why`` (``batch_schedule=``'s reason by default).
    """

    def __init__(self, why: Callable[[], str] = lambda: _SCHEDULED) -> None:
        self.why = why

    def _refuse(self, *args: Any) -> Any:
        raise RuntimeError(
            "`trainer.estimated_stepping_batches` (or `trainer.accumulate_grad_batches`) was read in"
            f" `configure_optimizers` {self.why()}. Define the rate on the run's axis with `AxisLR`"
            " (e.g. `AxisLR(optimizer, axis='tokens', lr_lambda=...)`), or size it by a count of updates of your own."
        )

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _refuse
    __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = __divmod__ = __rdivmod__ = __pow__ = __rpow__ = _refuse
    __lt__ = __le__ = __gt__ = __ge__ = __int__ = __float__ = __index__ = _refuse  # type: ignore[assignment]
