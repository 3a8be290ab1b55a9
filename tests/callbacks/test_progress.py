"""AxisProgressBar and AxisRichProgressBar: Lightning's TQDM and Rich bars counting the run's axis against a Horizon's
budget, and plain lines outside a terminal."""

from __future__ import annotations

import re
from typing import Any

import lightning as L
import pytest
from helpers import IGNORE, ListDataset, TinyLM, make_examples, make_trainer
from torch.utils.data import DataLoader

from lightning_accum import AxisProgressBar, AxisRichProgressBar, Horizon

LENGTHS = [6, 1, 5, 2, 6, 1, 4, 1, 6, 2, 5, 1, 6, 1, 3, 2] * 2
BUDGET = 80  # tokens: Horizon stops after the update that reaches it (the data holds 104)


class Validated(TinyLM):
    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        return {"loss": self.mean_loss(batch), "num_tokens": (batch["labels"] != IGNORE).sum()}


def _fit(bar: AxisProgressBar | AxisRichProgressBar, budget: int | None = BUDGET, **kwargs: Any) -> L.Trainer:
    callbacks: list[L.Callback] = [bar]
    if budget is not None:
        callbacks.append(Horizon(axis="tokens", stop_at=budget))
    # The bars are shown, and Lightning's sanity validation runs (2 batches) unless a test says otherwise.
    options: dict[str, Any] = {"max_epochs": 3, "enable_progress_bar": True, "num_sanity_val_steps": 2}
    options.update(kwargs)
    trainer = make_trainer(accumulate_grad_batches=2, callbacks=callbacks, **options)
    examples = make_examples(LENGTHS, seed=1)
    train = DataLoader(ListDataset(examples), batch_size=2)
    trainer.fit(Validated(), train, DataLoader(ListDataset(examples[:6]), batch_size=3))
    return trainer


def test_the_bar_counts_tokens_against_the_budget_over_the_whole_fit(capsys: pytest.CaptureFixture[str]) -> None:
    bar = AxisProgressBar(axis="tokens", plain=False)
    trainer = _fit(bar, limit_val_batches=0)
    ledger = trainer.strategy.ledger  # type: ignore[attr-defined]
    assert ledger.tokens >= BUDGET and bar.train_progress_bar.n == ledger.tokens
    assert bar.train_progress_bar.total == ledger.tokens and bar.train_progress_bar.unit == "tok"  # 100 %
    out = capsys.readouterr().out
    final = out.replace("\r", "\n").strip().splitlines()[-1]
    print(final)  # e.g. "tokens: 100%|██████████| 81.0/80.0 [00:00<00:00, 1.23ktok/s, applied=6, skipped=0]"
    assert re.search(r"tokens: 10\d%\|", final), final
    assert "tok/s" in final and f"applied={ledger.updates_applied}" in final and "skipped=0" in final
    assert "Epoch" not in final  # not Lightning's per-epoch count of micro-batches


def test_without_a_budget_the_bar_counts_without_a_total() -> None:
    bar = AxisProgressBar(axis="samples", plain=False)
    trainer = _fit(bar, budget=None, limit_val_batches=0, max_epochs=1)
    assert bar.train_progress_bar.total is None
    assert bar.train_progress_bar.n == trainer.strategy.ledger.samples == len(LENGTHS)  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", [AxisProgressBar, AxisRichProgressBar])
def test_plain_lines_at_a_steady_interval_and_after_each_validation(
    kind: type[AxisProgressBar | AxisRichProgressBar], capsys: pytest.CaptureFixture[str]
) -> None:
    bar = kind(axis="tokens", plain=True, interval=1e-9)  # every micro-batch: the test's own clock
    trainer = _fit(bar, val_check_interval=4, num_sanity_val_steps=0)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch ")]
    ledger = trainer.strategy.ledger  # type: ignore[attr-defined]
    assert "\r" not in "".join(lines)  # one line per report: readable in a log file
    counts = [int(re.search(r"tokens ([\d,]+)/80 ", line).group(1).replace(",", "")) for line in lines]  # type: ignore[union-attr]
    assert counts == sorted(counts) and counts[-1] == ledger.tokens >= BUDGET
    assert len(lines) > ledger.updates_attempted  # every micro-batch, each validation, the end
    validations = [line for line in lines if "accum/val_loss" in line]
    assert len(validations) >= 2 and all("accum/val_perplexity" in line for line in validations)
    assert f"updates {ledger.updates_applied} applied, 0 skipped" in lines[-1] and "left 0:00:00" in lines[-1]
    # Horizon stops inside epoch 0 (the data holds 104 tokens); the Trainer's epoch reads 1 once it has ended.
    assert trainer.current_epoch == 1 and lines[-1].startswith("epoch 0 |"), lines[-1]


def test_plain_mode_is_the_default_outside_a_terminal() -> None:
    # pytest captures standard output: not a terminal.
    assert AxisProgressBar().plain is True and AxisRichProgressBar().plain is True
    with pytest.raises(ValueError, match="`interval` must be > 0 seconds"):
        AxisProgressBar(interval=0)
    with pytest.raises(ValueError, match="`axis` must be one of"):
        AxisProgressBar(axis="steps")


class _BarMetrics(L.Callback):
    """The progress bar's metrics after every training batch, beside the size of the group the batch is in."""

    def __init__(self, bar: AxisProgressBar) -> None:
        self.bar = bar
        self.seen: list[tuple[str | None, str | None, int]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        metrics = self.bar.get_metrics(trainer, pl_module)
        self.seen.append((metrics.get("stage"), metrics.get("global_batch"), int(trainer.accumulate_grad_batches)))  # type: ignore[arg-type]


def test_under_a_batch_schedule_the_bars_show_the_stage_and_the_global_batch(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from lightning_accum import AccumulationStrategy, BatchSchedule

    # m = 2, stages of 4, 8 and 16 samples from 0, 8 and 24 samples seen: A = 2, 4, 8.
    schedule = BatchSchedule({0: 4, 8: 8, 24: 16}, axis="samples")
    examples = make_examples(LENGTHS, seed=1)  # 32 examples: groups of 4, 4, 8, 8, 8
    bar = AxisProgressBar(axis="samples", plain=False)
    spy = _BarMetrics(bar)
    trainer = make_trainer(
        strategy=AccumulationStrategy(batch_schedule=schedule), callbacks=[bar, spy], enable_progress_bar=True
    )
    trainer.fit(TinyLM(), DataLoader(ListDataset(examples), batch_size=2))
    # Every batch shows the stage of its group and that stage's samples per update, m · A · D = 2 · A.
    assert [(stage, batch) for stage, batch, _ in spy.seen] == [("0", "4")] * 4 + [("1", "8")] * 8 + [("2", "16")] * 4
    assert all(batch == str(2 * size) for _, batch, size in spy.seen)
    final = capsys.readouterr().out.replace("\r", "\n").strip().splitlines()[-1]
    assert "stage=2" in final and "global_batch=16" in final, final
    # The plain lines end with the stage; without a schedule neither the metrics nor the lines name one.
    plain = AxisProgressBar(axis="samples", plain=True, interval=1e-9)
    make_trainer(
        strategy=AccumulationStrategy(batch_schedule=schedule), callbacks=[plain], enable_progress_bar=True
    ).fit(TinyLM(), DataLoader(ListDataset(examples), batch_size=2))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch ")]
    assert lines[0].endswith("| stage 0, global batch 4") and lines[-1].endswith("| stage 2, global batch 16"), lines
    without = AxisProgressBar(axis="samples", plain=False)
    spy = _BarMetrics(without)
    make_trainer(accumulate_grad_batches=2, callbacks=[without, spy], enable_progress_bar=True).fit(
        TinyLM(), DataLoader(ListDataset(examples), batch_size=2)
    )
    assert {(stage, batch) for stage, batch, _ in spy.seen} == {(None, None)}
