"""Evaluation on the training's footing: `accum/val_loss` is the token-weighted loss of the whole validation set over
every replica, equal on one and two processes and at every batch size, where Lightning's `self.log` mean of batch
means is not."""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from helpers import (
    IGNORE,
    EvalLM,
    ListDataset,
    RankStridedSampler,
    make_examples,
    make_trainer,
    reference_loss,
    run_ddp,
)
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_accum import AccumulationCheck, AxisLogger
from lightning_accum.evaluation_loss import WeightedMean
from lightning_accum.strategies.evaluation import EVALUATION_KEYS

# Lengths chosen so that batch means and token weighting disagree: long and short sequences in uneven batches.
LENGTHS = [6, 1, 1, 5, 2, 6, 1, 4, 6, 1, 3, 6, 2, 1, 5, 6, 1, 2, 6, 4]


def _trainer(devices: int = 1, **kwargs: Any) -> L.Trainer:
    options: dict[str, Any] = {
        "strategy": "accum" if devices == 1 else "accum_ddp",
        "devices": devices,
        "use_distributed_sampler": False,
        "num_sanity_val_steps": 2,  # Lightning's sanity check: its steps are evaluated too
    }
    return make_trainer(**{**options, **kwargs})


def _loader(examples: list[dict[str, Tensor]], batch_size: int, distributed: bool = False) -> DataLoader:
    sampler = RankStridedSampler(len(examples)) if distributed else None
    return DataLoader(ListDataset(examples), batch_size=batch_size, sampler=sampler)


def _validate(rank: int, folder: str) -> None:
    """Both batch sizes, on every rank of the run: `accum/val_loss` and Lightning's `val_loss`."""
    examples = make_examples(LENGTHS, seed=3)
    out = {}
    for batch_size in (3, 4):
        (result,) = _trainer(devices=2).validate(EvalLM(), _loader(examples, batch_size, distributed=True))
        out[batch_size] = result
    torch.save(out, os.path.join(folder, f"rank{rank}.pt"))


def test_weighted_mean_ignores_empty_batches_and_sums_its_units_exactly() -> None:
    mean = WeightedMean()
    mean.update(torch.tensor(2.0), torch.tensor(3))
    mean.update(torch.tensor(float("nan")), torch.tensor(0))  # the mean loss of a batch without tokens: 0/0
    mean.update(torch.tensor(5.0), 0)
    mean.update(torch.tensor(4.0), 2**40)
    assert mean.units.item() == 3 + 2**40  # an integer state: exact past float32's and float64's mantissas
    assert mean.compute().item() == pytest.approx((2.0 * 3 + 4.0 * 2**40) / (3 + 2**40), rel=1e-15)
    perplexity = WeightedMean(exp=True)
    perplexity.update(torch.tensor(math.log(7.0), dtype=torch.float64), 5)
    assert perplexity.compute().item() == pytest.approx(7.0, rel=1e-12)


@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_validation_loss_equals_the_whole_set_on_one_and_two_processes_at_two_batch_sizes(tmp_path: Path) -> None:
    examples = make_examples(LENGTHS, seed=3)
    expected = reference_loss(EvalLM(), examples)
    one = {m: _trainer().validate(EvalLM(), _loader(examples, m))[0] for m in (3, 4)}
    run_ddp(_validate, str(tmp_path))
    two = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    exact = [one[3], one[4], *(two[r][m] for r in range(2) for m in (3, 4))]
    for result in exact:  # 1 process and 2, batch 3 and 4, every rank: the float64 value to float32 rounding
        assert result["accum/val_loss"] == pytest.approx(expected, rel=2e-7)
        assert result["accum/val_perplexity"] == pytest.approx(math.exp(result["accum/val_loss"]), rel=1e-12)
    lightning = [one[3]["val_loss"], one[4]["val_loss"], two[0][3]["val_loss"], two[0][4]["val_loss"]]
    # Lightning's mean of batch means: a different value at every layout, none of them the set's loss.
    assert min(abs(v - expected) for v in lightning) > 1e-3
    assert len({round(v, 6) for v in lightning}) == 4
    print(f"\nvalidation loss, float64 reference {expected:.7f}")
    print("  accum/val_loss: " + ", ".join(f"{r['accum/val_loss']:.7f}" for r in exact))
    print(
        "  Lightning val_loss (1 process m=3, m=4; 2 processes m=3, m=4): " + ", ".join(f"{v:.7f}" for v in lightning)
    )


def test_test_step_and_several_validation_loaders_give_one_exact_value_each() -> None:
    examples = make_examples(LENGTHS, seed=4)
    first, second = examples[:8], examples[8:]
    model = EvalLM()
    results = _trainer().validate(model, [_loader(first, 3), _loader(second, 5)])
    for index, part in enumerate((first, second)):
        key = f"accum/val_loss/dataloader_idx_{index}"
        assert results[index][key] == pytest.approx(reference_loss(model, part), rel=2e-7)
    (tested,) = _trainer().test(model, _loader(examples, 6))
    assert tested["accum/test_loss"] == pytest.approx(reference_loss(model, examples), rel=2e-7)
    assert tested["accum/test_perplexity"] == pytest.approx(math.exp(tested["accum/test_loss"]), rel=1e-12)
    assert "accum/val_loss" not in tested and set(EVALUATION_KEYS["test"]) <= set(tested)


def test_a_batch_without_supervised_tokens_adds_nothing_and_no_nan() -> None:
    examples = make_examples(LENGTHS[:6], seed=5)
    for example in examples[3:]:  # the second batch of 3 has no supervised token: its mean loss is NaN
        example["labels"][:] = IGNORE
    model = EvalLM()
    (result,) = _trainer().validate(model, _loader(examples, 3))
    assert result["accum/val_loss"] == pytest.approx(reference_loss(model, examples[:3]), rel=2e-7)
    assert math.isnan(result["val_loss"])  # Lightning's mean of batch means takes the empty batch's 0/0


def test_validation_during_fit_is_written_on_the_tokens_axis(tmp_path: Path) -> None:
    train = make_examples(LENGTHS, seed=6)
    val = make_examples(LENGTHS[:9], seed=7)
    model = EvalLM()
    trainer = _trainer(
        logger=TensorBoardLogger(str(tmp_path), name="tb"),
        callbacks=[AxisLogger(axis="tokens")],
        accumulate_grad_batches=2,
        max_epochs=1,
        val_check_interval=4,  # after micro-batches 4 and 8 (updates 2 and 4)
        num_sanity_val_steps=0,
        log_every_n_steps=1,
    )
    points: list[tuple[int, float]] = []

    class Expected(L.Callback):  # the float64 loss of the set at each validation, and the tokens seen then
        def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            points.append((trainer.strategy.ledger.tokens, reference_loss(pl_module, val)))  # type: ignore[attr-defined]

    trainer.callbacks.append(Expected())
    trainer.fit(model, _loader(train, 2), _loader(val, 4))
    events = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"scalars": 0})
    events.Reload()
    written = [(e.step, e.value) for e in events.Scalars("accum/val_loss")]
    assert [x for x, _ in written] == [x for x, _ in points] and len(points) == 2
    for (_, value), (_, expected) in zip(written, points, strict=True):
        assert value == pytest.approx(expected, rel=2e-7)
    assert trainer.callback_metrics["accum/val_loss"].item() == pytest.approx(points[-1][1], rel=2e-7)


def test_a_sample_weighted_run_weights_a_plain_validation_loss_by_samples() -> None:
    examples = make_examples(LENGTHS[:7], seed=8)
    model = EvalLM(evaluation="loss")
    (result,) = _trainer(strategy=_strategy(normalize="samples")).validate(model, _loader(examples, 3))
    with torch.no_grad():
        means = [
            model.mean_loss({k: torch.stack([e[k] for e in examples[i : i + 3]]) for k in examples[0]})
            for i in (0, 3, 6)
        ]
    expected = (3 * float(means[0]) + 3 * float(means[1]) + 1 * float(means[2])) / 7
    assert result["accum/val_loss"] == pytest.approx(expected, rel=1e-6)
    assert "accum/val_perplexity" not in result  # not a per-token loss


def _strategy(**options: Any) -> Any:
    from lightning_accum import AccumulationStrategy

    return AccumulationStrategy(**options)


def test_steps_that_report_no_counts_log_nothing_and_say_why() -> None:
    examples = make_examples(LENGTHS[:6], seed=9)
    trainer = _trainer(strategy=_strategy(normalize="tokens"))
    with pytest.warns(UserWarning, match="returns a loss without a token count"):
        (result,) = trainer.validate(EvalLM(evaluation="loss"), _loader(examples, 3))
    assert "accum/val_loss" not in result and "val_loss" in result
    assert trainer.strategy.evaluation_findings["validate"] is not None  # type: ignore[attr-defined]
    with warnings.catch_warnings(record=True) as seen:  # a step that returns nothing (the common case): no warning
        warnings.simplefilter("always")
        (result,) = _trainer().validate(EvalLM(evaluation="none"), _loader(examples, 3))
    assert "accum/val_loss" not in result
    assert not [w for w in seen if "validation_step" in str(w.message)]


class Inconsistent(EvalLM):
    def validation_step(self, batch: dict[str, Tensor], batch_idx: int, dataloader_idx: int = 0) -> Any:
        output = super().validation_step(batch, batch_idx)
        return output if batch_idx == 0 else output["loss"]


def test_a_step_that_drops_its_count_after_the_first_batch_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"`validation_step` reported a loss and its tokens for its first batch"):
        _trainer().validate(Inconsistent(), _loader(make_examples(LENGTHS[:6]), 3))


def test_the_check_diagnoses_a_validation_step_that_reports_nothing() -> None:
    examples = make_examples(LENGTHS, seed=10)
    check = AccumulationCheck()
    trainer = _trainer(callbacks=[check], accumulate_grad_batches=2, max_epochs=1, limit_val_batches=2)
    with warnings.catch_warnings(record=True) as caught:  # ordinary Lightning code: information, not a warning
        warnings.simplefilter("always")
        trainer.fit(EvalLM(evaluation="none"), _loader(examples, 2), _loader(examples, 4))
    assert not [w for w in caught if "validation_step" in str(w.message)]
    assert check.result is not None and not any("validation_step" in w for w in check.result.warnings)
    assert any("`validation_step` returns no loss" in note for note in check.result.notes)
    clean = AccumulationCheck()
    trainer = _trainer(callbacks=[clean], accumulate_grad_batches=2, max_epochs=1, limit_val_batches=2)
    trainer.fit(EvalLM(), _loader(examples, 2), _loader(examples, 4))
    assert clean.result is not None and not any("validation_step" in w for w in clean.result.warnings)


def test_torchmetrics_mean_metric_is_not_the_weighted_mean_here() -> None:
    # The reason WeightedMean is kept (its docstring): MeanMetric without a host read per update ignores the weights.
    from torchmetrics.aggregation import MeanMetric

    from lightning_accum.evaluation_loss import WeightedMean

    ours, theirs = WeightedMean(), MeanMetric(nan_strategy="disable").set_dtype(torch.float64)
    for metric in (ours, theirs):
        metric.update(torch.tensor(3.0), 512)
        metric.update(torch.tensor(4.0), 1536)
    assert float(ours.compute()) == 3.75
    assert float(theirs.compute()) == 3.5  # unweighted: the day this is 3.75, MeanMetric can replace WeightedMean


def test_the_trainers_value_is_fabrics_evaluation_of_the_same_batches_bit_for_bit() -> None:
    # One implementation (issue #52): each loader of `accum/val_loss` is the `EvaluationLoss` a Fabric loop gets from
    # `fabric.strategy.evaluation()`, so the two doors give the same float64 value, not merely a close one.
    examples = make_examples(LENGTHS, seed=11)
    parts = (examples[:9], examples[9:])
    loaders = [_loader(parts[0], 4), _loader(parts[1], 3)]
    model = EvalLM()
    results = _trainer(precision="64-true", num_sanity_val_steps=0).validate(model, loaders, verbose=False)
    fabric = L.Fabric(strategy="accum", accelerator="cpu")
    for index, loader in enumerate(loaders):
        evaluation = fabric.strategy.evaluation()  # type: ignore[attr-defined]
        with torch.no_grad():
            for batch in loader:
                evaluation.add(model.mean_loss(batch), num_tokens=(batch["labels"] != IGNORE).sum())
        record = evaluation.compute()
        assert results[index][f"accum/val_loss/dataloader_idx_{index}"] == record.loss
        assert results[index][f"accum/val_perplexity/dataloader_idx_{index}"] == record.perplexity
        assert record.loss == pytest.approx(reference_loss(model, parts[index]), rel=1e-12)


def _loop_state(strategy: Any) -> dict[str, str]:
    """What the strategy's own parts hold between entry points, shape only (``None``, a type, a container's size): the
    run's records (the ledger, the evaluation findings, the messages said once) are not loop state."""

    def shape(value: Any) -> str:
        if value is None or isinstance(value, bool | int | float | str):
            return repr(value)
        if isinstance(value, list | dict | set | tuple):
            return f"{type(value).__name__}[{len(value)}]"
        return type(value).__name__

    parts = {
        "strategy": {k: getattr(strategy, k) for k in ("_trainer_ref", "_agreement", "_aside", "_failed")},
        "evaluation": {k: v for k, v in vars(strategy._evaluation).items() if k not in ("findings", "_said")},
        "group": {k: v for k, v in vars(strategy._core.group).items() if k != "engine"},
    }
    return {f"{part}.{name}": shape(value) for part, values in parts.items() for name, value in values.items()}


@pytest.mark.parametrize("entry", ["validate", "test", "fit"])
def test_an_evaluation_ends_with_its_loop_and_the_trainer_and_the_model_pickle(entry: str) -> None:
    # Before: the evaluation's run stayed on the strategy after its loop, holding a lambda: `pickle.dumps(trainer)` and
    # Lightning's own `test_model_torch_save` failed with "Can't pickle local object '_Run.loader.<locals>.<lambda>'".
    import io
    import pickle

    examples = make_examples(LENGTHS[:8], seed=4)
    model = EvalLM()
    trainer = _trainer(max_steps=2, val_check_interval=2)
    before = _loop_state(trainer.strategy)
    if entry == "fit":
        trainer.fit(model, _loader(examples, 2), _loader(examples, 4))
    else:
        getattr(trainer, entry)(model, _loader(examples, 4))
    assert "accum/val_loss" in trainer.callback_metrics or "accum/test_loss" in trainer.callback_metrics
    assert _loop_state(trainer.strategy) == before
    pickle.dumps(trainer)
    torch.save(model, io.BytesIO())
    torch.save(trainer.model, io.BytesIO())
