"""Log every curve of a run on an explicit axis: tokens, samples or applied updates."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lightning_accum.axis_lr import no_token_counts_error
from lightning_accum.callbacks.common import accumulation_strategy, format_count
from lightning_accum.ledger import AXES, AccumulationLedger, GroupRecord
from lightning_accum.options import validate_choice
from lightning_accum.strategies import ExactAccumulation

__all__ = ["AXES", "AxisLogger", "window_metrics"]


def _units(record: GroupRecord, unit: str | None) -> int:
    """A group's weight in the run's unit (what its loss is averaged over)."""
    return record.tokens if unit == "tokens" else record.samples if unit == "samples" else record.microbatches


def window_metrics(records: Sequence[GroupRecord], unit: str | None) -> dict[str, float]:
    """The group metrics of one logged point, from the attempted updates since the previous point.

    ``loss``: the groups' losses weighted by their units (over every group with units and a finite loss), which
    is the token-weighted (or sample-weighted) loss of all their examples together; ``tokens_per_update`` and
    ``samples_per_update``: the mean per attempted update over the window (exact sums divided by the count).

    Example:
        >>> a = GroupRecord(loss=2.0, tokens=512, samples=1, microbatches=1, applied=True)
        >>> b = GroupRecord(loss=4.0, tokens=1536, samples=1, microbatches=1, applied=True)
        >>> window_metrics([a, b], "tokens")
        {'loss': 3.5, 'tokens_per_update': 1024.0, 'samples_per_update': 1.0}
    """
    weighted = weight = 0.0
    for record in records:
        units = _units(record, unit)
        if units > 0 and math.isfinite(record.loss):
            weighted += units * record.loss
            weight += units
    metrics: dict[str, float] = {}
    if weight > 0:
        metrics["loss"] = weighted / weight
    count = len(records)
    metrics["tokens_per_update"] = sum(r.tokens for r in records) / count
    metrics["samples_per_update"] = sum(r.samples for r in records) / count
    return metrics


class AxisLogger(Callback):
    """Write the group metrics, and move every other logged scalar, onto one explicit x-axis.

    Lightning logs against "batches that stepped", on which runs with different micro-batch size ``m``,
    accumulation ``A`` or replica count ``D`` cannot be compared. With ``axis="tokens"`` (or
    ``"samples"``), every curve of the run (the keys below, ``self.log`` in training and validation
    hooks, ``LearningRateMonitor``) is written at x = the exact global count from
    ``trainer.strategy.ledger`` at that moment, so runs of different ``(m, A, D)`` overlay. x is a
    Python int (no float32 rounding above 2^24), never decreases (also across a resume, since the ledger
    is restored, and across several fits with this callback and the same logger: see below), and each tag
    is written at most once per x: the first value written there is kept, so the duplicates
    ``LearningRateMonitor`` emits on every micro-batch of a group disappear.

    The group metrics follow Lightning's cadence: a point every ``Trainer(log_every_n_steps=N)`` attempted
    updates (N = 50 by default; ``log_every_n_steps=1`` writes every update), and one more when training ends
    with updates not yet written. A point covers every attempted update since the previous one, on global rank
    zero, to every logger of the Trainer:

    =============================== ================== ================================= ===================
    key                             unit               value at a point (x: axis value)  over ranks
    =============================== ================== ================================= ===================
    ``accum/loss``                  loss               weighted by units over the window token-weighted, all
    ``accum/lr`` (``/pg{i}``)       learning rate      the rate the window's last update same on every rank
                                                       used
    ``accum/tokens_per_update``     supervised tokens  mean per attempted update         summed
    ``accum/samples_per_update``    samples            mean per attempted update         summed
    ``accum/skipped_updates``       updates (total)    skipped so far                    same on every rank
    ``accum/grad_scale``            GradScaler scale   the window's last update's scale  same on every rank
    =============================== ================== ================================= ===================

    ``accum/loss`` is written only when the window holds a group with units and a finite loss; ``accum/lr`` is
    one key per parameter group when there are several; ``accum/grad_scale`` only with a GradScaler. With
    ``axis="updates"`` x counts *applied* updates. The progress bar shows the tokens (or samples) seen and the
    skipped updates.

    Several fits (e.g. two training stages, each with a new Trainer) logged by this callback to the same logger
    continue one axis: a fit whose ledger starts below the highest x already written is shifted to start there
    (announced once), so the second stage's curves follow the first's instead of being dropped.

    Args:
        axis: ``"tokens"``, ``"samples"`` or ``"updates"``.
        prefix: Prefix of the group metrics' keys.

    Raises:
        ValueError: For an unknown ``axis``.
        RuntimeError: When the Trainer's strategy is not an accumulation strategy, or ``axis="tokens"``
            while the run reports no token counts (raised before the first backward).

    Example:
        >>> import lightning as L
        >>> import lightning_accum
        >>> trainer = L.Trainer(strategy="accum", callbacks=[lightning_accum.AxisLogger(axis="tokens")],
        ...                     accelerator="cpu", logger=False, enable_checkpointing=False)
        >>> lightning_accum.AxisLogger(axis="steps")
        Traceback (most recent call last):
        ...
        ValueError: `axis` must be one of 'tokens', 'samples', 'updates'; got 'steps'. Pass one of those values.
    """

    def __init__(self, axis: str = "tokens", prefix: str = "accum/") -> None:
        self.axis = validate_choice("axis", axis, AXES)
        self.prefix = prefix
        self._originals: dict[int, tuple[Logger, Callable[..., Any]]] = {}
        self._last_x: dict[tuple[int, str], int] = {}
        self._high_x = -1  # the highest x written, over every fit of this callback
        self._offset = 0  # added to the ledger's count in this fit (see "Several fits" above)
        self._window: list[GroupRecord] = []
        self._window_lrs: list[float] = []
        # Per fit: see `_read_run`; and whether the token counts were found (checked until they are).
        self._run: tuple[AccumulationLedger, bool, list[dict[str, Any]], int] | None = None
        self._tokens_checked = False
        self._checked_unit = False
        self._progress_original: Callable[..., Any] | None = None
        self._trainer: Trainer | None = None
        self._state_key: str | None = None

    @property
    @override
    def state_key(self) -> str:
        # Lightning formats this key for every hook call it profiles: build it once.
        if self._state_key is None:
            self._state_key = self._generate_state_key(axis=self.axis, prefix=self.prefix)
        return self._state_key

    # ------------------------------------------------------------------ axis

    def axis_value(self, ledger: AccumulationLedger) -> int:
        """The current x: the ledger's count for the chosen axis (plus the offset of a later fit)."""
        return int(getattr(ledger, AXES[self.axis])) + self._offset

    @staticmethod
    def _ledger(trainer: Trainer) -> AccumulationLedger:
        return trainer.strategy.ledger  # type: ignore[attr-defined, no-any-return]

    # ------------------------------------------------------------------ set-up and tear-down

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        strategy = accumulation_strategy(trainer, "AxisLogger")
        self._trainer = trainer
        self._offset = 0
        self._window = []
        self._checked_unit = False
        self._run = None
        self._tokens_checked = False
        for logger in trainer.loggers:
            self._move_onto_axis(trainer, logger)
        # Called once per group, after the update and before the schedules advance: no hook on every micro-batch.
        strategy.add_group_listener(self._on_group)
        bar = trainer.progress_bar_callback
        if bar is not None and self._progress_original is None:
            self._progress_original = original = bar.get_metrics

            def get_metrics(
                trainer: Trainer, pl_module: LightningModule
            ) -> dict[str, int | str | float | dict[str, float]]:
                metrics = original(trainer, pl_module)
                metrics.update(self._progress_fields(trainer))
                return metrics  # type: ignore[no-any-return]

            bar.get_metrics = get_metrics  # type: ignore[method-assign]

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # After a checkpoint is restored: a fit that starts below what this callback already wrote continues the axis.
        start = self.axis_value(self._ledger(trainer))
        if start <= self._high_x:
            self._offset = self._high_x - start
            rank_zero_info(
                f"AxisLogger: this fit's {self.axis} count starts at {start - self._offset}, below the"
                f" x = {self._high_x} this callback already wrote to its loggers in an earlier fit; its points"
                f" continue from there (x = {self._high_x} + the count)."
            )

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Tensor) -> None:
        # The unit is decided by the first micro-batch's training_step: say so before anything is applied.
        if self._checked_unit:
            return
        self._checked_unit = True
        if self.axis == "tokens" and self._ledger(trainer).normalization not in ("tokens", None):
            raise no_token_counts_error("AxisLogger")

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._flush(trainer)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, ExactAccumulation):
            strategy.remove_group_listener(self._on_group)
        self._trainer = None
        self._run = None
        for logger, original in self._originals.values():
            if logger.__dict__.get("log_metrics") is not None:
                del logger.__dict__["log_metrics"]  # the class's method again, nothing left on the instance
            else:
                logger.log_metrics = original  # type: ignore[method-assign]
        self._originals.clear()
        bar = trainer.progress_bar_callback
        if bar is not None and self._progress_original is not None:
            bar.__dict__.pop("get_metrics", None)
        self._progress_original = None

    def _move_onto_axis(self, trainer: Trainer, logger: Logger) -> None:
        # `Logger.log_metrics(metrics, step)` is the public method every logger implements; Lightning passes its own
        # step to it. Wrapped on the instance (a proxy logger would break `isinstance` checks on `trainer.logger`).
        if id(logger) in self._originals:
            return
        original = logger.log_metrics
        self._originals[id(logger)] = (logger, original)

        def log_metrics(metrics: Mapping[str, float], step: int | None = None) -> None:
            self._write(logger, original, metrics, self.axis_value(self._ledger(trainer)))

        logger.log_metrics = log_metrics  # type: ignore[method-assign]

    def _write(self, logger: Logger, original: Callable[..., Any], metrics: Mapping[str, float], x: int) -> None:
        # At most one write per (tag, x), and x never goes back for a tag: the first value at an x is kept.
        fresh = {}
        for tag, value in metrics.items():
            key = (id(logger), tag)
            if self._last_x.get(key, -1) < x:
                self._last_x[key] = x
                fresh[tag] = value
        if fresh:
            self._high_x = max(self._high_x, x)
            original(fresh, step=x)

    def _progress_fields(self, trainer: Trainer) -> dict[str, int | str]:
        ledger = self._ledger(trainer)
        fields: dict[str, int | str] = {}
        if ledger.tokens > 0 or self.axis == "tokens":
            fields["seen"] = format_count(ledger.tokens, "tok")
        else:
            fields["seen"] = format_count(ledger.samples, "sp")
        fields["skipped"] = str(ledger.skipped_total)  # text: Rich's bar shows every number as "0.000"
        return fields

    # ------------------------------------------------------------------ group metrics

    def _on_group(self, group: GroupRecord, batch_samples: Sequence[int]) -> None:
        trainer = self._trainer
        if trainer is None or group.dropped:
            return  # a dropped group is no attempt: nothing is written for it
        run = self._run
        if run is None:  # read once per fit, at its first update: what every update of the fit reads
            run = self._run = self._read_run(trainer)
        ledger, writes, param_groups, every = run
        if self._tokens_checked is False and self.axis == "tokens":
            if ledger.tokens == 0 and ledger.normalization != "tokens":
                raise no_token_counts_error("AxisLogger")
            self._tokens_checked = ledger.normalization == "tokens"  # then every later update has token counts
        if not writes:
            return
        self._window.append(group)
        # The schedules advance after the listeners: this is the rate the update used.
        self._window_lrs = [lr if type(lr := pg["lr"]) is float else float(lr) for pg in param_groups]
        if ledger.updates_attempted % every == 0:
            self._flush(trainer)

    def _read_run(self, trainer: Trainer) -> tuple[AccumulationLedger, bool, list[dict[str, Any]], int]:
        """The ledger, whether this rank writes, the optimizer's parameter groups and the cadence, for one fit."""
        optimizers = trainer.optimizers
        # `trainer.log_every_n_steps`: set by Lightning's logger connector (public, not declared on the class).
        every = int(getattr(trainer, "log_every_n_steps", 1) or 1)
        groups = optimizers[0].param_groups if optimizers else []
        return self._ledger(trainer), trainer.is_global_zero, groups, every

    def _flush(self, trainer: Trainer) -> None:
        """Write the point of the attempted updates since the previous one (none pending: nothing)."""
        if not self._window or not trainer.is_global_zero:
            return
        records, self._window = self._window, []
        ledger = self._ledger(trainer)
        window = window_metrics(records, ledger.normalization)
        metrics: dict[str, float] = {f"{self.prefix}{key}": value for key, value in window.items()}
        lrs = self._window_lrs
        if len(lrs) == 1:
            metrics[f"{self.prefix}lr"] = lrs[0]
        else:
            metrics.update({f"{self.prefix}lr/pg{i}": lr for i, lr in enumerate(lrs)})
        metrics[f"{self.prefix}skipped_updates"] = ledger.skipped_total
        if records[-1].grad_scale is not None:
            metrics[f"{self.prefix}grad_scale"] = records[-1].grad_scale
        x = self.axis_value(ledger)
        for logger, original in self._originals.values():
            self._write(logger, original, metrics, x)
