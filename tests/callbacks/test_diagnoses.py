"""callbacks/diagnoses: what AccumulationCheck's measurements most likely mean, one diagnosis or note per symptom."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ListDataset, TinyLM, fit, run_ddp
from torch.utils.data import DataLoader

from callbacks.test_check import A, _checked_ddp_fit, _DividesByA, _hf, examples
from lightning_accum import AccumulationCheck, AccumulationCheckError


def test_loss_divided_by_a_twice() -> None:
    with pytest.raises(
        AccumulationCheckError, match=r"the loss is divided by A twice: the group gradient is 0\.25\d* ≈ 1/4"
    ):
        fit(_DividesByA(), examples(), batch_size=2, accumulate=A, callbacks=[AccumulationCheck()])


def test_mean_of_means_without_token_counts() -> None:
    with pytest.raises(
        AccumulationCheckError, match=r"token weighting is missing: micro-batches are weighted by samples"
    ):
        fit(TinyLM(report="loss"), examples(), batch_size=2, accumulate=A, callbacks=[AccumulationCheck()])


class _MicroBatchSchedule(TinyLM):
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        # The classic mistake: the schedule's length in micro-batches (here 2 updates x 4 = 8 batches).
        micro_batches = int(self.trainer.estimated_stepping_batches) * self.trainer.accumulate_grad_batches
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=micro_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def test_schedule_counted_in_micro_batches_warns() -> None:
    with pytest.warns(UserWarning, match=r"OneCycleLR\.total_steps=8 counts micro-batches .* \(2 updates\)"):
        fit(_MicroBatchSchedule(), examples(), batch_size=2, accumulate=A, callbacks=[AccumulationCheck()])


def _ddp_same_examples(rank: int, folder: str) -> None:
    # No distributed sampler: both replicas read the same examples.
    loader = DataLoader(ListDataset(examples(8)), batch_size=2)
    _checked_ddp_fit(f"{folder}/rank{rank}.json", AccumulationCheck(), TinyLM(), loader, False, "warnings")


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_ddp_warns_on_undistributed_sampler_and_identical_examples(tmp_path: Path) -> None:
    run_ddp(_ddp_same_examples, str(tmp_path))
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert any("not a DistributedSampler" in w for w in result["warnings"])
    assert any("replicas received identical first micro-batches" in w for w in result["warnings"])
    assert result["error"] < 1e-5  # the group still matches one batch of all replicas' examples


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_naive_count_for_a_shifted_loss_is_named_as_the_shift(precision: str) -> None:
    hf = _hf()
    with pytest.raises(AccumulationCheckError, match=r"the token count is off by the shift.*causal_lm_tokens") as info:
        hf.fit_hf(
            hf.HFCausalLM(count="naive"),
            hf.sequences(16, seed=3),
            batch_size=2,
            accumulate=A,
            callbacks=[AccumulationCheck()],
            precision=precision,
        )
    # The check measured in float32 (autocast off) against its tight default tolerance, also under bf16.
    assert "tolerance 1.0e-04" in str(info.value)


def test_one_sequence_per_microbatch_without_counts_is_missing_token_weighting() -> None:
    # m = 1 and a loss only: no micro-batch holds padding, yet the update is a mean of per-sequence means.
    hf = _hf()
    with pytest.raises(
        AccumulationCheckError,
        match=r"token weighting is missing: micro-batches are weighted by samples.*weighted by shifted tokens"
        r".*the error falls to .*causal_lm_tokens",
    ):
        hf.fit_hf(
            hf.HFCausalLM(count="loss"),
            hf.sequences(8, seed=3),
            batch_size=1,
            accumulate=A,
            callbacks=[AccumulationCheck()],
        )


def test_a_check_at_one_microbatch_says_what_it_could_not_check(caplog: pytest.LogCaptureFixture) -> None:
    check = AccumulationCheck()
    with caplog.at_level("INFO"):
        fit(TinyLM(), examples(8), batch_size=2, accumulate=1, callbacks=[check])
    assert check.result is not None and check.result.passed
    assert any("not the weighting of micro-batches" in note for note in check.result.notes)
    assert "1 micro-batch(es) match one batch" in caplog.text and "not the weighting of micro-batches" in caplog.text
    accumulated = AccumulationCheck()
    fit(TinyLM(), examples(8), batch_size=2, accumulate=A, callbacks=[accumulated])
    assert accumulated.result is not None and accumulated.result.notes == []  # SGD, A = 4: nothing to add


def test_an_adam_type_optimizer_gets_the_note_on_float32_amplification() -> None:
    check = AccumulationCheck()
    fit(TinyLM(lr=0.1, optimizer="adamw"), examples(8), batch_size=2, accumulate=A, callbacks=[check])
    assert check.result is not None and check.result.passed
    assert [note for note in check.result.notes if note.startswith("AdamW divides each element")]
