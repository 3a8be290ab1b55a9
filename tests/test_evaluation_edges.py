"""Evaluation at its edges: whatever an evaluation step returns runs as under Lightning's strategies; a rank with no
validation batch neither hangs nor costs the others their value; repeated examples and an empty set are said; replicas
that disagree stop alike. Multi-process cases run 2 real processes over gloo (torchrun-like, `run_ddp`)."""

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
from helpers import IGNORE, ListDataset, TinyLM, make_examples, make_trainer, reference_loss, run_ddp
from lightning.pytorch.callbacks import ModelCheckpoint
from test_evaluation import LENGTHS
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset

from lightning_accum import AccumulationStrategy, DDPAccumulationStrategy


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


def _trainer(strategy: Any = "accum", **kwargs: Any) -> L.Trainer:
    return make_trainer(**{"strategy": strategy, "num_sanity_val_steps": 2, **kwargs})  # Lightning's sanity check


def _loader(examples: list[dict[str, Tensor]], batch_size: int = 4) -> DataLoader:
    return DataLoader(ListDataset(examples), batch_size=batch_size)


@pytest.mark.parametrize("kind", ["predictions", "per_sample", "float", "float_loss", "dict", "none"])
def test_what_lightning_accepts_from_an_evaluation_step_runs_as_under_lightning(kind: str) -> None:
    examples = make_examples(LENGTHS[:12], seed=1)
    outcomes = {}
    for strategy in ("auto", "accum"):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            trainer = _trainer(strategy, num_sanity_val_steps=2, limit_val_batches=2)
            trainer.fit(Returns(kind), _loader(examples), _loader(examples))
            (validated,) = trainer.validate(Returns(kind), _loader(examples))
            (tested,) = trainer.test(Returns(kind), _loader(examples))
        outcomes[strategy] = (validated, tested, trainer.callback_metrics)
        assert not [w for w in seen if "lightning_accum" in str(w.message) or "accum/" in str(w.message)]
    lightning, ours = outcomes["auto"], outcomes["accum"]
    assert ours[0] == lightning[0] and set(ours[1]) == set(lightning[1])  # the same metrics, no accum/* among them
    assert not [key for key in ours[2] if key.startswith("accum/")]


def test_the_one_line_says_what_the_step_returns(caplog: pytest.LogCaptureFixture) -> None:
    examples = make_examples(LENGTHS[:8], seed=2)
    trainer = _trainer()
    with caplog.at_level("INFO", logger="lightning.pytorch.utilities.rank_zero"):
        trainer.validate(Returns("predictions"), _loader(examples))
        trainer.validate(Returns("predictions"), _loader(examples))
    lines = [r.getMessage() for r in caplog.records if "accum/val_loss` is not logged" in r.getMessage()]
    assert len(lines) == 1 and "a tensor of shape (4, 2)" in lines[0]
    assert trainer.strategy.evaluation_findings["validate"] == lines[0].removeprefix("lightning_accum: ")  # type: ignore[attr-defined]


def test_a_loss_without_the_runs_count_is_still_a_warning() -> None:
    trainer = _trainer(AccumulationStrategy(normalize="tokens"))
    with pytest.warns(UserWarning, match="returns a loss without a token count"):
        (result,) = trainer.validate(Returns("no_counts"), _loader(make_examples(LENGTHS[:8], seed=3)))
    assert "accum/val_loss" not in result


def test_a_set_without_supervised_tokens_says_so_and_is_nan() -> None:
    examples = make_examples(LENGTHS[:8], seed=4)
    for example in examples:
        example["labels"][:] = IGNORE
    with pytest.warns(UserWarning, match=r"`accum/val_loss` is NaN: the validate set holds no tokens at all"):
        (result,) = _trainer().validate(Returns("tokens"), _loader(examples))
    assert math.isnan(result["accum/val_loss"])
    assert math.isnan(result["accum/val_perplexity"])  # exp(NaN), not the overflow guard's inf


def test_a_negative_count_given_as_a_tensor_is_an_error_at_the_end_of_the_loop() -> None:
    # An int below zero is refused at its step; a tensor's sign is read with the loop's one reduction.
    with pytest.raises(ValueError, match=r"negative `num_tokens` or `num_samples` was reported by `validation_step`"):
        _trainer().validate(Returns("negative"), _loader(make_examples(LENGTHS[:8], seed=4)))


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
    return _trainer(strategy, devices=2, **kwargs)


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
    trainer = _trainer(
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
    trainer = _trainer(enable_checkpointing=True, callbacks=[checkpoint], max_epochs=2, num_sanity_val_steps=0)
    model = Returns("tokens")
    trainer.fit(model, _loader(examples), _loader(examples[:9]))
    assert checkpoint.best_model_score is not None
    assert float(checkpoint.best_model_score) == pytest.approx(float(trainer.callback_metrics["accum/val_loss"]))


def test_a_checkpoint_name_with_the_keys_slash_is_said_and_the_recipe_writes_flat_files(tmp_path: Path) -> None:
    examples = make_examples(LENGTHS, seed=9)
    trap = ModelCheckpoint(dirpath=tmp_path / "trap", monitor="accum/val_loss", filename="{epoch}-{accum/val_loss:.4f}")
    trainer = _trainer(enable_checkpointing=True, callbacks=[trap], max_epochs=1, num_sanity_val_steps=0)
    with pytest.warns(UserWarning, match=r"makes a sub-folder per checkpoint.*auto_insert_metric_name=False"):
        trainer.fit(Returns("tokens"), _loader(examples), _loader(examples[:9]))
    assert not list((tmp_path / "trap").glob("*.ckpt"))  # Lightning's behaviour: the file sits in a sub-folder
    recipe = ModelCheckpoint(
        dirpath=tmp_path / "flat",
        monitor="accum/val_loss",
        filename="epoch={epoch}-val_loss={accum/val_loss:.4f}",
        auto_insert_metric_name=False,
        save_top_k=1,
    )
    trainer = _trainer(enable_checkpointing=True, callbacks=[recipe], max_epochs=3, num_sanity_val_steps=0)
    trainer.fit(Returns("tokens"), _loader(examples), _loader(examples[:9]))
    files = list((tmp_path / "flat").iterdir())
    assert len(files) == 1 and files[0].suffix == ".ckpt"  # top-k evicted the others; no folder is left behind
    assert files[0].name == f"epoch={recipe.best_model_path.split('epoch=')[1].split('-')[0]}-val_loss=" + (
        f"{float(recipe.best_model_score):.4f}.ckpt"
    )


class SeveralLoaders(Returns):
    def validation_step(self, batch: dict[str, Tensor], batch_idx: int, dataloader_idx: int = 0) -> Any:
        return super().validation_step(batch, batch_idx)
