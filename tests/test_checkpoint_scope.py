"""State scoped to the entry point that made it: a checkpoint's ledger and open group reach only the `fit` resuming
from it (`validate` / `test` / `predict(ckpt_path=...)` restore the weights, as Lightning does), and a group a fit
left open ends with that fit."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    CheckpointAt,
    EvalLM,
    ListDataset,
    ResumableLoader,
    make_examples,
    make_trainer,
    params_vector,
    random_lengths,
)
from torch.utils.data import DataLoader

from lightning_accum.ledger import COUNTERS

# The module evaluates (for `validate` / `test`); the fits here have no validation loader.
pytestmark = pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`")

EXAMPLES = make_examples(random_lengths(16, seed=55), seed=55)  # 8 micro-batches of 2
A = 3


def _loader() -> ResumableLoader:
    return ResumableLoader(ListDataset(EXAMPLES), batch_size=2)


class _Evaluates(EvalLM):
    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        return self(batch["input_ids"])


def _counters(trainer: Any) -> dict[str, Any]:
    ledger = trainer.strategy.ledger
    return {name: getattr(ledger, name) for name in COUNTERS}


@pytest.mark.parametrize("entry", ["validate", "test", "predict"])
def test_an_evaluation_from_a_mid_group_checkpoint_leaves_the_next_fit_fresh(tmp_path: Path, entry: str) -> None:
    checkpoint = tmp_path / "at.ckpt"  # written after micro-batch 4, inside the group 3, 4, 5
    make_trainer(accumulate_grad_batches=A, callbacks=[CheckpointAt(checkpoint, at=4)]).fit(EvalLM(), _loader())
    assert torch.load(checkpoint, weights_only=True)["lightning_accum"]["open_group"]["microbatches"] == 2

    model = _Evaluates(seed=1)
    trainer = make_trainer(accumulate_grad_batches=A)
    run = getattr(trainer, entry)
    loader = DataLoader(ListDataset(EXAMPLES), batch_size=4)
    run(model, loader, ckpt_path=checkpoint)
    assert _counters(trainer) == _counters(make_trainer())  # the checkpoint's ledger was not restored
    trainer.fit(model, _loader())

    fresh = _Evaluates(seed=1)
    fresh.load_state_dict(torch.load(checkpoint, weights_only=True)["state_dict"])  # what `entry` restored
    fresh_trainer = make_trainer(accumulate_grad_batches=A)
    fresh_trainer.fit(fresh, _loader())
    # Before: the fit reopened the checkpoint's group (ledger 62 tokens / 22 micro-batches / 5 updates against 46 /
    # 16 / 4 in the repro; parameters 0.037 apart).
    assert _counters(trainer) == _counters(fresh_trainer)
    assert torch.equal(params_vector(model), params_vector(fresh))


class _FailsAt(EvalLM):
    def __init__(self, at: int | None) -> None:
        super().__init__()
        self.at = at

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if batch_idx == self.at:
            raise RuntimeError("planted failure inside a group")
        return super().training_step(batch, batch_idx)


class _StopsAt(EvalLM):
    """Asks the Trainer to stop after micro-batch `at` (Lightning then ends the fit there, inside a group)."""

    def __init__(self, at: int | None) -> None:
        super().__init__()
        self.at = at

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.at:
            self.trainer.should_stop = True


@pytest.mark.parametrize("how", ["exception", "stop"])
def test_a_group_a_fit_left_open_ends_with_that_fit_and_says_why(how: str) -> None:
    model: EvalLM = _FailsAt(at=4) if how == "exception" else _StopsAt(at=3)  # inside the group 3, 4, 5
    trainer = make_trainer(accumulate_grad_batches=A, max_epochs=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if how == "exception":
            with pytest.raises(RuntimeError, match="planted failure inside a group"):  # the user's error, on top
                trainer.fit(model, _loader())
        else:
            trainer.fit(model, _loader())
    stopped = [str(w.message) for w in caught if "stopped inside an accumulation group" in str(w.message)]
    # After an exception the exception says why (no warning that `-W error` would raise in its place).
    assert len(stopped) == (0 if how == "exception" else 1)
    if stopped:
        assert "its 1 micro-batch(es)" in stopped[0]
    assert trainer.strategy.engine.microbatches_in_group == 0  # type: ignore[attr-defined]
    assert trainer.strategy.ledger.microbatches == 3  # type: ignore[attr-defined]  # the first group only
    model.at = None  # type: ignore[attr-defined]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, _loader())
    # The second fit is not taken for one whose loader yielded fewer batches than its length announced.
    assert not [w for w in caught if "loader ended" in str(w.message) or "stopped inside" in str(w.message)]
