"""Reading one micro-batch: what ``training_step`` returned, its unit counts, and the run's unit."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "Count",
    "Microbatch",
    "as_count",
    "choose_unit",
    "refuse_a_finer_unit",
    "infer_num_samples",
    "nested_tensors",
    "parse_step_output",
    "read_microbatch",
    "reported_documents",
    "unit_weight",
    "weighting_unit",
]

#: A count of units as reported: a Python int, or a 0-d integer tensor on the loss's device.
Count = int | Tensor

_UNIT_REASONS = {
    "documents": "the training step reports document counts (its loss is a mean over documents)",
    "tokens": "the training step reports token counts",
    "samples": "no token count is reported; the number of samples is known",
    "batches": "neither token counts nor the number of samples are known",
}


def infer_num_samples(batch: Any) -> int | None:
    """The leading dimension shared by every tensor of ``batch`` (shapes only), or ``None``.

    Example:
        >>> infer_num_samples({"input_ids": torch.zeros(4, 7), "labels": torch.zeros(4, 7)})
        4
    """
    # Fast path for the common flat batch (a dict, list or tuple of tensors): this runs on every micro-batch.
    kind = type(batch)
    if (kind is list or kind is tuple) and batch and all(isinstance(item, Mapping) for item in batch):
        return len(batch)  # a list of samples (a collate function that keeps them apart)
    flat = batch.values() if kind is dict else batch if kind is tuple or kind is list else None
    if flat is not None:  # one loop, no comprehension frames
        size = None
        for value in flat:
            if type(value) is not Tensor:
                break  # not flat: the walk below
            if value.ndim:
                if size is None:
                    size = value.shape[0]
                elif value.shape[0] != size:
                    return None
        else:
            return size
    sizes = {tensor.shape[0] for tensor in nested_tensors(batch) if tensor.ndim}
    return sizes.pop() if len(sizes) == 1 else None


def nested_tensors(batch: Any) -> Iterator[Tensor]:
    pending = [batch]
    while pending:
        obj = pending.pop()
        if isinstance(obj, Tensor):
            yield obj
        elif isinstance(obj, Mapping):
            pending.extend(obj.values())
        elif isinstance(obj, list | tuple):
            pending.extend(obj)


def _as_count_slow(name: str, value: Tensor, device: torch.device) -> Tensor:
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


def as_count(name: str, value: object, device: torch.device) -> Count:
    """A reported count, checked without a device read (a negative tensor is caught at the close).

    Example:
        >>> as_count("num_tokens", 2.5, torch.device("cpu"))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: `num_tokens` must be an int or a 0-d integer tensor, got float (2.5). Return e.g. ...
    """
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


def parse_step_output(
    output: Any, batch: Any, count_tokens: Callable[[Any], Any] | None = None, infer_samples: bool = True
) -> tuple[Tensor | None, object, object]:
    """``(loss, tokens, samples)`` from what ``training_step`` returned; ``loss`` is ``None`` when there is none.

    Example:
        >>> loss, tokens, samples = parse_step_output({"loss": torch.tensor(2.0), "num_tokens": 5}, torch.zeros(3, 4))
        >>> float(loss), tokens, samples
        (2.0, 5, 3)
    """
    tokens: object = None
    samples: object = None
    if isinstance(output, Tensor):
        loss: object = output
    elif type(output) is dict or isinstance(output, Mapping):
        loss = output.get("loss")
        tokens = output.get("num_tokens")
        samples = output.get("num_samples")
        if loss is not None and not isinstance(loss, Tensor):
            raise TypeError(
                f"`training_step` must return the micro-batch's mean loss as a tensor under 'loss', got "
                f"{type(loss).__name__}."
            )
    else:
        return None, None, None
    if not isinstance(loss, Tensor):
        return None, None, None
    if loss.ndim and loss.numel() != 1:
        raise ValueError(
            f"`training_step` must return a scalar (mean) loss, got a tensor of shape {tuple(loss.shape)}. "
            f"Reduce it with `.mean()` over the micro-batch's units and report their count."
        )
    if tokens is None and count_tokens is not None:
        tokens = count_tokens(batch)
    if samples is None and infer_samples:
        samples = infer_num_samples(batch)
    return (loss.reshape(()) if loss.ndim else loss), tokens, samples


@dataclass(frozen=True, slots=True)
class Microbatch:
    """One micro-batch as read at the door (:func:`read_microbatch`): its ``loss`` (or ``None``), its checked
    ``tokens``, ``samples`` and ``documents`` counts (or ``None``), ``size`` (its samples as a host int where known),
    ``reports_samples`` (the step reported them), ``label_positions`` (``labels.numel()``) and the ``batch``.
    """

    loss: Tensor | None
    tokens: Count | None = None
    samples: Count | None = None
    size: int | None = None
    reports_samples: bool = False
    label_positions: int | None = None
    batch: Any = None
    documents: Count | None = None


def read_microbatch(
    output: Any, batch: Any, count_tokens: Callable[[Any], Any] | None = None, num_samples: int | None = None
) -> Microbatch:
    """Read a step's ``output`` for ``batch`` once: the loss, the counts checked, the size and label positions.

    Args:
        count_tokens: The strategy's ``count_tokens=`` (used when the step reports no ``num_tokens``).
        num_samples: The micro-batch's samples when the caller knows them (a slice).

    Example:
        >>> mb = read_microbatch({"loss": torch.tensor(2.0), "num_tokens": 5}, {"labels": torch.zeros(3, 4)})
        >>> float(mb.loss), mb.tokens, mb.samples, mb.size, mb.label_positions
        (2.0, 5, 3, 3, 12)
    """
    loss, tokens, reported = parse_step_output(output, batch, count_tokens, infer_samples=False)

    def known() -> int | None:  # given by the caller (a slice), else the batch's shapes: a host int, or None
        return num_samples if num_samples is not None else infer_num_samples(batch)

    if loss is None:
        return Microbatch(None, size=known(), batch=batch)
    device = loss.device
    tokens_c = as_count("num_tokens", tokens, device) if tokens is not None else None
    samples_c = known() if reported is None else as_count("num_samples", reported, device)
    size = samples_c if isinstance(samples_c, int) else known()  # a tensor count is read at the close
    positions = None
    if tokens_c is not None and (type(batch) is dict or isinstance(batch, Mapping)):
        labels = batch.get("labels")
        positions = labels.numel() if isinstance(labels, Tensor) else None
    documents = reported_documents(output)
    documents_c = as_count("num_documents", documents, device) if documents is not None else None
    return Microbatch(loss, tokens_c, samples_c, size, reported is not None, positions, batch, documents_c)


def reported_documents(output: Any) -> object:
    """A step's ``output["num_documents"]`` (unchecked), or ``None``.

    Example:
        >>> reported_documents({"loss": torch.tensor(1.0), "num_documents": 3}), reported_documents(torch.tensor(1.0))
        (3, None)
    """
    return output.get("num_documents") if isinstance(output, Mapping) else None


def choose_unit(
    normalize: str, has_tokens: bool, has_samples: bool, has_documents: bool = False
) -> tuple[str, str | None]:
    """The run's unit (``"auto"``: documents, else tokens, samples, batches) and why ``"auto"`` chose it.

    Example:
        >>> choose_unit("auto", has_tokens=False, has_samples=True)
        ('samples', 'no token count is reported; the number of samples is known')
    """
    if normalize != "auto":
        return normalize, None
    unit = "documents" if has_documents else "tokens" if has_tokens else "samples" if has_samples else "batches"
    return unit, _UNIT_REASONS[unit]


_UNITS = ("batches", "samples", "tokens", "documents")  # from the least to the most specific count


def refuse_a_finer_unit(fixed: str, normalize: str, reported: str, where: str) -> None:
    """Under ``normalize="auto"``, refuse a batch whose counts choose a finer unit than ``fixed``."""
    if normalize != "auto" or _UNITS.index(reported) <= _UNITS.index(fixed):
        return
    raise ValueError(
        f"Under `normalize='auto'` the run's unit is {fixed} (fixed by its first micro-batch, or by the checkpoint it"
        f" resumed from), but {where} reports {reported} (`num_{reported}`): weighting it by {fixed} would optimize"
        f" (or measure) another objective than the one its counts describe, silently. Report the same counts in every"
        f" micro-batch and evaluation batch of the run, or choose the unit explicitly (`normalize={reported!r}`, or"
        f" `normalize={fixed!r}` to weight every micro-batch by {fixed}); a checkpoint written under another unit"
        " resumes under its own."
    )


def weighting_unit(
    fixed: str | None, normalize: str, microbatch: Microbatch, fix: Callable[[str, str | None, Any], None]
) -> str:
    """The unit ``microbatch`` is weighted by: ``fixed``, or the one chosen, handed to ``fix(unit, reason, batch)``."""
    has = (microbatch.tokens is not None, microbatch.samples is not None, microbatch.documents is not None)
    if fixed is None:
        unit, reason = choose_unit(normalize, *has)
        fix(unit, reason, None if microbatch.reports_samples else microbatch.batch)
        return unit
    if normalize == "auto":  # a unit fixed once is never changed silently
        refuse_a_finer_unit(fixed, normalize, choose_unit("auto", *has)[0], "this training micro-batch")
    return fixed


#: What a micro-batch lacks when the run's unit has no count in it, and what to report.
_MISSING_COUNT = {
    "documents": "this micro-batch reports no document count. Return"
    " `lightning_accum.document_mean_loss(logits, labels, position_ids=...)` from `training_step` (its `num_documents`"
    " counts the documents its loss averages over), or `{'loss': loss, 'num_documents': d}` with `loss` the mean over"
    " those `d` documents.",
    "tokens": "this micro-batch reports no token count. Return"
    " `{'loss': loss, 'num_tokens': lightning_accum.supervised_tokens(labels, shift=True)}` from `training_step`"
    " (shift=False when the labels are already aligned with the logits), or pass `count_tokens=` to the strategy"
    " (e.g. `lightning_accum.causal_lm_tokens`).",
    "samples": "the number of samples of this micro-batch cannot be inferred (no tensor, or tensors with different"
    " leading sizes). Return `{'loss': loss, 'num_samples': n}` from `training_step`.",
}


def unit_weight(
    unit: str, normalize: str, tokens: Count | None, samples: Count | None, documents: Count | None = None
) -> Count:
    """The weight of one micro-batch in ``unit``; ``ValueError`` naming what to report when its count is missing.

    Example:
        >>> unit_weight("batches", "batches", None, None)
        1
    """
    if unit not in _MISSING_COUNT:
        return 1
    count = {"documents": documents, "tokens": tokens, "samples": samples}[unit]
    if count is None:
        raise ValueError(f"The run normalizes by {unit} (`normalize={normalize!r}`) but {_MISSING_COUNT[unit]}")
    return count
