"""Progress on the run's own axis: tokens (or samples, or applied updates) done out of the budget, the rate, the time
left, applied and skipped updates.

Lightning's bar counts micro-batches of the epoch (``640/40`` against ``max_steps`` with ``A = 16``) and has nothing
to count against on a token budget; outside a terminal (a log file, CI, a cluster job) its carriage-return updates
show nothing readable until a run ends. :class:`AxisProgressBar` is Lightning's ``TQDMProgressBar`` whose training
bar counts the ledger's exact count over the whole fit against the budget a :class:`~lightning_accum.Horizon` sets
(``stop_at`` on the same axis; ``max_steps`` for ``axis="updates"``), and which, when the output is not a terminal,
prints one plain line at a steady interval instead (:func:`progress_line`).
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override

from lightning_accum.callbacks.common import accumulation_strategy, format_count
from lightning_accum.callbacks.horizon import Horizon
from lightning_accum.ledger import AXES, AccumulationLedger
from lightning_accum.options import validate_choice

__all__ = ["AxisProgressBar", "progress_line", "run_budget"]

#: The unit each axis is counted in, as the bar shows it.
_UNITS = {"tokens": "tok", "samples": "sp", "updates": "upd"}


def run_budget(trainer: Trainer, axis: str) -> int | None:
    """The run's end on ``axis``: a :class:`~lightning_accum.Horizon`'s ``stop_at`` on that axis, else
    ``max_steps`` for ``axis="updates"`` (Lightning's attempts: applied updates unless some are skipped), else
    ``None``."""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, Horizon) and callback.axis == axis and callback.stop_at is not None:
            return int(callback.stop_at)
    if axis == "updates" and trainer.max_steps > 0:
        return int(trainer.max_steps)
    return None


def _duration(seconds: float) -> str:
    return str(timedelta(seconds=int(seconds)))


def progress_line(
    ledger: AccumulationLedger, axis: str, budget: int | None, start_count: int, elapsed: float, epoch: int
) -> str:
    """One plain line of progress (what :class:`AxisProgressBar` prints outside a terminal): exact counts.

    Example:
        >>> ledger = AccumulationLedger()
        >>> ledger.tokens, ledger.updates_attempted, ledger.updates_applied = 30_000, 12, 12
        >>> print(progress_line(ledger, "tokens", 100_000, 0, 60.0, 0).replace(" | ", "\\n"))
        epoch 0
        tokens 30,000/100,000 (30.0%)
        500 tok/s
        elapsed 0:01:00
        left 0:02:20
        updates 12 applied, 0 skipped
    """
    count = int(getattr(ledger, AXES[axis]))
    unit = _UNITS[axis]
    parts = [f"epoch {epoch}"]
    if budget:
        parts.append(f"{axis} {count:,}/{budget:,} ({100.0 * count / budget:.1f}%)")
    else:
        parts.append(f"{axis} {count:,}")
    rate = (count - start_count) / elapsed if elapsed > 0 else 0.0
    parts.append(f"{format_count(round(rate), '')} {unit}/s" if rate >= 1 else f"{rate:.2f} {unit}/s")
    parts.append(f"elapsed {_duration(elapsed)}")
    if budget and rate > 0:
        parts.append(f"left {_duration(max(budget - count, 0) / rate)}")
    parts.append(f"updates {ledger.updates_applied} applied, {ledger.skipped_total} skipped")
    last = ledger.last_group
    if last is not None and last.loss == last.loss:  # a finite or infinite loss, not NaN
        parts.append(f"loss {last.loss:.4f}")
    return " | ".join(parts)


class AxisProgressBar(TQDMProgressBar):
    """Lightning's TQDM progress bar with the training bar on the run's axis, and a plain-line mode.

    The training bar covers the whole fit (not one epoch): ``n`` is the ledger's exact count on ``axis`` (tokens,
    samples, or applied updates), its total the budget (:func:`run_budget`; none without one), and tqdm shows the
    rate in units per second and the time left from the rate since the fit started; the postfix adds applied and
    skipped updates (whole numbers) to Lightning's metrics. The validation, test and sanity-check bars are
    Lightning's. It replaces Lightning's bar the usual way: ``Trainer(callbacks=[AxisProgressBar()])``.

    ``plain=True`` (the default when standard output is not a terminal): no bars; one :func:`progress_line` every
    ``interval`` seconds of training, at the end of every validation and at the end of the fit, on global rank zero,
    flushed at once (a log file shows where a run is while it runs).

    Args:
        axis: ``"tokens"``, ``"samples"`` or ``"updates"``.
        refresh_rate: As in ``TQDMProgressBar``: redraw every ``refresh_rate`` micro-batches.
        process_position: As in ``TQDMProgressBar``.
        leave: As in ``TQDMProgressBar``.
        plain: Plain lines instead of bars; ``None``: when standard output is not a terminal.
        interval: Seconds between plain lines.

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
        self.axis = validate_choice("axis", axis, AXES)
        if not interval > 0:
            raise ValueError(f"`interval` must be > 0 seconds, got {interval!r}. Pass e.g. `interval=30.0`.")
        self.plain = (not sys.stdout.isatty()) if plain is None else bool(plain)
        self.interval = float(interval)
        self._budget: int | None = None
        self._start = (0, 0.0)  # (count, time) when the fit's training started
        self._next_line = 0.0

    # ------------------------------------------------------------------ what the bar counts

    def _ledger(self, trainer: Trainer) -> AccumulationLedger:
        return accumulation_strategy(trainer, "AxisProgressBar").ledger

    def _count(self, trainer: Trainer) -> int:
        return int(getattr(self._ledger(trainer), AXES[self.axis]))

    def _line(self, trainer: Trainer) -> str:
        count, started = self._start
        return progress_line(
            self._ledger(trainer), self.axis, self._budget, count, time.monotonic() - started, trainer.current_epoch
        )

    def _say(self, trainer: Trainer) -> None:
        if trainer.is_global_zero:
            print(self._line(trainer), flush=True)

    @override
    def get_metrics(
        self, trainer: Trainer, pl_module: LightningModule
    ) -> dict[str, int | str | float | dict[str, float]]:
        metrics = super().get_metrics(trainer, pl_module)
        ledger = self._ledger(trainer)
        # Counts as text: Rich's metrics column formats every number with three decimals ("skipped: 0.000").
        metrics.update(applied=str(ledger.updates_applied), skipped=str(ledger.skipped_total))
        return metrics

    # ------------------------------------------------------------------ training

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        accumulation_strategy(trainer, "AxisProgressBar")
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
        bar = self.train_progress_bar
        bar.unit, bar.unit_scale = _UNITS[self.axis], True
        bar.reset(total=self._budget)
        bar.initial = bar.n = self._start[0]
        bar.set_description(self.axis)

    @override
    def on_train_epoch_start(self, trainer: Trainer, *_: Any) -> None:
        pass  # one bar over the whole fit: Lightning's resets it per epoch, to the epoch's micro-batches

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.plain:
            if time.monotonic() >= self._next_line:
                self._next_line = time.monotonic() + self.interval
                self._say(trainer)
            return
        if (batch_idx + 1) % self.refresh_rate == 0:
            self._draw(trainer, pl_module)

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
            if trainer.is_global_zero:
                print(self._line(trainer) + (f" | {shown}" if shown else ""), flush=True)
