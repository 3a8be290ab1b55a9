"""Documents inside packed rows: the mean over documents of each document's mean token loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_accum.tokens import check_labels

__all__ = ["document_mean_loss", "document_starts"]


def _check_ids(name: str, ids: object, labels: Tensor) -> Tensor:
    if not isinstance(ids, Tensor):
        raise TypeError(f"`{name}` must be a tensor of the labels' shape, got {type(ids).__name__}.")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(
            f"`{name}` must hold integers, got dtype {ids.dtype}. Pass the batch's `{name}` as the collator made them."
        )
    if ids.shape != labels.shape:
        raise ValueError(
            f"`{name}` must have the labels' shape {tuple(labels.shape)} (one id per label position), got"
            f" {tuple(ids.shape)}. Pass the `{name}` of the same batch as the labels, unshifted."
        )
    return ids.to(labels.device, non_blocking=True)


def document_starts(labels: Tensor, position_ids: Tensor | None = None, document_ids: Tensor | None = None) -> Tensor:
    """A boolean tensor of the labels' shape, ``True`` at every row start, where ``position_ids`` is 0, or where
    ``document_ids`` changes.

    Example:
        >>> document_starts(torch.zeros(1, 5, dtype=torch.long), position_ids=torch.tensor([[0, 1, 2, 0, 1]]))
        tensor([[ True, False, False,  True, False]])
    """
    if position_ids is not None and document_ids is not None:
        raise ValueError(
            "Pass `position_ids` or `document_ids`, not both: each delimits the documents by itself (positions"
            " restarting at 0, or a change of id). Keep the one your collator produces."
        )
    if position_ids is not None:
        starts = _check_ids("position_ids", position_ids, labels) == 0
    else:
        starts = torch.zeros(labels.shape, dtype=torch.bool, device=labels.device)
        if document_ids is not None:
            ids = _check_ids("document_ids", document_ids, labels)
            starts[..., 1:] = ids[..., 1:] != ids[..., :-1]
    starts[..., :1] = True
    return starts


def document_mean_loss(
    logits: Tensor,
    labels: Tensor,
    *,
    position_ids: Tensor | None = None,
    document_ids: Tensor | None = None,
    shift: bool = True,
    ignore_index: int = -100,
) -> dict[str, Tensor]:
    """The training-step output whose update is the mean over documents of each document's mean token loss.

    Args:
        logits: ``(..., T, V)``.
        labels: ``(..., T)`` integer label ids; ``ignore_index`` marks positions without a label.
        position_ids: ``(..., T)``, restarting at 0 for every document.
        document_ids: ``(..., T)``, an id per position; a change of id starts a document. Not with ``position_ids``.
        shift: As for :func:`~lightning_accum.supervised_tokens` (``True`` for causal language models).
        ignore_index: The label value that is not supervised.

    Returns:
        ``{"loss", "num_documents", "num_tokens"}``, the counts as 0-d int64 tensors on the labels' device.

    Raises:
        TypeError: ``labels`` (or an id tensor) is not an integer tensor.
        ValueError: The shapes do not match, or both ``position_ids`` and ``document_ids`` are given.

    Example:
        >>> logits = torch.randn(1, 6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        >>> labels = torch.tensor([[-100, 1, 2, -100, 3, 4]])
        >>> out = document_mean_loss(logits, labels, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]))
        >>> int(out["num_documents"]), int(out["num_tokens"])
        (2, 4)
    """
    _check_logits(logits, labels)
    documents = labels.numel()  # at most one document per label position; each one's number, over all rows:
    document = (torch.cumsum(document_starts(labels, position_ids, document_ids).reshape(-1), 0) - 1).view(labels.shape)
    if shift:
        logits, labels, document = logits[..., :-1, :], labels[..., 1:], document[..., 1:]
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    targets = labels.reshape(-1)
    token_loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets, ignore_index=ignore_index, reduction="none"
    )
    supervised = targets != ignore_index
    loss, num_documents = _mean_over_documents(token_loss, supervised, document.reshape(-1), documents)
    return {"loss": loss, "num_documents": num_documents, "num_tokens": supervised.sum(dtype=torch.int64)}


def _mean_over_documents(
    token_loss: Tensor, supervised: Tensor, document: Tensor, documents: int
) -> tuple[Tensor, Tensor]:
    per_document = torch.zeros(documents, dtype=torch.int64, device=document.device)
    per_document.index_add_(0, document, supervised.to(torch.int64))  # the supervised tokens of each document
    num_documents = (per_document > 0).sum()
    # Each supervised token weighs 1 / (its document's tokens): the weighted sum is the sum of the documents' means.
    weight = supervised.to(token_loss.dtype) / per_document[document].clamp(min=1).to(token_loss.dtype)
    return (token_loss * weight).sum() / num_documents.clamp(min=1).to(token_loss.dtype), num_documents


def _check_logits(logits: object, labels: Tensor) -> None:
    check_labels(labels)
    if not isinstance(logits, Tensor) or not logits.is_floating_point():
        found = logits.dtype if isinstance(logits, Tensor) else type(logits).__name__
        raise TypeError(f"`logits` must be a floating-point tensor of shape (..., T, V), got {found}.")
    if labels.ndim == 0 or tuple(logits.shape[:-1]) != tuple(labels.shape):
        raise ValueError(
            f"`logits` must have the labels' shape and the vocabulary, (..., T, V): labels {tuple(labels.shape)} need"
            f" logits {(*labels.shape, 'V')}, got {tuple(logits.shape)}. Pass unshifted logits and labels of one"
            " batch (`shift=` says whether the loss shifts them)."
        )
