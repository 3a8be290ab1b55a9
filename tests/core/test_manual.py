"""Manual optimization under the accumulation strategies: Lightning's behaviour when the loop does not report
micro-batches, and exact weighting through `strategy.accumulate` / `strategy.close_group` when it does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    IGNORE,
    ListDataset,
    RecordOnRanks,
    ResumableLoader,
    TinyLM,
    fit,
    load_ranks,
    make_examples,
    make_trainer,
    params_vector,
    random_lengths,
    relative_error,
    sgd_reference,
)
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins import MixedPrecision
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_accum import AccumulationReport, AxisLogger
from lightning_accum.callbacks.report import REPORT_FILENAME


class ManualLM(TinyLM):
    """A manual loop with exact accumulation: each batch split into `pieces` micro-batches, one group (update)
    every `batches_per_group` batches, non-final micro-batches' forward and backward without replica sync."""

    def __init__(
        self,
        pieces: int = 1,
        batches_per_group: int = 1,
        group_size: int | None = None,
        poison: tuple[int, float] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False
        self.pieces, self.batches_per_group, self.group_size, self.poison = (
            pieces,
            batches_per_group,
            group_size,
            poison,
        )
        self.records: list[Any] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        strategy = self.trainer.strategy
        optimizer = self.optimizers()
        closes = (batch_idx + 1) % self.batches_per_group == 0
        chunks = [
            dict(zip(batch, parts, strict=True))
            for parts in zip(*(v.tensor_split(self.pieces) for v in batch.values()), strict=True)
        ]
        for i, micro in enumerate(chunks):
            last = closes and i == len(chunks) - 1
            with strategy.no_backward_sync(enabled=not last):  # type: ignore[attr-defined]
                loss = self.mean_loss(micro)
                if self.poison is not None and batch_idx // self.batches_per_group == self.poison[0]:
                    loss = loss * self.poison[1]
                tokens = (micro["labels"] != IGNORE).sum()
                tensor = strategy.accumulate(loss, num_tokens=tokens, batch=micro, group_size=self.group_size)  # type: ignore[attr-defined]
                self.manual_backward(tensor)
        if closes:
            self.records.append(strategy.close_group(optimizer))  # type: ignore[attr-defined]
            optimizer.step()  # type: ignore[union-attr]
            optimizer.zero_grad()  # type: ignore[union-attr]


class PoisonedAuto(TinyLM):
    """The automatic-optimization twin of ManualLM(poison=...)."""

    def __init__(self, poison: tuple[int, float] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.poison = poison

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        if self.poison is not None and batch_idx // self.trainer.accumulate_grad_batches == self.poison[0]:
            out["loss"] = out["loss"] * self.poison[1]
        return out


class PlainManual(TinyLM):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        optimizer = self.optimizers()
        self.manual_backward(self.mean_loss(batch))
        optimizer.step()  # type: ignore[union-attr]
        optimizer.zero_grad()  # type: ignore[union-attr]

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]

    def on_train_batch_end(self, *args: Any) -> None:
        self.lr_schedulers().step()  # type: ignore[union-attr]


def test_a_plain_manual_loop_runs_as_with_lightnings_strategy() -> None:
    examples = make_examples(random_lengths(6, seed=4), seed=4)
    runs = {}
    for strategy in ("auto", "accum"):
        model = PlainManual(lr=0.5)
        trainer = fit(model, examples, batch_size=2, accumulate=1, strategy=strategy)
        runs[strategy] = (params_vector(model), trainer.optimizers[0].param_groups[0]["lr"], trainer.global_step)
    assert torch.equal(runs["auto"][0], runs["accum"][0])
    assert runs["auto"][1:] == runs["accum"][1:] == (0.5 * 0.5**3, 3)  # the user's own scheduler steps, untouched


@pytest.mark.parametrize("pieces", [1, 2, 4])
def test_exact_updates_whatever_the_split_against_a_float64_reference(pieces: int) -> None:
    examples = make_examples(random_lengths(16, seed=8), seed=8)
    model = ManualLM(pieces=pieces, batches_per_group=2, seed=8)
    expected = sgd_reference(model, [examples[:8], examples[8:]])
    trainer = fit(model, examples, batch_size=4, accumulate=1)
    assert relative_error(params_vector(model), expected) < 1e-5
    ledger = trainer.strategy.ledger  # type: ignore[attr-defined]
    assert (ledger.updates_applied, ledger.microbatches, ledger.samples) == (2, 4 * pieces, 16)
    assert ledger.tokens == sum(int((e["labels"] != IGNORE).sum()) for e in examples)
    assert model.records[-1] is ledger.last_group and model.records[-1].applied
    assert trainer.global_step == 2


@pytest.mark.parametrize("pieces", [1, 3])
def test_precision_64_true_is_float64_exact_with_the_default_dtype_at_float32(pieces: int) -> None:
    # A float32-built module that the precision plugin converts; the close's factor in the gradients' float64.
    assert torch.get_default_dtype() == torch.float32
    examples = make_examples(random_lengths(18, seed=9), seed=9)
    model = ManualLM(pieces=pieces, batches_per_group=3, seed=9, lr=0.5)
    expected = sgd_reference(model, [examples[:9], examples[9:]], lr=0.5)
    fit(model, examples, batch_size=3, accumulate=1, precision="64-true")
    assert relative_error(params_vector(model), expected) < 1e-12


def fp16() -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))


@pytest.mark.parametrize(
    ("precision", "poison", "reason"), [("fp16", float("inf"), "overflow"), ("32", float("nan"), "nonfinite")]
)
def test_the_manual_api_gives_the_automatic_paths_updates_and_skips(precision: str, poison: float, reason: str) -> None:
    examples = make_examples([5] * 16, seed=13)

    def options() -> dict[str, Any]:  # a fresh GradScaler for each run
        return {"plugins": [fp16()]} if precision == "fp16" else {}

    auto = PoisonedAuto(poison=(1, poison), lr=0.1)
    warns = pytest.warns(UserWarning, match="skipped update 2") if reason == "nonfinite" else _nothing()
    with warns:
        auto_trainer = fit(auto, examples, batch_size=2, accumulate=2, **options())
    manual = ManualLM(batches_per_group=2, group_size=2, poison=(1, poison), lr=0.1)
    warns = pytest.warns(UserWarning, match="skipped update 2") if reason == "nonfinite" else _nothing()
    with warns:
        manual_trainer = fit(manual, examples, batch_size=2, accumulate=1, **options())
    ledger = manual_trainer.strategy.ledger  # type: ignore[attr-defined]
    assert ledger == auto_trainer.strategy.ledger  # type: ignore[attr-defined]
    assert (ledger.updates_attempted, ledger.updates_applied, ledger.updates_skipped[reason]) == (4, 3, 1)
    assert [r.skip_reason for r in manual.records] == [None, reason, None, None]
    torch.testing.assert_close(params_vector(manual), params_vector(auto), rtol=1e-6, atol=1e-7)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: Any) -> None:
        return None


def test_axis_logger_and_report_work_on_a_manual_loop(tmp_path: Path) -> None:
    examples = make_examples(random_lengths(12, seed=2), seed=2)
    trainer = make_trainer(
        logger=TensorBoardLogger(tmp_path, name="tb", version=0),
        callbacks=[AxisLogger(axis="tokens"), AccumulationReport()],
        log_every_n_steps=1,
    )
    from helpers import ListDataset
    from torch.utils.data import DataLoader

    trainer.fit(ManualLM(pieces=2, batches_per_group=2, lr=0.5), DataLoader(ListDataset(examples), batch_size=3))
    per_group = [sum(int((e["labels"] != IGNORE).sum()) for e in examples[i : i + 6]) for i in (0, 6)]
    acc = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("accum/loss")] == [per_group[0], sum(per_group)]
    record = json.loads((tmp_path / "tb" / "version_0" / REPORT_FILENAME).read_text())
    assert record["tokens"]["total"] == sum(per_group) == trainer.strategy.ledger.tokens  # type: ignore[attr-defined]
    assert record["updates"]["applied"] == 2


UNEQUAL = [6, 1, 5, 2, 6, 1, 4, 1, 6, 2, 5, 1, 6, 1, 3, 2]


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_a_manual_loop_under_two_process_ddp_matches_the_single_process_reference(tmp_path: Path) -> None:
    examples = make_examples(UNEQUAL, seed=21)
    model = ManualLM(pieces=2, batches_per_group=2, lr=0.5, seed=21)
    # m = 2 per rank, 2 batches per group, D = 2: each update sees 8 consecutive examples (rank 0 the long ones).
    expected = sgd_reference(model, [examples[:8], examples[8:]], lr=0.5)
    fit(
        model,
        examples,
        batch_size=2,
        accumulate=1,
        strategy="accum_ddp_spawn",
        devices=2,
        callbacks=[RecordOnRanks(str(tmp_path), "manual")],
    )
    ranks = load_ranks(str(tmp_path), "manual")
    for rank in ranks:
        assert relative_error(rank["params"], expected) < 1e-5
    assert ranks[0]["ledger"] == ranks[1]["ledger"]
    assert ranks[0]["ledger"]["tokens"] == sum(UNEQUAL) and ranks[0]["ledger"]["updates_applied"] == 2


class _SavesMidGroup(ManualLM):
    """ManualLM writing a checkpoint from `on_train_batch_end` of batch `save_at` (inside a group)."""

    def __init__(self, path: str, save_at: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.path, self.save_at = path, save_at

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.save_at:
            self.trainer.save_checkpoint(self.path)


def test_a_manual_loop_resumes_the_group_its_checkpoint_was_written_in_exactly(tmp_path: Path) -> None:
    # The same save resumes alike at both doors: a Trainer's manual loop reopens the carried group at the micro-batch
    # after the checkpoint (as `fabric.load` does) and its own `close_group` closes it with the carried gradient and
    # counters. Before, the Trainer dropped that group with a warning (2.5e-2 off the uninterrupted run).
    examples = make_examples(random_lengths(12, seed=21), seed=21)  # 6 batches of 2: groups of 3 batches

    def loader() -> ResumableLoader:
        return ResumableLoader(ListDataset(examples), batch_size=2)

    options = {"pieces": 2, "batches_per_group": 3, "seed": 21, "optimizer": "adamw", "lr": 0.05}
    whole = ManualLM(**options)
    whole_trainer = make_trainer()
    whole_trainer.fit(whole, loader())
    path = str(tmp_path / "mid.ckpt")
    stopped = _SavesMidGroup(path, save_at=1, **options)  # after 2 of the first group's 3 batches (4 micro-batches)
    make_trainer().fit(stopped, loader())
    entry = torch.load(path, weights_only=True)["lightning_accum"]
    assert entry["open_group_microbatches"] == 4 and entry["open_group"]["carried"]

    resumed = ManualLM(**options)
    trainer = make_trainer()
    trainer.fit(resumed, loader(), ckpt_path=path)
    assert relative_error(params_vector(resumed), params_vector(whole)) < 1e-6
    assert trainer.strategy.ledger == whole_trainer.strategy.ledger  # type: ignore[attr-defined]
    assert resumed.records[0].microbatches == 6 and resumed.records[0].applied  # the carried 4 and 2 new
