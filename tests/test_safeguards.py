"""Safeguards in real fits: runaway skips, hostile counts, accumulation schedules."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import (
    ListDataset,
    TinyLM,
    fit,
    make_examples,
    make_trainer,
    params_vector,
    random_lengths,
    relative_error,
    sgd_reference,
)
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from torch.utils.data import DataLoader

from lightning_accum import AccumulationStrategy


def test_gradient_accumulation_scheduler_keeps_groups_exact_on_both_sides() -> None:
    # Epoch 0 with A = 2, epoch 1 with A = 3 (Lightning's GradientAccumulationScheduler): 6 micro-batches of 2.
    examples = make_examples(random_lengths(12, seed=30), seed=30)
    model = TinyLM(lr=0.5)
    groups = [examples[0:4], examples[4:8], examples[8:12], examples[0:6], examples[6:12]]
    expected = sgd_reference(model, groups, lr=0.5)
    scheduler = GradientAccumulationScheduler({0: 2, 1: 3})
    trainer = fit(model, examples, batch_size=2, accumulate=1, callbacks=[scheduler], max_epochs=2)
    assert relative_error(params_vector(model), expected) < 1e-5
    ledger = trainer.strategy.ledger
    assert (ledger.updates_applied, ledger.partial_groups, ledger.microbatches) == (5, 0, 12)


class _AlwaysNaN(TinyLM):
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        out["loss"] = out["loss"] * float("nan")
        return out


def test_nan_in_every_group_stops_after_max_consecutive_skips() -> None:
    strategy = AccumulationStrategy(max_consecutive_skips=3)
    with (
        pytest.warns(UserWarning, match=r"skipped update \d"),
        pytest.raises(RuntimeError, match=r"3 consecutive updates were skipped \(the last for 'nonfinite'"),
    ):
        fit(_AlwaysNaN(), make_examples([4] * 20), batch_size=2, accumulate=2, strategy=strategy)
    ledger = strategy.ledger
    assert (ledger.updates_attempted, ledger.updates_applied, ledger.updates_skipped["nonfinite"]) == (3, 0, 3)
    with pytest.raises(ValueError, match=r"`max_consecutive_skips` must be a positive int or None, got 0"):
        AccumulationStrategy(max_consecutive_skips=0)


def test_an_applied_update_resets_the_consecutive_count() -> None:
    class _NaNEveryOther(TinyLM):
        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
            out = super().training_step(batch, batch_idx)
            if (batch_idx // 2) % 2 == 0:
                out["loss"] = out["loss"] * float("nan")
            return out

    strategy = AccumulationStrategy(max_consecutive_skips=2)
    with pytest.warns(UserWarning, match=r"skipped update"):
        fit(_NaNEveryOther(), make_examples([4] * 16), batch_size=2, accumulate=2, strategy=strategy)
    assert (strategy.ledger.updates_applied, strategy.ledger.updates_skipped["nonfinite"]) == (2, 2)


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (2.5, TypeError, r"`num_tokens` must be an int or a 0-d integer tensor, got float"),
        (True, TypeError, r"`num_tokens` must be an integer count, got a boolean"),
        (-1, ValueError, r"`num_tokens` must be >= 0, got -1"),
        (torch.tensor(float("nan")), TypeError, r"got a tensor of dtype torch.float32"),
        (torch.tensor(-3), ValueError, r"A negative `num_tokens`, `num_samples` or `num_documents` was reported"),
        (torch.tensor(3, device="meta"), ValueError, r"`num_tokens` is a tensor on the meta device"),
    ],
)
def test_hostile_token_counts_in_a_real_run(value: object, error: type[Exception], match: str) -> None:
    class _Reports(TinyLM):
        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
            return {"loss": self.mean_loss(batch), "num_tokens": value}

    model = _Reports()
    before = params_vector(model)
    with pytest.raises(error, match=match):
        fit(model, make_examples([3, 4, 5, 6]), batch_size=1, accumulate=2)
    assert torch.equal(params_vector(model), before)  # nothing was applied


def test_samples_that_cannot_be_inferred_under_normalize_samples_in_a_real_run() -> None:
    def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        batch = {key: torch.stack([item[key] for item in items]) for key in items[0]}
        batch["boundaries"] = torch.arange(len(items) + 1)  # another leading size: the sample count is ambiguous
        return batch

    model = TinyLM(report="loss")
    before = params_vector(model)
    trainer = make_trainer(strategy=AccumulationStrategy(normalize="samples"), accumulate_grad_batches=2)
    loader = DataLoader(ListDataset(make_examples([3, 4, 5, 6])), batch_size=2, collate_fn=collate)
    with pytest.raises(ValueError, match=r"number of samples of this micro-batch cannot be inferred .* 'num_samples'"):
        trainer.fit(model, loader)
    assert torch.equal(params_vector(model), before)


# ---------------------------------------------------------------------------- replicas that disagree
