"""Counting the tokens a loss averages over: ``count_tokens=`` functions and the hint given when nobody counts them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "LABEL_KEY_WORDS",
    "TokenWeightingWarning",
    "causal_lm_tokens",
    "check_labels",
    "find_labels",
    "ignored_label_key",
    "seq2seq_tokens",
    "supervised_tokens",
    "token_weighting_hint",
]

#: Words that mark a tensor of a batch as labels (matched in its key, case-insensitively).
LABEL_KEY_WORDS: tuple[str, ...] = ("label", "target")


class TokenWeightingWarning(UserWarning):
    """Micro-batches are weighted by samples or batches although their labels hold ignored positions."""


class _Required:
    def __repr__(self) -> str:
        return "<required>"


_REQUIRED: Any = _Required()


def supervised_tokens(labels: Tensor, *, shift: bool = _REQUIRED, ignore_index: int = -100) -> Tensor:
    """The label positions a token-level mean loss averages over, as a 0-d int64 tensor on the labels' device.

    Args:
        labels: Integer labels, the sequence along the last dimension (e.g. ``(batch, T)``).
        shift: Required. ``True`` when the loss compares ``logits[..., :-1]`` with ``labels[..., 1:]`` (Hugging Face
            causal LMs); ``False`` when it compares every position (labels shifted by the collator, seq2seq).
        ignore_index: The label value the loss ignores.

    Raises:
        TypeError: ``shift`` is missing or not a bool, or ``labels`` is not an integer tensor.
        ValueError: ``shift=True`` on a 0-d tensor.

    Example:
        >>> labels = torch.tensor([[5, 6, 7], [8, 9, -100]])
        >>> supervised_tokens(labels, shift=True), supervised_tokens(labels, shift=False)
        (tensor(3), tensor(5))
    """
    if not isinstance(shift, bool):
        got = "none" if shift is _REQUIRED else repr(shift)
        raise TypeError(
            f"`supervised_tokens` needs `shift=True` or `shift=False` (got {got}): `shift=True` if the loss compares"
            " `logits[..., :-1]` with `labels[..., 1:]` (as Hugging Face causal LMs do inside their loss),"
            " `shift=False` if the labels are already shifted by the collator or every position is compared (seq2seq,"
            " token classification). A count that is not the loss's weights the updates wrongly without an error;"
            " `count_tokens=lightning_accum.causal_lm_tokens` counts a causal LM's `batch['labels']`."
        )
    check_labels(labels)
    if shift:
        if labels.ndim == 0:
            raise ValueError(
                "`labels` must have a sequence dimension to shift, got a 0-d tensor. Pass labels of shape"
                " (batch, T), or `shift=False` if the loss does not shift them."
            )
        labels = labels[..., 1:]
    return (labels != ignore_index).sum(dtype=torch.int64)


def check_labels(labels: object) -> None:
    """Raise ``TypeError`` when ``labels`` is not a tensor of integer label ids."""
    if not isinstance(labels, Tensor):
        raise TypeError(
            f"`labels` must be a tensor of label ids, got {type(labels).__name__}. Pass e.g. `batch['labels']`."
        )
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(
            f"`labels` must hold integer label ids, got dtype {labels.dtype}. Pass the labels the loss compares"
            " with (e.g. `batch['labels']`), not logits or a mask."
        )


def causal_lm_tokens(batch: Mapping[str, Any]) -> Tensor:
    """``count_tokens=`` for causal LMs: ``batch["labels"]`` counted shifted.

    Example:
        >>> causal_lm_tokens({"input_ids": torch.zeros(2, 3), "labels": torch.tensor([[5, 6, 7], [8, 9, -100]])})
        tensor(3)
    """
    return supervised_tokens(_labels_of(batch, "causal_lm_tokens"), shift=True)


def seq2seq_tokens(batch: Mapping[str, Any]) -> Tensor:
    """``count_tokens=`` for seq2seq models (T5, BART): ``batch["labels"]``, unshifted.

    Example:
        >>> seq2seq_tokens({"labels": torch.tensor([[5, 6, 7], [8, 9, -100]])})
        tensor(5)
    """
    return supervised_tokens(_labels_of(batch, "seq2seq_tokens"), shift=False)


def _labels_of(batch: Any, name: str) -> Tensor:
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if not isinstance(labels, Tensor):
        keys = list(batch.keys()) if isinstance(batch, Mapping) else type(batch).__name__
        raise KeyError(
            f"`{name}` reads `batch['labels']`, but the batch has none (got {keys}). Pass"
            " `count_tokens=lambda batch: supervised_tokens(<your labels>, shift=...)` instead."
        )
    return labels


def find_labels(batch: Any) -> list[tuple[str, Tensor]]:
    """The integer tensors of ``batch`` (searched through mappings, lists, tuples) whose key says "label" or "target".

    Example:
        >>> batch = {"input_ids": torch.zeros(2, 3, dtype=torch.long), "labels": torch.zeros(2, 3, dtype=torch.long)}
        >>> [key for key, _ in find_labels(batch)]
        ['labels']
    """
    found: list[tuple[str, Tensor]] = []
    pending: list[tuple[str, Any]] = [("", batch)]
    while pending:
        key, obj = pending.pop()
        if isinstance(obj, Tensor):
            if (
                obj.ndim
                and not (obj.is_floating_point() or obj.is_complex() or obj.dtype == torch.bool)
                and any(word in key.lower() for word in LABEL_KEY_WORDS)
            ):
                found.append((key, obj))
        elif isinstance(obj, Mapping):
            pending.extend((str(k), v) for k, v in reversed(list(obj.items())))
        elif isinstance(obj, (list, tuple)):
            pending.extend((key, v) for v in reversed(obj))
    return found


def ignored_label_key(batch: Any, ignore_index: int = -100) -> str | None:
    """The key of the first labels-like tensor holding ``ignore_index``, or ``None`` (one host read per tensor).

    Example:
        >>> ignored_label_key({"labels": torch.tensor([[5, -100]])}), ignored_label_key({"labels": torch.tensor([[5]])})
        ('labels', None)
    """
    for key, labels in find_labels(batch):
        if bool((labels == ignore_index).any()):
            return key
    return None


def token_weighting_hint(unit: str, batch: Any, ignore_index: int = -100) -> str | None:
    """The warning when ``normalize="auto"`` chose samples or batches but ``batch`` has ignored labels, else ``None``.

    Example:
        >>> "token weighting is probably intended" in token_weighting_hint("samples", {"label": torch.tensor([[-100]])})
        True
    """
    if unit in ("tokens", "documents"):  # documents: the step weighs by them on purpose (`document_mean_loss`)
        return None
    key = ignored_label_key(batch, ignore_index)
    if key is None:
        return None
    return (
        f"lightning_accum: micro-batches are weighted by {unit} (normalize='auto' found no token count), but the"
        f" batch's {key!r} holds ignored positions ({ignore_index}): token weighting is probably intended, else"
        " the update is a mean of micro-batch means and depends on how examples are split. For a Hugging Face"
        " causal LM (its loss shifts the labels) pass\n"
        "    count_tokens=lightning_accum.causal_lm_tokens\n"
        "to the strategy (`AccumulationStrategy(...)` or `DDPAccumulationStrategy(...)`), or return"
        f" `{{'loss': loss, 'num_tokens': lightning_accum.supervised_tokens(batch[{key!r}], shift=True)}}` from"
        f" `training_step`; use `shift=False` (or `seq2seq_tokens`) when the loss does not shift the labels. Pass"
        f" `normalize='{unit}'` to keep the {unit} weighting and silence this warning."
    )
