"""Progress bars on the run's own axis (tokens, samples, documents or updates) out of its budget, and plain lines."""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import RichProgressBarTheme
from typing_extensions import override

from lightning_accum.callbacks.common import accumulation_strategy, format_rate
from lightning_accum.callbacks.horizon import UNITS, Horizon
from lightning_accum.ledger import AXES, AccumulationLedger
from lightning_accum.options import validate_choice

__all__ = ["AxisProgressBar", "AxisRichProgressBar", "progress_line", "run_budget"]


def run_budget(trainer: Trainer, axis: str) -> int | None:
    """The run's end on ``axis``: a :class:`~lightning_accum.Horizon`'s ``stop_at``, else ``max_steps`` for updates."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, Horizon) and callback.axis == axis and callback.stop_at is not None:
            return int(callback.stop_at)
    if axis == "updates" and trainer.max_steps > 0:
        return int(trainer.max_steps)
    return None


def progress_line(
    ledger: AccumulationLedger, axis: str, budget: int | None, start_count: int, elapsed: float, epoch: int
) -> str:
    """One plain line of progress, what the bars print outside a terminal.

    Example:
        >>> ledger = AccumulationLedger(tokens=300, updates_attempted=12, updates_applied=12)
        >>> print(progress_line(ledger, "tokens", 1000, 0, 60.0, 0))
        epoch 0 | tokens 300/1,000 (30.0%) | 5 tok/s | elapsed 0:01:00 | left 0:02:20 | updates 12 applied, 0 skipped
    """
    count = int(getattr(ledger, AXES[axis]))
    parts = [f"epoch {epoch}"]
    if budget:
        parts.append(f"{axis} {count:,}/{budget:,} ({100.0 * count / budget:.1f}%)")
    else:
        parts.append(f"{axis} {count:,}")
    rate = (count - start_count) / elapsed if elapsed > 0 else 0.0
    parts.append(format_rate(rate, UNITS[axis]))
    parts.append(f"elapsed {timedelta(seconds=int(elapsed))}")
    if budget and rate > 0:
        parts.append(f"left {timedelta(seconds=int(max(budget - count, 0) / rate))}")
    parts.append(f"updates {ledger.updates_applied} applied, {ledger.skipped_total} skipped")
    last = ledger.last_group
    if last is not None and last.loss == last.loss:  # a finite or infinite loss, not NaN
        parts.append(f"loss {last.loss:.4f}")
    return " | ".join(parts)


def _batch_stage(trainer: Trainer) -> dict[str, int] | None:
    """The running group's stage record under ``batch_schedule=``, else ``None``."""
    strategy = accumulation_strategy(trainer, "the progress bar")
    if strategy.batch_schedule is None:
        return None
    stages = strategy.batch_stages
    return stages[-1] if stages else None


class _AxisBar(ProgressBar):
    """What both bars share; a subclass adds ``_open(trainer)`` and ``_draw(trainer, pl_module)``."""

    def _axis_options(self, axis: str, plain: bool | None, interval: float) -> None:
        self.axis = validate_choice("axis", axis, AXES)
        if not interval > 0:
            raise ValueError(f"`interval` must be > 0 seconds, got {interval!r}. Pass e.g. `interval=30.0`.")
        self.plain = (not sys.stdout.isatty()) if plain is None else bool(plain)
        self.interval = float(interval)
        self._budget: int | None = None
        self._start = (0, 0.0)  # (count, time) when the fit's training started
        self._next_line = 0.0
        self._epoch = 0  # the epoch that runs (the Trainer's counts one more once an epoch has ended)

    # ------------------------------------------------------------------ what the bar counts

    def _ledger(self, trainer: Trainer) -> AccumulationLedger:
        return accumulation_strategy(trainer, type(self).__name__).ledger

    def _count(self, trainer: Trainer) -> int:
        return int(getattr(self._ledger(trainer), AXES[self.axis]))

    def _say(self, trainer: Trainer, extra: str = "") -> None:
        if trainer.is_global_zero:
            count, started = self._start
            line = progress_line(
                self._ledger(trainer), self.axis, self._budget, count, time.monotonic() - started, self._epoch
            )
            stage = _batch_stage(trainer)
            if stage is not None:
                line += f" | stage {stage['stage']}, global batch {stage['samples_per_update']}"
            print(line + extra, flush=True)

    #: Draw the training bar every this many micro-batches.
    _draw_every = 1

    def _open(self, trainer: Trainer) -> None:
        raise NotImplementedError

    def _draw(self, trainer: Trainer, pl_module: LightningModule) -> None:
        raise NotImplementedError

    @override
    def get_metrics(
        self, trainer: Trainer, pl_module: LightningModule
    ) -> dict[str, int | str | float | dict[str, float]]:
        metrics = super().get_metrics(trainer, pl_module)
        ledger = self._ledger(trainer)
        # Counts as text: Rich's metrics column formats every number with three decimals ("skipped: 0.000").
        metrics.update(applied=str(ledger.updates_applied), skipped=str(ledger.skipped_total))
        stage = _batch_stage(trainer)
        if stage is not None:  # under `batch_schedule=`: the running group's stage and samples per update
            metrics.update(stage=str(stage["stage"]), global_batch=str(stage["samples_per_update"]))
        return metrics

    # ------------------------------------------------------------------ training

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._ledger(trainer)  # the accumulation strategy, or one error naming it
        if self.plain:
            self.disable()
        super().setup(trainer, pl_module, stage)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._budget = run_budget(trainer, self.axis)
        now = time.monotonic()
        self._start = (self._count(trainer), now)
        self._next_line = now + self.interval
        self._epoch = trainer.current_epoch
        if not self.plain:
            self._open(trainer)

    @override
    def on_train_epoch_start(self, trainer: Trainer, *_: Any) -> None:
        # One bar over the whole fit: Lightning's bars reset it per epoch, to the epoch's micro-batches.
        self._epoch = trainer.current_epoch

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.plain:
            if time.monotonic() >= self._next_line:
                self._next_line = time.monotonic() + self.interval
                self._say(trainer)
        elif (batch_idx + 1) % self._draw_every == 0:
            self._draw(trainer, pl_module)

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.plain:
            self._draw(trainer, pl_module)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.plain:
            self._say(trainer)
        super().on_train_end(trainer, pl_module)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if self.plain and trainer.state.fn == "fit" and not trainer.sanity_checking:
            values = {k: float(v) for k, v in trainer.callback_metrics.items() if "val" in k and v.numel() == 1}
            shown = ", ".join(f"{k} {v:.4f}" for k, v in sorted(values.items()))
            self._say(trainer, f" | {shown}" if shown else "")


class AxisProgressBar(_AxisBar, TQDMProgressBar):
    """Lightning's TQDM progress bar with one training bar over the whole fit on the run's axis, and plain lines.

    Args:
        axis: ``"tokens"``, ``"samples"``, ``"documents"`` or ``"updates"``.
        refresh_rate: As in ``TQDMProgressBar``: redraw every ``refresh_rate`` micro-batches.
        process_position, leave: As in ``TQDMProgressBar``.
        plain: One :func:`progress_line` every ``interval`` seconds instead of bars; ``None``: when standard output
            is not a terminal.
        interval: Seconds between plain lines.

    Raises:
        ValueError: ``axis`` is unknown or ``interval`` is not > 0.

    Example:
        >>> AxisProgressBar(axis="tokens", plain=True, interval=30.0).plain
        True
    """

    def __init__(
        self,
        axis: str = "tokens",
        refresh_rate: int = 1,
        process_position: int = 0,
        leave: bool = False,
        plain: bool | None = None,
        interval: float = 30.0,
    ) -> None:
        super().__init__(refresh_rate=refresh_rate, process_position=process_position, leave=leave)
        self._axis_options(axis, plain, interval)
        self._draw_every = self.refresh_rate  # micro-batches, as Lightning's TQDM bar (Rich's rate is per second)

    @override
    def _open(self, trainer: Trainer) -> None:
        bar = self.train_progress_bar
        bar.unit, bar.unit_scale = UNITS[self.axis], True
        bar.reset(total=self._budget)
        bar.initial = bar.n = self._start[0]
        bar.set_description(self.axis)

    @override
    def _draw(self, trainer: Trainer, pl_module: LightningModule) -> None:
        bar = self.train_progress_bar
        if bar is None or bar.disable:
            return
        count = self._count(trainer)
        if self._budget is not None:
            # The update that reaches the budget passes it: tqdm would drop a total below the count (showing "?").
            bar.total = max(self._budget, count)
        bar.n = count
        bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
        bar.refresh()


class AxisRichProgressBar(_AxisBar, RichProgressBar):
    """:class:`AxisProgressBar` on Lightning's Rich progress bar (``pip install rich``).

    Args:
        axis: ``"tokens"``, ``"samples"``, ``"documents"`` or ``"updates"``.
        refresh_rate: As in ``RichProgressBar``: redraws per second (``0`` disables the bars, not the plain lines).
        leave, theme, console_kwargs: As in ``RichProgressBar``.
        plain: Plain lines instead of bars; ``None``: when standard output is not a terminal.
        interval: Seconds between plain lines.
    """

    def __init__(
        self,
        axis: str = "tokens",
        refresh_rate: int = 100,
        leave: bool = False,
        theme: RichProgressBarTheme | None = None,
        console_kwargs: dict[str, Any] | None = None,
        plain: bool | None = None,
        interval: float = 30.0,
    ) -> None:
        super().__init__(
            refresh_rate=refresh_rate, leave=leave, theme=theme or RichProgressBarTheme(), console_kwargs=console_kwargs
        )
        self._axis_options(axis, plain, interval)

    @override
    def configure_columns(self, trainer: Trainer) -> list:
        from lightning_accum.callbacks.rich_columns import axis_columns  # rich is optional, as for Lightning

        return axis_columns(self, super().configure_columns(trainer), UNITS[self.axis])

    @override
    def _open(self, trainer: Trainer) -> None:
        if self.progress is None or self.is_disabled:
            return
        total = float("inf") if self._budget is None else float(self._budget)
        # Hidden until the columns can tell it is the training task (adding a task draws the table).
        self.train_progress_bar_id = self.progress.add_task(
            self.axis, total=total, completed=self._start[0], visible=False
        )
        self.progress.update(self.train_progress_bar_id, visible=True)

    @override
    def _draw(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.progress is None or self.is_disabled or self.train_progress_bar_id is None:
            return
        # The total stays the budget: Rich draws a count past it as a full bar ("92/80 tok"), and a new total would
        # reset the task's rate estimate.
        self.progress.update(self.train_progress_bar_id, completed=self._count(trainer))
        self._update_metrics(trainer, pl_module)
        self.refresh()
