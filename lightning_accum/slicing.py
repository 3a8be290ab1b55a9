"""Cutting a loader batch into slices (``microbatch_size=``), and the record of what was cut and retried."""

from __future__ import annotations

import dataclasses
import gc
import numbers
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_accum.microbatch import infer_num_samples, nested_tensors

__all__ = [
    "MicrobatchSize",
    "OutOfMemoryRetry",
    "SlicingLog",
    "SplitBatch",
    "count_samples",
    "free_memory",
    "is_out_of_memory",
    "slice_batch",
    "validate_microbatch_size",
]

#: The values of ``microbatch_size=``: ``None`` (the loader's batch as it is), a positive int, or ``"auto"``.
MicrobatchSize = int | Literal["auto"] | None
#: ``split_batch(batch, start, stop)``: the samples ``start:stop`` of ``batch`` (for batch types this package cannot
#: cut itself).
SplitBatch = Callable[[Any, int, int], Any]


def validate_microbatch_size(value: object) -> MicrobatchSize:
    """``value`` if it is a valid ``microbatch_size``, else a ``ValueError`` naming the fix.

    Example:
        >>> validate_microbatch_size(0)
        Traceback (most recent call last):
        ...
        ValueError: `microbatch_size` must be a positive int, 'auto' or None; got 0. Pass e.g. ...
    """
    if value is None or value == "auto":
        return value  # type: ignore[return-value]
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 1:
        return int(value)
    raise ValueError(
        f"`microbatch_size` must be a positive int, 'auto' or None; got {value!r}. Pass e.g. `microbatch_size=4`"
        " (slices of at most 4 samples), 'auto' (the whole batch, halved after an out-of-memory error) or None"
        " (no slicing)."
    )


def count_samples(batch: Any, split_batch: SplitBatch | None = None) -> int:
    """The samples of a loader batch: its tensors' shared leading dimension, or ``len(batch)`` with ``split_batch``.

    Raises:
        ValueError: The batch has no common leading dimension.

    Example:
        >>> count_samples({"x": torch.zeros(8, 3), "y": torch.zeros(8)})
        8
    """
    n = infer_num_samples(batch)
    if n is None and split_batch is not None:
        try:
            n = len(batch)
        except TypeError:
            n = None
    if n is None:
        shapes = sorted({int(tensor.shape[0]) if tensor.ndim else 0 for tensor in nested_tensors(batch)})
        raise ValueError(
            "`microbatch_size` cannot cut this batch: its tensors share no leading (sample) dimension"
            f" (leading dimensions found: {shapes or 'none, no tensor'}; batch type {type(batch).__name__})."
            " Give the strategy `split_batch=lambda batch, start, stop: ...` returning samples start:stop of your"
            " batch (and make the batch type define `len()`), or pass `microbatch_size=None`."
        )
    return n


def slice_batch(batch: Any, start: int, stop: int, num_samples: int) -> Any:
    """Samples ``start:stop`` of ``batch``: tensors and per-sample lists sliced (views), containers rebuilt.

    Example:
        >>> part = slice_batch({"x": torch.arange(8).reshape(4, 2), "name": "b", "ids": [7, 8, 9, 10]}, 1, 3, 4)
        >>> part["x"].tolist(), part["name"], part["ids"]
        ([[2, 3], [4, 5]], 'b', [8, 9])
    """
    if (type(batch) is list or type(batch) is tuple) and len(batch) == num_samples:
        samples = all(isinstance(item, Mapping) for item in batch)  # a batch that is a list of samples
        # Per-sample strings or ids (not a tuple: a record).
        values = type(batch) is list and next(nested_tensors(batch), None) is None
        if samples or values:
            return batch[start:stop]
    if isinstance(batch, Tensor):
        return batch[start:stop] if batch.ndim and batch.shape[0] == num_samples else batch
    if isinstance(batch, Mapping):
        items = {k: slice_batch(v, start, stop, num_samples) for k, v in batch.items()}
        try:
            return type(batch)(items)  # type: ignore[call-arg]  # dict subclasses such as transformers' BatchEncoding
        except TypeError:
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(slice_batch(v, start, stop, num_samples) for v in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(slice_batch(v, start, stop, num_samples) for v in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        changes = {
            f.name: slice_batch(getattr(batch, f.name), start, stop, num_samples)
            for f in dataclasses.fields(batch)
            if f.init
        }
        return dataclasses.replace(batch, **changes)
    return batch


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is ``torch.OutOfMemoryError`` or a ``RuntimeError`` saying a device ran out of memory.

    Example:
        >>> is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory")), is_out_of_memory(ValueError("x"))
        (True, False)
    """
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()


def free_memory(device: torch.device) -> None:
    """Free what a failed attempt held (reference cycles; CUDA's cache)."""
    gc.collect()
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass
class OutOfMemoryRetry:
    """One out-of-memory error recovered by running a slice again, smaller: the attempted ``update`` (1-based),
    Lightning's ``epoch`` and ``batch_idx``, the global ``rank``, the ``phase`` (``"forward"`` or ``"backward"``), the
    ``failed_size`` and ``new_size`` in the log's ``unit``, and the wall-clock ``time``.
    """

    update: int
    epoch: int
    batch_idx: int
    rank: int
    phase: str
    failed_size: int
    new_size: int
    time: float = field(default_factory=time.time)


@dataclass
class SlicingLog:
    """This rank's record of ``microbatch_size=``: the ``configured`` value, the slice ``size`` in force (``None`` until
    an out-of-memory error sets one under ``"auto"``) in its ``unit`` (``"samples"``, or ``"tokens"`` for batches cut
    by tokens), the ``slice_sizes`` run (samples -> count) and the ``retries``.
    """

    configured: MicrobatchSize = None
    size: int | None = None
    unit: str = "samples"
    slice_sizes: dict[int, int] = field(default_factory=dict)
    retries: list[OutOfMemoryRetry] = field(default_factory=list)

    def limit(self, num_samples: int) -> int:
        return num_samples if self.size is None else min(self.size, num_samples)

    def note_slices(self, sizes: Sequence[int]) -> None:
        for size in sizes:
            self.slice_sizes[size] = self.slice_sizes.get(size, 0) + 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "configured": self.configured,
            "size": self.size,
            "unit": self.unit,
            "slice_sizes": {int(k): int(v) for k, v in sorted(self.slice_sizes.items())},
            "retries": [dataclasses.asdict(r) for r in self.retries],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (the size in force only under ``"auto"``)."""
        if self.configured == "auto":
            size = state.get("size")
            self.size = int(size) if isinstance(size, int) and not isinstance(size, bool) and size >= 1 else None
            self.unit = "tokens" if state.get("unit") == "tokens" else "samples"
        self.slice_sizes = {int(k): int(v) for k, v in dict(state.get("slice_sizes") or {}).items()}
        known = {f.name for f in dataclasses.fields(OutOfMemoryRetry)}
        self.retries = [
            OutOfMemoryRetry(**{k: v for k, v in r.items() if k in known})
            for r in state.get("retries") or []
            if isinstance(r, Mapping) and known - {"time"} <= set(r)
        ]
