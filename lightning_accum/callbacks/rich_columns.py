"""The Rich columns of ``AxisRichProgressBar``'s training task (imports ``rich``, which the package does not need)."""

from __future__ import annotations

import math
from typing import Any

from lightning.pytorch.callbacks.progress.rich_progress import BatchesProcessedColumn, ProcessingSpeedColumn
from rich.console import RenderableType
from rich.progress import ProgressColumn, Task
from rich.text import Text

from lightning_accum.callbacks.common import format_count, format_rate


class _OnTheAxis(ProgressColumn):
    """Lightning's column for every task but the training one, which shows ``text(task)`` in the same style."""

    def __init__(self, bar: Any, lightning_column: ProgressColumn, unit: str) -> None:
        super().__init__()
        self.bar, self.lightning_column, self.unit = bar, lightning_column, unit
        self.style = getattr(lightning_column, "style", "")

    def render(self, task: Task) -> RenderableType:
        if task.id != self.bar.train_progress_bar_id:
            return self.lightning_column.render(task)
        return Text(self.text(task), style=self.style)

    def text(self, task: Task) -> str:
        raise NotImplementedError


class _Count(_OnTheAxis):
    def text(self, task: Task) -> str:
        done = format_count(int(task.completed))
        total = task.total
        if total is None or not math.isfinite(total):
            return f"{done} {self.unit}"
        return f"{done}/{format_count(int(total))} {self.unit}"


class _Rate(_OnTheAxis):
    def text(self, task: Task) -> str:
        speed = task.finished_speed or task.speed  # Rich keeps the rate of a finished task in finished_speed
        if speed is None:
            return f"- {self.unit}/s"
        return format_rate(speed, self.unit)


def axis_columns(bar: Any, columns: list[Any], unit: str) -> list[Any]:
    """Lightning's Rich columns with its batch count and ``it/s`` replaced on the training task."""
    replaced: list[Any] = []
    for column in columns:
        if isinstance(column, BatchesProcessedColumn):
            column = _Count(bar, column, unit)
        elif isinstance(column, ProcessingSpeedColumn):
            column = _Rate(bar, column, unit)
        replaced.append(column)
    return replaced
