"""callbacks/rich_columns: the Rich columns of AxisRichProgressBar's training task, the axis's count and rate."""

from __future__ import annotations

import io
import re
from typing import Any

from callbacks.test_progress import BUDGET, _fit
from lightning_accum import AxisRichProgressBar


def _rich(axis: str = "tokens") -> tuple[AxisRichProgressBar, io.StringIO]:
    screen = io.StringIO()  # a terminal without colours, 160 columns wide
    console = {"file": screen, "force_terminal": True, "width": 160, "color_system": None}
    return AxisRichProgressBar(axis=axis, plain=False, console_kwargs=console), screen


def _frames(screen: io.StringIO) -> list[str]:
    """The lines Rich drew, without the terminal's control sequences."""
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.getvalue())
    return [line.strip() for line in re.split(r"[\r\n]", text) if line.strip()]


def test_the_rich_bar_counts_tokens_against_the_budget_over_the_whole_fit() -> None:
    bar, screen = _rich()
    trainer = _fit(bar, limit_val_batches=0)
    ledger = trainer.strategy.ledger  # type: ignore[attr-defined]
    frames = [line for line in _frames(screen) if line.startswith("tokens")]
    print(frames[-1])  # e.g. "tokens ━━━━━━━━ 92/80 tok 0:00:00 • 0:00:00 2.7k tok/s applied: 7 skipped: 0 ..."
    final = frames[-1]
    assert ledger.tokens > BUDGET and f" {ledger.tokens}/{BUDGET} tok " in final, final
    assert re.search(r" [\d.]+k? tok/s ", final) and "it/s" not in final, final
    assert f"applied: {ledger.updates_applied} " in final and "skipped: 0 " in final, final  # not "0.000"
    assert not any("Epoch" in line for line in frames)  # one task over the fit, not Lightning's per epoch
    # Every frame of the training task counts tokens: the first one too (the task is drawn once it is known).
    counts = [int(re.search(r" (\d+)/80 tok ", line).group(1)) for line in frames]  # type: ignore[union-attr]
    assert counts == sorted(counts) and counts[-1] == ledger.tokens


def _row(bar: AxisRichProgressBar, task_id: Any) -> str:
    """One task's text columns as Rich renders them (whatever the refresh thread happened to draw)."""
    assert bar.progress is not None
    task = next(task for task in bar.progress.tasks if task.id == task_id)
    cells = [column(task) for column in bar.progress.columns]
    return " ".join(cell.plain for cell in cells if hasattr(cell, "plain"))


def test_the_rich_bar_without_a_budget_and_lightnings_tasks_beside_it() -> None:
    bar, _ = _rich("samples")
    trainer = _fit(bar, budget=None, max_epochs=2, num_sanity_val_steps=2)
    ledger = trainer.strategy.ledger  # type: ignore[attr-defined]
    train = _row(bar, bar.train_progress_bar_id)
    assert train.startswith("samples") and f" {ledger.samples} sp " in train and " sp/s" in train, train
    # Lightning's tasks keep Lightning's columns: micro-batches and it/s.
    sanity, validation = _row(bar, bar.val_sanity_progress_bar_id), _row(bar, bar.val_progress_bar_id)
    assert sanity.startswith("Sanity Checking") and " 2/2 " in sanity and "it/s" in sanity, sanity
    assert validation.startswith("Validation") and " 2/2 " in validation and "it/s" in validation, validation
