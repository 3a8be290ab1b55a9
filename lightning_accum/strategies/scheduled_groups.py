"""A batch schedule in a Trainer: each group's size, decided at its start from the run's stage (docs/howto.md, "Ramp
the batch by tokens").
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from lightning_accum.axis_lr import check_counts_reported
from lightning_accum.batch_schedule import BatchSchedule, Stage
from lightning_accum.ledger import GroupRecord
from lightning_accum.slicing import SplitBatch, count_samples
from lightning_accum.strategies.group_boundaries import GroupSizer

__all__ = ["ScheduledGroups", "loader_batch_size"]


class ScheduledGroups:
    """The groups of a fit under a :class:`~lightning_accum.BatchSchedule`: sizes, learning-rate factor, stages."""

    def __init__(self, schedule: BatchSchedule | None) -> None:
        self.schedule = schedule
        self.microbatch_size: int | None = None  # m: the samples of the fit's first batch on one replica
        self.stage: Stage | None = None  # the stage of the open group
        self.stages: list[dict[str, int]] = []  # per stage reached: what its groups consumed
        self._counts_checked = False
        self._resumed = False  # `stages` holds a checkpoint's record, for the fit that resumes from it

    def load_state(self, stages: list[dict[str, int]] | None) -> None:
        """A fit resumes from a checkpoint whose entry holds ``stages`` (``None``: none)."""
        self.stages = [dict(stage) for stage in stages or []] if self.schedule is not None else []
        self._resumed = True

    def forget_resume(self) -> None:
        self._resumed = False

    def start(self, trainer: Trainer, core: Any, split_batch: SplitBatch | None) -> GroupSizer | None:
        """The sizer of the fit's groups (``None`` without a schedule); ``ValueError`` for what cannot share them."""
        self.microbatch_size, self.stage, self._counts_checked = None, None, False
        if not self._resumed:  # (a resumed run without a schedule loaded none)
            self.stages = []
        self._resumed = False
        if self.schedule is None:
            return None
        if not trainer.lightning_module.automatic_optimization:
            raise ValueError(
                f"`batch_schedule={self.schedule!r}` sets the groups of automatic optimization, but this"
                " LightningModule sets `automatic_optimization = False`. In a manual loop ask the schedule for each"
                " group's size, `schedule.microbatches(self.trainer.strategy.ledger, m, D)`, and pass it to"
                " `close_group(optimizer, group_size=...)`; or remove `batch_schedule=`."
            )
        callbacks = trainer.callbacks  # type: ignore[attr-defined]  # assigned by its callback connector
        if any(isinstance(c, GradientAccumulationScheduler) for c in callbacks):
            raise ValueError(
                "`batch_schedule=` and Lightning's `GradientAccumulationScheduler` (or `accumulate_grad_batches={...}`)"
                " would both set `accumulate_grad_batches`. Keep one: state the epochs' sizes as a schedule on"
                " samples, or remove `batch_schedule=`."
            )
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"`batch_schedule=` sets each group's size, but the Trainer has"
                f" `accumulate_grad_batches={trainer.accumulate_grad_batches}`. Remove `accumulate_grad_batches` from"
                " the Trainer (the schedule's batches divided by m × D are the sizes)."
            )
        m = loader_batch_size(trainer.train_dataloader)
        if m is not None:  # else at the first batch, from its samples
            self.schedule.check(m, core.adapter.data_parallel_size)
        return partial(self.group_size, core, split_batch)

    def group_size(self, core: Any, split: SplitBatch | None, batch: Any, batch_idx: int, resumed: int | None) -> int:
        """The :data:`~lightning_accum.strategies.group_boundaries.GroupSizer` of the schedule."""
        schedule = self.schedule
        assert schedule is not None
        ledger, replicas = core.engine.ledger, core.adapter.data_parallel_size
        if self.microbatch_size is None:  # the fit's first group
            self.microbatch_size = count_samples(batch, split)
            schedule.check(self.microbatch_size, replicas)
            if resumed is not None:
                self.enter(schedule.stage_at(ledger), resumed)
                return resumed
        if not self._counts_checked and ledger.updates_attempted:
            self._counts_checked = check_counts_reported("BatchSchedule", schedule.axis, ledger)
        stage = schedule.stage_at(ledger)
        size = stage.samples // (self.microbatch_size * replicas)
        self.enter(stage, size)
        return size

    def enter(self, stage: Stage, size: int) -> None:
        """A group of ``size`` micro-batches per replica starts in ``stage``: recorded, its learning-rate factor set."""
        self.stage = stage
        last = self.stages[-1] if self.stages else None
        key = (stage.index, stage.threshold, stage.samples)
        if last is None or (last["stage"], last["threshold"], last["samples_per_update"]) != key:
            last = {"stage": stage.index, "threshold": stage.threshold, "samples_per_update": stage.samples}
            last |= {} if stage.tokens is None else {"tokens_per_update": stage.tokens}
            last |= {"updates": 0, "attempts": 0, "samples": 0, "tokens": 0}
            self.stages.append(last)
        last["accumulate_grad_batches"] = size

    def on_group(self, record: GroupRecord, batch_samples: Sequence[int]) -> None:
        """Listener of closed groups: add a group to its stage's record."""
        if not self.stages or record.dropped:
            return
        spent = self.stages[-1]
        spent["attempts"] += 1
        spent["updates"] += int(record.applied)
        spent["samples"] += record.samples
        spent["tokens"] += record.tokens

    @contextmanager
    def scaled_lr(self, optimizer: Optimizer) -> Iterator[None]:
        """``optimizer``'s learning rates times the stage's factor for the update only."""
        factor = 1.0 if self.schedule is None or self.stage is None else self.schedule.lr_factor(self.stage)
        if factor == 1.0:
            yield
            return
        rates = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * factor
        try:
            yield
        finally:
            for group, rate in zip(optimizer.param_groups, rates, strict=True):
                group["lr"] = rate


def loader_batch_size(loader: Any) -> int | None:
    """``m`` as a ``DataLoader``'s ``batch_size`` states it before its first batch, else ``None``."""
    size = loader.batch_size if isinstance(loader, DataLoader) else None
    return size if isinstance(size, int) and size > 0 else None
