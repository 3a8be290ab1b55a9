"""The diagnoses of :class:`~lightning_accum.AccumulationCheck`: what its measurements most likely mean."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.data import DistributedSampler

from lightning_accum.strategies import ExactAccumulation
from lightning_accum.tokens import ignored_label_key

__all__ = [
    "ADAM_LIKE",
    "TOKEN_COUNTS",
    "diagnose",
    "first_nonfinite",
    "passed_notes",
    "replica_findings",
    "scheduler_findings",
]

#: The token counts the diagnosis tries: a causal LM's shifted count, and every unignored label position.
TOKEN_COUNTS = ("shifted tokens", "tokens")
#: Optimizers (by class name) that divide by the root of a second moment, besides torch's Adam and AdamW.
ADAM_LIKE = {"Adamax", "NAdam", "RAdam", "Adafactor", "Adam8bit", "AdamW8bit", "Adagrad"}


def diagnose(
    rel: float,
    ratio: float,
    tolerance: float,
    a: int,
    unit: str | None,
    ignore: int,
    batches: list[Any],
    alternatives: Mapping[str, float] | None = None,
) -> str:
    """Why the group's gradient is not the one-batch gradient (``alternatives``: each count's relative error)."""
    measured = f"relative error {rel:.3e} > tolerance {tolerance:.1e}, gradient ratio {ratio:.4f}"
    if a > 1 and abs(ratio - 1.0 / a) < 0.25 / a:
        return (
            f"the loss is divided by A twice: the group gradient is {ratio:.4f} ≈ 1/{a} of the one-batch gradient"
            f" ({measured}). Return the micro-batch's mean loss; the strategy does the normalization."
        )
    # Which token weighting reproduces the one-batch gradient (formed by the check from per-micro-batch
    # gradients), if any: it names the count the loss really averages over.
    matches = sorted((err, name) for name, err in (alternatives or {}).items() if name in TOKEN_COUNTS)
    best = matches[0][1] if matches and matches[0][0] <= tolerance else None
    index = "" if ignore == -100 else f", ignore_index={ignore}"
    shifted = f"lightning_accum.supervised_tokens(labels, shift=True{index})"
    unshifted = f"lightning_accum.supervised_tokens(labels, shift=False{index})"
    if unit == "tokens" and best == "shifted tokens":
        return (
            "the token count is off by the shift: the loss shifts the labels by one (as Hugging Face causal"
            " LMs do: it compares logits[:, :-1] with labels[:, 1:]), so it averages over"
            f" `(labels[..., 1:] != {ignore}).sum()` positions, one token fewer per sequence than the reported"
            f" `num_tokens`; weighted by that shifted count, the error falls to {matches[0][0]:.1e}"
            f" ({measured}). Report `num_tokens={shifted}`,"
            " or pass `count_tokens=lightning_accum.causal_lm_tokens` to the strategy."
        )
    if unit == "tokens" and best == "tokens":
        return (
            "the token count is off by the shift the other way: the loss compares every label position (no shift),"
            f" but the reported `num_tokens` is not `(labels != {ignore}).sum()`; weighted by that count, the"
            f" error falls to {matches[0][0]:.1e} ({measured}). Report `num_tokens={unshifted}` (or"
            " `count_tokens=lightning_accum.seq2seq_tokens`)."
        )
    if unit in ("samples", "batches") and (
        best is not None or any(ignored_label_key(batch, ignore) is not None for batch in batches)
    ):
        if best is not None:
            count = shifted if best == "shifted tokens" else unshifted
            evidence = f"weighted by {best} (`{count}`), the error falls to {matches[0][0]:.1e}"
        else:
            count = f"{shifted} (or shift=False when the loss does not shift the labels)"
            evidence = "the labels hold ignored positions"
        return (
            f"token weighting is missing: micro-batches are weighted by {unit}, so the update is a mean of"
            f" micro-batch means and depends on how examples are split; {evidence} ({measured}). Return"
            f" `{{'loss': loss, 'num_tokens': {count}}}` from `training_step`, or pass `count_tokens=` to the"
            " strategy (`lightning_accum.causal_lm_tokens` for a Hugging Face causal LM)."
        )
    return (
        f"the group gradient differs from the gradient of the same examples in one batch ({measured}). Check that"
        " `training_step` returns the mean loss over the units it reports, and that nothing in the model depends"
        " on the micro-batch composition."
    )


def first_nonfinite(module: LightningModule, grads: list[Tensor]) -> str:
    """The first parameter (in ``named_parameters`` order) whose gradient in ``grads`` is not finite."""
    for (name, _), grad in zip(module.named_parameters(), grads, strict=False):
        if not bool(torch.isfinite(grad).all()):
            return f"`{name}`"
    return "unknown"


def scheduler_findings(trainer: Trainer, accumulate: int) -> list[str]:
    """Step-interval schedulers whose length counts micro-batches instead of updates."""
    findings: list[str] = []
    if accumulate == 1 or not trainer.max_epochs or trainer.max_epochs < 0:
        return findings
    microbatches = trainer.num_training_batches * trainer.max_epochs
    if microbatches == float("inf"):
        return findings
    for config in trainer.lr_scheduler_configs:
        scheduler = config.scheduler
        if config.interval != "step":
            continue
        for attr in ("total_steps", "T_max"):
            length = getattr(scheduler, attr, None)
            updates = int(trainer.estimated_stepping_batches)
            if isinstance(length, int) and length >= int(microbatches) > updates:
                findings.append(
                    f"{type(scheduler).__name__}.{attr}={length} counts micro-batches ({int(microbatches)} in the"
                    f" run), but the schedule advances once per update ({updates} updates): it would cover only"
                    " 1/A of its course. Use `trainer.estimated_stepping_batches`."
                )
    return findings


def replica_findings(trainer: Trainer, batches: list[Any]) -> list[str]:
    """A training sampler that is not distributed, and replicas whose first micro-batches are the same."""
    findings = []
    loader = trainer.train_dataloader
    sampler = getattr(loader, "sampler", None)
    inner = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    if not isinstance(sampler, DistributedSampler) and not isinstance(inner, DistributedSampler):
        findings.append(
            "the training sampler is not a DistributedSampler: make sure every replica reads different examples"
            " (Lightning adds one with `use_distributed_sampler=True`)"
        )
    fingerprint = _fingerprint(batches[0]).reshape(1)
    everyone = trainer.strategy.all_gather(fingerprint).reshape(-1).tolist()
    if len(set(everyone)) < len(everyone):
        findings.append(
            "replicas received identical first micro-batches: the same examples on every replica add no"
            " information. Check the sampler (DistributedSampler) or the iterable dataset's sharding."
        )
    return findings


def passed_notes(microbatches: int, replicas: int, strategy: ExactAccumulation, optimizer: Optimizer) -> list[str]:
    """What a passed check does not say: see :attr:`CheckResult.notes`."""
    notes = []
    if microbatches == 1 and replicas == 1 and strategy.slicing.configured is None:
        notes.append(
            "with one micro-batch per update on one replica the group is the batch itself, so this compared the"
            " strategy's step path and the loss's scale, not the weighting of micro-batches; run the check with"
            " accumulate_grad_batches > 1 (or several replicas, or microbatch_size=) to check accumulation."
        )
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) or type(optimizer).__name__ in ADAM_LIKE:
        notes.append(
            f"{type(optimizer).__name__} divides each element by the root of its second moment, which magnifies"
            " float32 rounding where a gradient element is near zero: runs of other splits (m, A, D) start from"
            " gradients equal to ~1e-7 (this check) but their parameters may drift apart by far more over many"
            " updates, without any weighting error (the demo's transformer, 40 updates: 8e-6 relative with AdamW,"
            " 1e-8 with SGD). Compare gradients (this check), or SGD / float64 runs, to"
            " verify exactness (docs/concepts.md, 'How close is exact')."
        )
    return notes


def _fingerprint(batch: Any) -> Tensor:
    """A float64 number that differs between batches of different content."""
    if isinstance(batch, Tensor) and batch.numel() > 0:
        flat = batch.reshape(-1).to(torch.float64)
        return (flat * torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.float64)).sum()
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else []
    return sum((_fingerprint(v) for v in values), torch.zeros((), dtype=torch.float64))
