"""Log every curve of a run on an explicit axis: tokens, samples, documents or applied updates."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lightning_accum.axis_lr import check_counts_reported, group_count, no_counts_error
from lightning_accum.callbacks.common import accumulation_strategy, format_count, token_group_stats
from lightning_accum.ledger import AXES, AccumulationLedger, GroupRecord
from lightning_accum.options import validate_choice
from lightning_accum.patching import InstancePatch
from lightning_accum.strategies import ExactAccumulation

__all__ = ["AXES", "AxisLogger", "window_metrics"]


def window_metrics(records: Sequence[GroupRecord], unit: str | None) -> dict[str, float]:
    """The group metrics of one logged point from the attempted updates since the previous one: ``loss`` weighted by
    units, ``*_per_update`` the mean per attempted update.

    Example:
        >>> a = GroupRecord(loss=2.0, tokens=512, samples=1, microbatches=1, applied=True)
        >>> b = GroupRecord(loss=4.0, tokens=1536, samples=1, microbatches=1, applied=True)
        >>> window_metrics([a, b], "tokens")
        {'loss': 3.5, 'tokens_per_update': 1024.0, 'samples_per_update': 1.0}
    """
    weighted = weight = 0.0
    for record in records:
        units = group_count(record, unit) if unit in ("tokens", "samples", "documents") else record.microbatches
        if units > 0 and math.isfinite(record.loss):
            weighted += units * record.loss
            weight += units
    metrics: dict[str, float] = {}
    if weight > 0:
        metrics["loss"] = weighted / weight
    count = len(records)
    metrics["tokens_per_update"] = sum(r.tokens for r in records) / count
    metrics["samples_per_update"] = sum(r.samples for r in records) / count
    documents = sum(r.documents for r in records)
    if documents or unit == "documents":
        metrics["documents_per_update"] = documents / count
    return metrics


def _plan_metrics(plan: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Under ``token_batches=``: the window's padded tokens and micro-batches per update and its padding fraction."""
    if not plan:
        return {}
    padded, count = sum(p["padded_tokens"] for p in plan), len(plan)
    return {
        "padded_tokens_per_update": padded / count,
        "microbatches_per_update": sum(p["microbatches"] for p in plan) / count,
        "padding_fraction": 1.0 - sum(p["tokens"] for p in plan) / padded,
    }


class AxisLogger(Callback):
    """Write the group metrics, and move every other logged scalar, onto one x-axis: the ledger's exact count on
    ``axis`` (docs/concepts.md, "The logging axis").

    Keys, written by global rank zero every ``log_every_n_steps`` attempted updates and at the end of training, each
    over the attempted updates since the previous point (those marked † only where they apply):

    ==================================== =======================================================================
    ``accum/<axis>``                     x, the axis's count (an int)
    ``accum/loss`` †                     the window's loss weighted by units
    ``accum/lr`` (``/pg{i}`` †)          the rate the window's last update used
    ``accum/tokens_per_update``          mean supervised tokens per attempted update (over every replica)
    ``accum/samples_per_update``         mean samples per attempted update
    ``accum/documents_per_update`` †     mean documents per attempted update
    ``accum/skipped_updates``            updates skipped so far
    ``accum/grad_scale`` †               the GradScaler's scale at the window's last update
    ``accum/global_batch`` †             the samples per update of the last update's stage (``batch_schedule=``)
    ``accum/global_batch_tokens`` †      the same in tokens (``batch_unit="tokens"``)
    ``accum/batch_stage`` †              the last update's stage index
    ``accum/padded_tokens_per_update`` † ``token_batches=``: mean Σ rows × longest row over its micro-batches
    ``accum/microbatches_per_update`` †  ``token_batches=``: mean micro-batches per replica
    ``accum/padding_fraction`` †         ``token_batches=``: 1 − the window's row tokens / its padded tokens
    ==================================== =======================================================================

    Args:
        axis: ``"tokens"``, ``"samples"``, ``"documents"`` or ``"updates"`` (applied updates).
        prefix: Prefix of the group metrics' keys, the axis metric's included.

    Raises:
        ValueError: For an unknown ``axis``.
        RuntimeError: The Trainer's strategy is not an accumulation strategy, or the run reports no counts of
            ``axis`` (tokens: before the first backward; documents: at the first update).

    Example:
        >>> import lightning as L
        >>> import lightning_accum
        >>> trainer = L.Trainer(strategy="accum", callbacks=[lightning_accum.AxisLogger(axis="tokens")],
        ...                     accelerator="cpu", logger=False, enable_checkpointing=False)
    """

    def __init__(self, axis: str = "tokens", prefix: str = "accum/") -> None:
        self.axis = validate_choice("axis", axis, AXES)
        self.prefix = prefix
        # Per logger: the logger, the patch of its `log_metrics` (its `below` is the logger's own method), and whether
        # that method is given x as its `step` (not a W&B logger's: see `_write`).
        self._originals: dict[int, tuple[Logger, InstancePatch, bool]] = {}
        self._last_x: dict[tuple[int, str], int] = {}
        self._high_x = -1  # the highest x written, over every fit of this callback
        self._offset = 0  # added to the ledger's count in this fit (a later fit continues the axis)
        self._window: list[GroupRecord] = []
        self._window_plan: list[dict[str, Any]] = []  # under `token_batches=`: the plan's stats of each group
        self._window_lrs: list[float] = []
        self._window_stage: dict[str, int] | None = None  # under `batch_schedule=`: the last update's stage
        # LearningRateMonitor's values per logger, held until the update that uses them closes.
        self._held_rates: dict[int, dict[str, float]] = {}
        self._rate_monitors: list[LearningRateMonitor] = []
        # Per fit: the ledger, whether this rank writes, the optimizer's parameter groups and the cadence (read at the
        # first update); and whether the axis's counts were found (checked until they are).
        self._run: tuple[AccumulationLedger, bool, list[dict[str, Any]], int] | None = None
        self._counts_checked = False
        self._checked_unit = False
        self._progress_patch: InstancePatch | None = None
        self._trainer: Trainer | None = None
        self._state_key: str | None = None

    @property
    def axis_key(self) -> str:
        """The axis metric's key, ``<prefix><axis>``."""
        return f"{self.prefix}{self.axis}"

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
        self._release(trainer)  # what an earlier entry point left (none unless its end was never reached)
        self._trainer = trainer
        self._offset = 0
        self._window, self._window_plan = [], []
        self._checked_unit = False
        self._counts_checked = False
        # `trainer.callbacks`: Lightning's public list, assigned by its callback connector (not declared on the class).
        callbacks = trainer.callbacks  # type: ignore[attr-defined]
        self._rate_monitors = [cb for cb in callbacks if isinstance(cb, LearningRateMonitor)]
        for logger in trainer.loggers:
            self._move_onto_axis(trainer, logger)
        # Called once per group, after the update and before the schedules advance: no hook on every micro-batch.
        strategy.add_group_listener(self._on_group)
        bar = trainer.progress_bar_callback
        if bar is not None:

            def get_metrics(original: Callable[..., Any], trainer: Trainer, pl_module: LightningModule) -> Any:
                return {**original(trainer, pl_module), **self._progress_fields(trainer)}

            self._progress_patch = InstancePatch(bar, "get_metrics", get_metrics)

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
            raise no_counts_error("AxisLogger", "tokens")

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._held_rates = {}  # rates read for an update that never came: no x to plot them at
        self._flush(trainer)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._release(trainer)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._release(trainer)  # Lightning calls no callback's `teardown` after an exception

    def _release(self, trainer: Trainer) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, ExactAccumulation):
            strategy.remove_group_listener(self._on_group)
        self._trainer = None
        self._run = None
        self._held_rates = {}
        self._rate_monitors = []
        for _, patch, _ in self._originals.values():
            patch.release()
        self._originals.clear()
        if self._progress_patch is not None:
            self._progress_patch.release()
        self._progress_patch = None

    def _move_onto_axis(self, trainer: Trainer, logger: Logger) -> None:
        # `Logger.log_metrics(metrics, step)` is the public method every logger implements; Lightning passes its own
        # step to it. Wrapped on the instance (a proxy logger would break `isinstance` checks on `trainer.logger`).
        if id(logger) in self._originals:
            return
        if isinstance(logger, WandbLogger) and trainer.is_global_zero:
            self._define_wandb_axis(logger)

        def log_metrics(metrics: Mapping[str, float], step: int | None = None) -> None:
            if self._rate_monitors and trainer.training:
                metrics = self._hold_rates(logger, metrics)
            if metrics:
                self._write(id(logger), metrics, self.axis_value(self._ledger(trainer)))

        patch = InstancePatch(logger, "log_metrics", log_metrics, wraps=False)
        self._originals[id(logger)] = (logger, patch, not isinstance(logger, WandbLogger))

    def _define_wandb_axis(self, logger: WandbLogger) -> None:
        # Replaces WandbLogger's own definition of the charts' x (its step key, `trainer/global_step` up to Lightning
        # 2.6, `global_step` from 2.7: Lightning-AI/pytorch-lightning#21782), whatever that key is.
        run = logger.experiment  # creates the W&B run now if Lightning has not yet
        run.define_metric(self.axis_key)
        run.define_metric("*", step_metric=self.axis_key, step_sync=True)

    def _hold_rates(self, logger: Logger, metrics: Mapping[str, float]) -> Mapping[str, float]:
        """Hold a LearningRateMonitor's values until the update that uses them closes; return the rest."""
        keys: set[str] = set()
        for monitor in self._rate_monitors:
            for names in ("lrs", "last_momentum_values", "last_weight_decay_values"):
                keys.update(getattr(monitor, names, ()))
        if keys.isdisjoint(metrics):
            return metrics
        # The latest value per key: the rate at the group's last micro-batch is the one its update uses.
        self._held_rates.setdefault(id(logger), {}).update({k: v for k, v in metrics.items() if k in keys})
        return {k: v for k, v in metrics.items() if k not in keys}

    def _write(self, logger_id: int, metrics: Mapping[str, float], x: int) -> None:
        # At most one write per (tag, x), and x never goes back for a tag: the first value at an x is kept.
        _, patch, pass_step = self._originals[logger_id]
        fresh: dict[str, float] = {}
        for tag, value in metrics.items():
            key = (logger_id, tag)
            if self._last_x.get(key, -1) < x:
                self._last_x[key] = x
                fresh[tag] = value
        if fresh:
            self._high_x = max(self._high_x, x)
            # The axis metric: in every row of a CSV file (a row is what a reader plots from), once per x elsewhere
            # (TensorBoard and MLflow keep points, W&B fills a row's x in from the latest one: `step_sync`).
            axis = (logger_id, self.axis_key)
            if isinstance(self._originals[logger_id][0], CSVLogger) or self._last_x.get(axis, -1) < x:
                self._last_x[axis] = x
                fresh[self.axis_key] = x
            # A W&B logger gets no `step`: it would add it to every row under its step key, naming the count as
            # Lightning's step; without it W&B's own `_step` numbers the rows and x is the axis metric.
            patch.below(fresh, step=x if pass_step else None)

    def _progress_fields(self, trainer: Trainer) -> dict[str, int | str]:
        ledger = self._ledger(trainer)
        if self.axis == "documents":
            seen = format_count(ledger.documents, "doc")
        elif ledger.tokens > 0 or self.axis == "tokens":
            seen = format_count(ledger.tokens, "tok")
        else:
            seen = format_count(ledger.samples, "sp")
        return {"seen": seen, "skipped": str(ledger.skipped_total)}  # text: Rich's bar shows every number as "0.000"

    # ------------------------------------------------------------------ group metrics

    def _on_group(self, group: GroupRecord, batch_samples: Sequence[int]) -> None:
        trainer = self._trainer
        if trainer is None or group.dropped:
            return  # a dropped group is no attempt: nothing is written for it
        if self._run is None:  # read once per fit, at its first update: what every update of the fit reads
            optimizers = trainer.optimizers
            param_groups = optimizers[0].param_groups if optimizers else []
            # `trainer.log_every_n_steps`: set by Lightning's logger connector (public, not declared on the class).
            every = int(getattr(trainer, "log_every_n_steps", 1) or 1)
            self._run = (self._ledger(trainer), trainer.is_global_zero, param_groups, every)
        ledger, writes, param_groups, every = self._run
        if not self._counts_checked:  # until the run weighs by the axis, whose every later update then counts it
            self._counts_checked = check_counts_reported("AxisLogger", self.axis, ledger)
        if not writes:
            self._held_rates = {}  # another rank: its loggers write nothing
            return
        self._window.append(group)
        plan = token_group_stats(trainer)  # the plan's numbers of the group just closed: no device read
        self._window_plan += [] if plan is None else [plan]
        stages = getattr(trainer.strategy, "batch_stages", None)  # the stage of the group closing is the last one
        self._window_stage = stages[-1] if stages else None
        # The schedules advance after the listeners: this is the rate the update used.
        self._window_lrs = [lr if type(lr := pg["lr"]) is float else float(lr) for pg in param_groups]
        # LearningRateMonitor's values read for this update land at its x, in one record with the point (if any).
        held, self._held_rates = self._held_rates, {}
        point = self._point(ledger) if ledger.updates_attempted % every == 0 else {}
        if not point and not held:
            return  # between two points of the cadence: nothing to write
        x = self.axis_value(ledger)
        for logger_id in self._originals:
            record = point | held.get(logger_id, {})
            if record:
                self._write(logger_id, record, x)

    def _flush(self, trainer: Trainer) -> None:
        if not self._window or not trainer.is_global_zero:
            return
        ledger = self._ledger(trainer)
        metrics = self._point(ledger)
        x = self.axis_value(ledger)
        for logger_id in self._originals:
            self._write(logger_id, metrics, x)

    def _point(self, ledger: AccumulationLedger) -> dict[str, float]:
        records, self._window = self._window, []
        window = window_metrics(records, ledger.normalization) | _plan_metrics(self._window_plan)
        self._window_plan = []
        metrics: dict[str, float] = {f"{self.prefix}{key}": value for key, value in window.items()}
        lrs = self._window_lrs
        if len(lrs) == 1:
            metrics[f"{self.prefix}lr"] = lrs[0]
        else:
            metrics.update({f"{self.prefix}lr/pg{i}": lr for i, lr in enumerate(lrs)})
        metrics[f"{self.prefix}skipped_updates"] = ledger.skipped_total
        if records[-1].grad_scale is not None:
            metrics[f"{self.prefix}grad_scale"] = records[-1].grad_scale
        stage = self._window_stage
        if stage is not None:
            metrics[f"{self.prefix}global_batch"] = stage["samples_per_update"]
            metrics[f"{self.prefix}batch_stage"] = stage["stage"]
            if stage.get("tokens_per_update") is not None:
                metrics[f"{self.prefix}global_batch_tokens"] = stage["tokens_per_update"]
        return metrics
