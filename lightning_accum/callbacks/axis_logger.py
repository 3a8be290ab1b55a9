"""Log every curve of a run on an explicit axis: tokens, samples or applied updates."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import Logger, TensorBoardLogger
from typing_extensions import override

from lightning_accum.callbacks._hooks import attach, detach
from lightning_accum.engine import validate_choice
from lightning_accum.ledger import AccumulationLedger, GroupRecord

__all__ = ["AXES", "AxisLogger", "format_count"]

#: The axes a run can be logged on, and the ledger counter each one reads.
AXES: dict[str, str] = {"tokens": "tokens", "samples": "samples", "updates": "updates_applied"}


def format_count(value: int, unit: str = "") -> str:
    """A short, readable count for the progress bar.

    Example:
        >>> format_count(1_234_567, "tok"), format_count(950), format_count(12_300, "sp")
        ('1.2M tok', '950', '12.3k sp')
    """
    suffix = f" {unit}" if unit else ""
    for size, letter in ((10**12, "T"), (10**9, "G"), (10**6, "M"), (10**3, "k")):
        if abs(value) >= size:
            return f"{value / size:.1f}{letter}{suffix}"
    return f"{value}{suffix}"


class AxisLogger(Callback):
    """Write the group metrics, and move every other logged scalar, onto one explicit x-axis.

    Lightning logs against "batches that stepped", on which runs with different micro-batch size ``m``,
    accumulation ``A`` or replica count ``D`` cannot be compared. With ``axis="tokens"`` (or
    ``"samples"``), every curve of the run (the keys below, ``self.log`` in training and validation
    hooks, ``LearningRateMonitor``) is written at x = the exact global count from
    ``trainer.strategy.ledger`` at that moment, so runs of different ``(m, A, D)`` overlay. x is a
    Python int (no float32 rounding above 2^24), never decreases (also across a resume, since the ledger
    is restored), and each tag is written at most once per x: the first value written there is kept, so
    the duplicates ``LearningRateMonitor`` emits on every micro-batch of a group disappear.

    Keys written after every attempted update, to every logger of the Trainer, on global rank zero:

    =============================== ================== ================================= ===================
    key                             unit               x-axis                            over ranks
    =============================== ================== ================================= ===================
    ``accum/loss``                  loss               axis value after the update       token-weighted, all
    ``accum/lr`` (``/pg{i}``)       learning rate      axis value after the update       same on every rank
    ``accum/tokens_per_update``     supervised tokens  axis value after the update       summed
    ``accum/samples_per_update``    samples            axis value after the update       summed
    ``accum/skipped_updates``       updates (total)    axis value after the update       same on every rank
    ``accum/grad_scale``            GradScaler scale   axis value after the update       same on every rank
    =============================== ================== ================================= ===================

    ``accum/loss`` is not written for a group without units or with a non-finite loss; ``accum/lr`` is the
    rate the update used (one key per parameter group when there are several); ``accum/grad_scale`` only
    with a GradScaler. With ``axis="updates"`` x counts *applied* updates, so a skipped update writes
    nothing new. The progress bar shows the tokens (or samples) seen and the skipped updates.

    Args:
        axis: ``"tokens"``, ``"samples"`` or ``"updates"``.
        prefix: Prefix of the group metrics' keys.

    Raises:
        ValueError: For an unknown ``axis``.
        RuntimeError: When the Trainer's strategy is not an accumulation strategy, or ``axis="tokens"``
            while the run reports no token counts.

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
        """The current x: the ledger's count for the chosen axis."""
        return int(getattr(ledger, AXES[self.axis]))

    @staticmethod
    def _ledger(trainer: Trainer) -> AccumulationLedger:
        return trainer.strategy.ledger  # type: ignore[attr-defined, no-any-return]

    # ------------------------------------------------------------------ set-up and tear-down

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        from lightning_accum.strategies import _ExactAccumulation

        if not isinstance(trainer.strategy, _ExactAccumulation):
            raise RuntimeError(
                f"AxisLogger needs an accumulation strategy, but the Trainer uses {type(trainer.strategy).__name__}."
                " Set `Trainer(strategy='accum')` on one device or `strategy='accum_ddp'` (or 'accum_ddp_spawn')"
                " on several."
            )
        for logger in trainer.loggers:
            self._move_onto_axis(trainer, logger)
        # Called once per group, after the update and before the schedules advance: no hook on every micro-batch.
        self._trainer = trainer
        attach(self, trainer, self._on_group)
        bar = trainer.progress_bar_callback
        if bar is not None and self._progress_original is None:
            self._progress_original = bar.get_metrics
            original = bar.get_metrics

            def get_metrics(
                trainer: Trainer, pl_module: LightningModule
            ) -> dict[str, int | str | float | dict[str, float]]:
                metrics = original(trainer, pl_module)
                metrics.update(self._progress_fields(trainer))
                return metrics  # type: ignore[no-any-return]

            bar.get_metrics = get_metrics  # type: ignore[method-assign]

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        detach(self, trainer, self._on_group)
        self._trainer = None
        for logger, original in self._originals.values():
            logger.log_metrics = original  # type: ignore[method-assign]
        self._originals.clear()
        bar = trainer.progress_bar_callback
        if bar is not None and self._progress_original is not None:
            bar.get_metrics = self._progress_original  # type: ignore[method-assign]
        self._progress_original = None

    def _move_onto_axis(self, trainer: Trainer, logger: Logger) -> None:
        if id(logger) in self._originals:
            return
        original = logger.log_metrics
        self._originals[id(logger)] = (logger, original)

        def log_metrics(metrics: Mapping[str, float], step: int | None = None) -> None:
            self._write(logger, original, metrics, self.axis_value(self._ledger(trainer)))

        logger.log_metrics = log_metrics  # type: ignore[method-assign]

    def _write(
        self,
        logger: Logger,
        original: Callable[..., Any],
        metrics: Mapping[str, float],
        x: int,
        one_event: bool = False,
    ) -> None:
        # At most one write per (tag, x), and x never goes back for a tag: the first value at an x is kept.
        fresh = {}
        for tag, value in metrics.items():
            key = (id(logger), tag)
            if self._last_x.get(key, -1) < x:
                self._last_x[key] = x
                fresh[tag] = value
        if fresh and not (one_event and _write_one_event(logger, fresh, x)):
            original(fresh, step=x)

    def _progress_fields(self, trainer: Trainer) -> dict[str, int | str]:
        ledger = self._ledger(trainer)
        fields: dict[str, int | str] = {}
        if ledger.tokens > 0 or self.axis == "tokens":
            fields["seen"] = format_count(ledger.tokens, "tok")
        else:
            fields["seen"] = format_count(ledger.samples, "sp")
        fields["skipped"] = ledger.skipped_total
        return fields

    # ------------------------------------------------------------------ group metrics

    def _on_group(self, group: GroupRecord, batch_samples: Sequence[int]) -> None:
        trainer = self._trainer
        if trainer is None or group.dropped:
            return  # a dropped group is no attempt: nothing is written for it
        ledger = self._ledger(trainer)
        if self.axis == "tokens" and ledger.tokens == 0 and ledger.normalization != "tokens":
            raise RuntimeError(
                "AxisLogger(axis='tokens') needs token counts, but the run reports none. Return"
                " `{'loss': loss, 'num_tokens': (labels != -100).sum()}` from `training_step`, pass `count_tokens=`"
                " to the strategy, or use `AxisLogger(axis='samples')`."
            )
        if trainer.is_global_zero:
            # The schedules advance after the listeners: this is the rate the update used.
            lrs = [float(param_group["lr"]) for param_group in trainer.optimizers[0].param_groups]
            self._write_group(trainer, ledger, group, lrs)

    def _write_group(self, trainer: Trainer, ledger: AccumulationLedger, group: GroupRecord, lrs: list[float]) -> None:
        metrics: dict[str, float] = {}
        if group.tokens > 0 or group.samples > 0:
            if math.isfinite(group.loss):
                metrics[f"{self.prefix}loss"] = group.loss
        if len(lrs) == 1:
            metrics[f"{self.prefix}lr"] = lrs[0]
        else:
            metrics.update({f"{self.prefix}lr/pg{i}": lr for i, lr in enumerate(lrs)})
        metrics[f"{self.prefix}tokens_per_update"] = group.tokens
        metrics[f"{self.prefix}samples_per_update"] = group.samples
        metrics[f"{self.prefix}skipped_updates"] = ledger.skipped_total
        if group.grad_scale is not None:
            metrics[f"{self.prefix}grad_scale"] = group.grad_scale
        x = self.axis_value(ledger)
        for logger, original in self._originals.values():
            self._write(logger, original, metrics, x, one_event=True)


def _write_one_event(logger: Logger, metrics: Mapping[str, float], step: int) -> bool:
    """Write plain scalars to a ``TensorBoardLogger`` as one event (one ``Summary`` with a value per tag).

    What ``logger.log_metrics`` writes as one event per tag, read back identically (same tags, steps and float32
    ``simple_value``s) at about a quarter of the cost, once per update. Returns False, writing nothing, for any
    other logger, a logger with a ``prefix``, or a writer other than torch's ``SummaryWriter`` (the caller then uses
    ``log_metrics``).
    """
    if type(logger) is not TensorBoardLogger or logger._prefix:
        return False
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # Lightning then writes with tensorboardX
        return False
    writer = logger.experiment
    get_file_writer = getattr(writer, "_get_file_writer", None)
    if not isinstance(writer, SummaryWriter) or get_file_writer is None:
        return False
    from tensorboard.compat.proto.summary_pb2 import Summary

    summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(value)) for tag, value in metrics.items()])
    get_file_writer().add_summary(summary, step)
    return True
