"""Evaluation on the training's footing: `accum/val_loss` is the token-weighted loss of the whole validation set over
every replica, equal on one and two processes and at every batch size, where Lightning's `self.log` mean of batch
means is not.

Evaluation at its edges: whatever an evaluation step returns runs as under Lightning's strategies; a rank with no
validation batch neither hangs nor costs the others their value; repeated examples and an empty set are said; replicas
that disagree stop alike. Multi-process cases run 2 real processes over gloo (torchrun-like, `run_ddp`).
"""

from __future__ import annotations

import datetime
import math
import os
import time
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
    TinyLM,
    make_examples,
    make_trainer,
    reference_loss,
    run_ddp,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset

from lightning_accum import AccumulationCheck, AccumulationStrategy, AxisLogger, DDPAccumulationStrategy
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
    # Why WeightedMean is kept (docs/internals.md): MeanMetric without a host read per update ignores the weights.
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
        "strategy": {"_agreement": strategy._agreement, "checking": strategy._core.checking},
        "run": {k: getattr(strategy._run, k) for k in ("trainer", "failed")},
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


class Returns(TinyLM):
    """`validation_step` / `test_step` return `kind`; `val_loss` is Lightning's own mean of batch means beside it."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Any:
        loss = self.mean_loss(batch)
        self.log("val_loss", loss)
        logits = self(batch["input_ids"])
        return {
            "predictions": logits[:, 0, :2],  # a [batch, 2] tensor
            "per_sample": logits.mean(dim=(1, 2)),  # a [batch] tensor
            "float": float(loss),
            "float_loss": {"loss": float(loss)},
            "dict": {"preds": logits.argmax(-1)},
            "no_counts": {"loss": loss, "logits": logits},
            "none": None,
            "tokens": {"loss": loss, "num_tokens": (batch["labels"] != IGNORE).sum()},
            "negative": {"loss": loss, "num_tokens": -(batch["labels"] != IGNORE).sum()},
        }[self.kind]

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> Any:
        return self.validation_step(batch, batch_idx)


def _edge_trainer(strategy: Any = "accum", **kwargs: Any) -> L.Trainer:
    return make_trainer(**{"strategy": strategy, "num_sanity_val_steps": 2, **kwargs})  # Lightning's sanity check


def _edge_loader(examples: list[dict[str, Tensor]], batch_size: int = 4) -> DataLoader:
    return DataLoader(ListDataset(examples), batch_size=batch_size)


@pytest.mark.parametrize("kind", ["predictions", "per_sample", "float", "float_loss", "dict", "none"])
def test_what_lightning_accepts_from_an_evaluation_step_runs_as_under_lightning(kind: str) -> None:
    examples = make_examples(LENGTHS[:12], seed=1)
    outcomes = {}
    for strategy in ("auto", "accum"):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            trainer = _edge_trainer(strategy, num_sanity_val_steps=2, limit_val_batches=2)
            trainer.fit(Returns(kind), _edge_loader(examples), _edge_loader(examples))
            (validated,) = trainer.validate(Returns(kind), _edge_loader(examples))
            (tested,) = trainer.test(Returns(kind), _edge_loader(examples))
        outcomes[strategy] = (validated, tested, trainer.callback_metrics)
        assert not [w for w in seen if "lightning_accum" in str(w.message) or "accum/" in str(w.message)]
    lightning, ours = outcomes["auto"], outcomes["accum"]
    assert ours[0] == lightning[0] and set(ours[1]) == set(lightning[1])  # the same metrics, no accum/* among them
    assert not [key for key in ours[2] if key.startswith("accum/")]


def test_the_one_line_says_what_the_step_returns(caplog: pytest.LogCaptureFixture) -> None:
    examples = make_examples(LENGTHS[:8], seed=2)
    trainer = _edge_trainer()
    with caplog.at_level("INFO", logger="lightning.pytorch.utilities.rank_zero"):
        trainer.validate(Returns("predictions"), _edge_loader(examples))
        trainer.validate(Returns("predictions"), _edge_loader(examples))
    lines = [r.getMessage() for r in caplog.records if "accum/val_loss` is not logged" in r.getMessage()]
    assert len(lines) == 1 and "a tensor of shape (4, 2)" in lines[0]
    assert trainer.strategy.evaluation_findings["validate"] == lines[0].removeprefix("lightning_accum: ")  # type: ignore[attr-defined]


def test_a_loss_without_the_runs_count_is_still_a_warning() -> None:
    trainer = _edge_trainer(AccumulationStrategy(normalize="tokens"))
    with pytest.warns(UserWarning, match="returns a loss without a token count"):
        (result,) = trainer.validate(Returns("no_counts"), _edge_loader(make_examples(LENGTHS[:8], seed=3)))
    assert "accum/val_loss" not in result


def test_a_set_without_supervised_tokens_says_so_and_is_nan() -> None:
    examples = make_examples(LENGTHS[:8], seed=4)
    for example in examples:
        example["labels"][:] = IGNORE
    with pytest.warns(UserWarning, match=r"`accum/val_loss` is NaN: the validate set holds no tokens at all"):
        (result,) = _edge_trainer().validate(Returns("tokens"), _edge_loader(examples))
    assert math.isnan(result["accum/val_loss"])
    assert math.isnan(result["accum/val_perplexity"])  # exp(NaN), not the overflow guard's inf


def test_a_negative_count_given_as_a_tensor_is_an_error_at_the_end_of_the_loop() -> None:
    # An int below zero is refused at its step; a tensor's sign is read with the loop's one reduction.
    with pytest.raises(
        ValueError, match=r"negative `num_tokens`, `num_samples` or `num_documents` was reported by `validation_step`"
    ):
        _edge_trainer().validate(Returns("negative"), _edge_loader(make_examples(LENGTHS[:8], seed=4)))


# ---------------------------------------------------------------------- several processes


class _RankData(IterableDataset):
    """An iterable validation set that rank 0 holds whole and rank 1 not at all (`empty_rank`), or split by rank."""

    def __init__(self, examples: list[dict[str, Tensor]], empty_rank: int | None) -> None:
        self.examples, self.empty_rank = examples, empty_rank

    def __iter__(self) -> Any:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if self.empty_rank is None:
            yield from self.examples[rank::2]
        elif rank != self.empty_rank:
            yield from self.examples


def _ddp(**kwargs: Any) -> L.Trainer:
    # A short process-group timeout: a test that would hang fails in seconds instead of 30 minutes.
    strategy = DDPAccumulationStrategy(timeout=datetime.timedelta(seconds=20))
    return _edge_trainer(strategy, devices=2, **kwargs)


def _empty_rank_worker(rank: int, folder: str, stage: str) -> None:
    examples = make_examples(LENGTHS, seed=5)
    val = DataLoader(_RankData(examples[:9], empty_rank=1), batch_size=4)
    model = Returns("tokens")
    start = time.monotonic()
    if stage == "fit":
        train = DataLoader(_RankData(examples, empty_rank=None), batch_size=2)
        trainer = _ddp(max_epochs=2, num_sanity_val_steps=0, limit_train_batches=2)
        values: list[tuple[float, float]] = []

        class Record(L.Callback):  # each validation's value, and the float64 loss of the 9 examples then
            def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
                value = float(trainer.callback_metrics["accum/val_loss"])
                values.append((value, reference_loss(pl_module, examples[:9])))  # type: ignore[arg-type]

        trainer.callbacks.append(Record())
        trainer.fit(model, train, val)
        result: dict[str, Any] = {"values": values}
    else:
        (result,) = _ddp().validate(model, val)
        result["expected"] = reference_loss(model, examples[:9])
    result["seconds"] = time.monotonic() - start
    torch.save(result, os.path.join(folder, f"{stage}-rank{rank}.pt"))


@pytest.mark.ddp
@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", ["fit", "validate"])
def test_a_rank_without_validation_batches_neither_hangs_nor_costs_the_others_their_value(
    stage: str, tmp_path: Path
) -> None:
    run_ddp(_empty_rank_worker, str(tmp_path), stage)
    ranks = [torch.load(tmp_path / f"{stage}-rank{r}.pt", weights_only=True) for r in range(2)]
    for result in ranks:  # both ranks hold the loss of the 9 examples rank 0 ran
        if stage == "fit":
            assert len(result["values"]) == 2  # one validation per epoch: the second one pairs up too
            for value, expected in result["values"]:
                assert value == pytest.approx(expected, rel=2e-7)
        else:
            assert result["accum/val_loss"] == pytest.approx(result["expected"], rel=2e-7)
        assert result["seconds"] < 60
    if stage == "fit":
        assert ranks[0]["values"] == ranks[1]["values"]


def _padded_worker(rank: int, folder: str) -> None:
    examples = make_examples(LENGTHS, seed=6)
    train = DataLoader(ListDataset(examples), batch_size=2)
    val = DataLoader(ListDataset(examples[:7]), batch_size=2)  # 7 examples on 2 ranks: Lightning's sampler pads 1
    trainer = _edge_trainer(
        DDPAccumulationStrategy(timeout=datetime.timedelta(seconds=20)),
        devices=2,
        num_sanity_val_steps=0,
        limit_train_batches=2,
        use_distributed_sampler=True,
    )
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(Returns("tokens"), train, val)
    messages = [str(w.message) for w in seen if "counts" in str(w.message) and "twice" in str(w.message)]
    torch.save({"messages": messages}, os.path.join(folder, f"padded-rank{rank}.pt"))


@pytest.mark.ddp
@pytest.mark.timeout(240)
def test_the_distributed_samplers_repeats_are_said_during_fit(tmp_path: Path) -> None:
    run_ddp(_padded_worker, str(tmp_path))
    zero, one = (torch.load(tmp_path / f"padded-rank{r}.pt", weights_only=True) for r in range(2))
    assert len(zero["messages"]) == 1 and not one["messages"]  # once, on rank zero
    assert "counts 1 example(s) twice" in zero["messages"][0] and "pads the 7 examples" in zero["messages"][0]
    assert "multiple of 2" in zero["messages"][0]


def _disagreeing_worker(rank: int, folder: str) -> None:
    examples = make_examples(LENGTHS, seed=7)
    val = DataLoader(_RankData(examples[:8], empty_rank=None), batch_size=2)
    model = Returns("tokens" if rank == 0 else "none")
    start = time.monotonic()
    try:
        _ddp().validate(model, val)
        error = None
    except RuntimeError as failure:
        error = str(failure)
    torch.save({"error": error, "seconds": time.monotonic() - start}, os.path.join(folder, f"disagree-rank{rank}.pt"))


@pytest.mark.ddp
@pytest.mark.timeout(240)
def test_replicas_whose_steps_return_different_things_stop_alike(tmp_path: Path) -> None:
    run_ddp(_disagreeing_worker, str(tmp_path))
    for rank in range(2):
        result = torch.load(tmp_path / f"disagree-rank{rank}.pt", weights_only=True)
        assert result["error"] is not None and "returned the training contract on 1 of 2 replicas" in result["error"]
        assert result["seconds"] < 60


def test_model_checkpoint_monitors_the_exact_value(tmp_path: Path) -> None:
    examples = make_examples(LENGTHS, seed=8)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="accum/val_loss", save_top_k=1)
    trainer = _edge_trainer(enable_checkpointing=True, callbacks=[checkpoint], max_epochs=2, num_sanity_val_steps=0)
    model = Returns("tokens")
    trainer.fit(model, _edge_loader(examples), _edge_loader(examples[:9]))
    assert checkpoint.best_model_score is not None
    assert float(checkpoint.best_model_score) == pytest.approx(float(trainer.callback_metrics["accum/val_loss"]))


def test_a_checkpoint_name_with_the_keys_slash_is_said_and_the_recipe_writes_flat_files(tmp_path: Path) -> None:
    examples = make_examples(LENGTHS, seed=9)
    trap = ModelCheckpoint(dirpath=tmp_path / "trap", monitor="accum/val_loss", filename="{epoch}-{accum/val_loss:.4f}")
    trainer = _edge_trainer(enable_checkpointing=True, callbacks=[trap], max_epochs=1, num_sanity_val_steps=0)
    with pytest.warns(UserWarning, match=r"makes a sub-folder per checkpoint.*auto_insert_metric_name=False"):
        trainer.fit(Returns("tokens"), _edge_loader(examples), _edge_loader(examples[:9]))
    assert not list((tmp_path / "trap").glob("*.ckpt"))  # Lightning's behaviour: the file sits in a sub-folder
    recipe = ModelCheckpoint(
        dirpath=tmp_path / "flat",
        monitor="accum/val_loss",
        filename="epoch={epoch}-val_loss={accum/val_loss:.4f}",
        auto_insert_metric_name=False,
        save_top_k=1,
    )
    trainer = _edge_trainer(enable_checkpointing=True, callbacks=[recipe], max_epochs=3, num_sanity_val_steps=0)
    trainer.fit(Returns("tokens"), _edge_loader(examples), _edge_loader(examples[:9]))
    files = list((tmp_path / "flat").iterdir())
    assert len(files) == 1 and files[0].suffix == ".ckpt"  # top-k evicted the others; no folder is left behind
    assert files[0].name == f"epoch={recipe.best_model_path.split('epoch=')[1].split('-')[0]}-val_loss=" + (
        f"{float(recipe.best_model_score):.4f}.ckpt"
    )


class SeveralLoaders(Returns):
    def validation_step(self, batch: dict[str, Tensor], batch_idx: int, dataloader_idx: int = 0) -> Any:
        return super().validation_step(batch, batch_idx)
