"""AccumulationCheck: one diagnosis per symptom of the seed checklist, on real `Trainer.fit` runs."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from helpers import ListDataset, TinyLM, fit, make_examples, make_trainer, params_vector, random_lengths, run_ddp
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader

from lightning_accum import AccumulationCheck, AccumulationCheckError, TokenWeightingWarning
from lightning_accum.callbacks.check import concat_microbatches

A = 4


def examples(n: int = 16, seed: int = 3) -> list[dict[str, torch.Tensor]]:
    return make_examples(random_lengths(n, seed=seed), seed=seed)


def test_a_correct_module_passes_and_training_is_unchanged() -> None:
    data = examples()
    check = AccumulationCheck()
    L.seed_everything(7)
    checked = TinyLM(lr=0.3, optimizer="adamw", seed=1)
    fit(checked, data, batch_size=2, accumulate=A, callbacks=[check], max_epochs=2)
    assert check.result is not None and check.result.passed
    assert check.result.relative_error < 1e-5 and check.result.ratio == pytest.approx(1.0, abs=1e-5)

    L.seed_everything(7)
    plain = TinyLM(lr=0.3, optimizer="adamw", seed=1)
    fit(plain, data, batch_size=2, accumulate=A, max_epochs=2)
    assert torch.equal(params_vector(checked), params_vector(plain))


@pytest.mark.parametrize("own_generator", [False, True], ids=["global-rng", "loader-generator"])
def test_shuffled_data_order_is_restored(own_generator: bool) -> None:
    data = examples(24)
    runs = []
    for with_check in (True, False):
        L.seed_everything(11)
        model = TinyLM(lr=0.3, seed=2)
        callbacks = [AccumulationCheck()] if with_check else []
        trainer = make_trainer(accumulate_grad_batches=3, callbacks=callbacks)
        generator = torch.Generator().manual_seed(5) if own_generator else None
        trainer.fit(model, DataLoader(ListDataset(data), batch_size=2, shuffle=True, generator=generator))
        runs.append((params_vector(model), [ids.clone() for ids in model.seen_input_ids[-12:]]))
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1], strict=True))  # same data order
    assert torch.equal(runs[0][0], runs[1][0])


class _DividesByA(TinyLM):
    """Divides its loss by accumulate_grad_batches itself, as Lightning's docs never ask: the seed's double division."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        out["loss"] = out["loss"] / self.trainer.accumulate_grad_batches
        return out


def test_strict_false_turns_failures_into_warnings() -> None:
    check = AccumulationCheck(strict=False)
    with (
        pytest.warns(UserWarning, match=r"AccumulationCheck failed:\n- token weighting is missing"),
        pytest.warns(TokenWeightingWarning, match=r"token weighting is probably intended"),  # then the run's own hint
    ):
        fit(TinyLM(report="loss"), examples(), batch_size=2, accumulate=A, callbacks=[check])
    assert check.result is not None and not check.result.passed


class _WithBatchNorm(TinyLM):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(8)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.bn(self.embed(input_ids).transpose(1, 2)).transpose(1, 2)
        return self.head(torch.tanh(hidden))


def test_batchnorm_is_named_as_a_warning_not_a_failure() -> None:
    check = AccumulationCheck()
    model = _WithBatchNorm()
    with pytest.warns(UserWarning, match=r"BatchNorm layers \(bn\) compute statistics per micro-batch"):
        fit(model, examples(), batch_size=2, accumulate=A, callbacks=[check])
    assert check.result is not None and check.result.passed and check.result.relative_error > 1e-4
    # num_batches_tracked counts training forward passes: the run's 8 micro-batches; the check's 5 were rolled back.
    assert model.bn.num_batches_tracked.item() == 8


class _KeepsLosses(TinyLM):
    def __init__(self) -> None:
        super().__init__()
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        self.losses.append(out["loss"])  # keeps every micro-batch's graph alive
        return out


def test_graph_connected_tensors_kept_on_the_module() -> None:
    with pytest.raises(
        AccumulationCheckError, match=r"`_KeepsLosses\.losses\[0\]` keeps a tensor attached to the autograd graph"
    ):
        fit(_KeepsLosses(), examples(), batch_size=2, accumulate=A, callbacks=[AccumulationCheck()])


class _DropoutLM(TinyLM):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(torch.tanh(self.embed(input_ids))))


def test_dropout_is_disabled_for_the_check() -> None:
    check = AccumulationCheck()
    model = _DropoutLM()
    fit(model, examples(), batch_size=2, accumulate=A, callbacks=[check])
    assert check.result is not None and check.result.passed and check.result.relative_error < 1e-5
    assert model.drop.training  # restored


def test_collate_for_structures_that_do_not_concatenate() -> None:
    assert concat_microbatches([{"x": torch.zeros(2, 3)}, {"x": torch.ones(1, 5)}])["x"].shape == (3, 5)
    with pytest.raises(TypeError, match=r"Cannot concatenate micro-batch items of type str .*collate="):
        concat_microbatches([{"name": "a"}, {"name": "b"}])
    with pytest.raises(ValueError, match=r"`tolerance` must be > 0, got 0"):
        AccumulationCheck(tolerance=0)


def _checked_ddp_fit(
    path: str,
    check: AccumulationCheck,
    model: L.LightningModule,
    loader: DataLoader,
    use_distributed_sampler: bool,
    field: str,
) -> None:
    """A 2-process `accum_ddp` fit (A = 2) under `check`, warnings recorded; this rank writes the check's `field`
    and its relative error to `path`."""
    trainer = make_trainer(
        strategy="accum_ddp",
        devices=2,
        accumulate_grad_batches=2,
        use_distributed_sampler=use_distributed_sampler,
        callbacks=[check],
    )
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        trainer.fit(model, loader)
    assert check.result is not None
    with open(path, "w") as f:
        json.dump({field: getattr(check.result, field), "error": check.result.relative_error}, f)


# ---------------------------------------------------------------------------- Hugging Face causal LMs


def _hf() -> Any:
    pytest.importorskip("transformers")
    import hf_models

    return hf_models


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_correct_count_passes_with_a_tight_tolerance(precision: str) -> None:
    # Autocast off for the check's passes: without it, bf16 rounding alone (3e-3 here) would exceed 1e-4.
    hf = _hf()
    check = AccumulationCheck()
    options: dict[str, Any] = {"precision": precision}
    if precision == "16-mixed":  # fp16 with a GradScaler, on the CPU
        options = {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]}
    trainer = hf.fit_hf(
        hf.HFCausalLM(count="helper"),
        hf.sequences(16, seed=3),
        batch_size=2,
        accumulate=A,
        callbacks=[check],
        **options,
    )
    assert check._tolerance(trainer) == 1e-4  # the default stays tight under mixed precision
    assert check.result is not None and check.result.passed and check.result.relative_error < 1e-5


def _ddp_hf_naive(rank: int, folder: str) -> None:
    import hf_models as hf

    loader = DataLoader(hf.sequences(16, seed=3), batch_size=2, collate_fn=hf.pad_collate)  # type: ignore[arg-type]
    # Lightning's distributed sampler: each replica reads its own share.
    check, model = AccumulationCheck(strict=False), hf.HFCausalLM(count="naive")
    _checked_ddp_fit(f"{folder}/rank{rank}.json", check, model, loader, True, "errors")


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_ddp_naive_count_for_a_shifted_loss_is_named_on_every_replica(tmp_path: Path) -> None:
    # The per-micro-batch gradients of every replica's micro-batches are weighed alike on each rank.
    _hf()
    run_ddp(_ddp_hf_naive, str(tmp_path))
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for result in results:
        assert len(result["errors"]) == 1 and result["errors"][0].startswith("the token count is off by the shift")
    assert results[0]["error"] == results[1]["error"] > 1e-4


def test_manual_optimization_is_named() -> None:
    from core.test_manual import ManualLM

    with pytest.raises(RuntimeError, match=r"AccumulationCheck calls `training_step` as automatic.*is False"):
        fit(ManualLM(), make_examples([3, 4]), batch_size=1, accumulate=1, callbacks=[AccumulationCheck()])


def _scheduled(stages: dict[int, int], module: L.LightningModule, check: AccumulationCheck) -> L.Trainer:
    from lightning_accum import AccumulationStrategy, BatchSchedule

    strategy = AccumulationStrategy(batch_schedule=BatchSchedule(stages, axis="samples"))
    trainer = make_trainer(strategy=strategy, callbacks=[check])
    trainer.fit(module, DataLoader(ListDataset(examples(16)), batch_size=2))
    return trainer


def test_under_a_schedule_the_check_runs_the_first_stages_group_and_names_the_stages_it_did_not_check() -> None:
    # m = 2: stages of 4, 8 and 16 samples are groups of A = 2, 4, 8. The check runs before the strategy sets the first
    # group's size; it asks the schedule, so it compares the run's first group of 2 micro-batches (not 1).
    check = AccumulationCheck()
    trainer = _scheduled({0: 4, 4: 8, 12: 16}, TinyLM(), check)
    assert check.result is not None and check.result.passed and check.result.microbatches == 2
    note = check.result.notes[0]
    assert note.startswith("under batch_schedule= the check ran one group of stage 0 (A = 2 micro-batch(es)")
    assert "the run's first group" in note and "Not checked: stage(s) 1 (A = 4), 2 (A = 8)." in note
    assert [s["stage"] for s in trainer.strategy.batch_stages] == [0, 1, 2]  # type: ignore[attr-defined]
    # A loss divided by `trainer.accumulate_grad_batches` is found at the checked stage: it reads A = 2 there, as in
    # the run (before, the check saw the Trainer's 1 and a group of one micro-batch, and passed).
    with pytest.raises(AccumulationCheckError, match=r"divided by A twice: the group gradient is 0\.5\d* ≈ 1/2"):
        _scheduled({0: 4, 4: 8, 12: 16}, _DividesByA(), AccumulationCheck())


def test_under_a_schedule_whose_first_stage_accumulates_nothing_the_check_takes_the_first_that_does() -> None:
    # m × D = 2 = stage 0's batch: its groups hold one micro-batch on one replica and check no weighting, so the check
    # runs stage 1's size (A = 2) on the loader's first examples.
    check = AccumulationCheck()
    _scheduled({0: 2, 6: 4, 10: 8}, TinyLM(), check)
    assert check.result is not None and check.result.passed and check.result.microbatches == 2
    note = check.result.notes[0]
    assert note.startswith("under batch_schedule= the check ran one group of stage 1 (A = 2 micro-batch(es)")
    assert "stage 0's groups hold one micro-batch on one replica" in note
    assert "Not checked: stage(s) 0 (A = 1), 2 (A = 4)." in note
