"""A batch schedule in a Trainer: the size of each group set at its start, where Lightning's grouping reads it.

Decision: the schedule is a strategy argument (``batch_schedule=``), not a callback. The group's size is the
strategy's arithmetic (its target ``A`` is the partial-group policy's denominator, the checkpoint's configuration and
the entry's open group record it), the strategy's options reach LightningCLI's config and ``--help``, and a callback
would run its ``on_train_batch_start`` among the user's callbacks, in an order nobody controls.

Lightning ends a group where the batch's position modulo ``trainer.accumulate_grad_batches`` is 0. At each group's
first batch (the strategy's ``on_train_batch_start``, after the callbacks' and before the batch runs)
:class:`ScheduledGroups` reads the group's stage from the ledger and sets that attribute to a
:class:`~lightning_accum.batch_schedule.GroupSize`, whose modulo counts from the group's first batch, so Lightning's
own checks end the group after exactly its scheduled size. Every stage's batch is checked against ``m × D`` in the
strategy's ``on_train_start`` (or at the first batch, for a loader without ``batch_size``). What each stage reached
consumed (:attr:`stages`) is written into the checkpoint's entry and restored by a fit that resumes from it, only
for groups of the same stage. The rules: docs/howto.md, "Ramp the batch by tokens".
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from lightning_accum.axis_lr import check_counts_reported
from lightning_accum.batch_schedule import BatchSchedule, GroupSize, Stage
from lightning_accum.ledger import GroupRecord
from lightning_accum.slicing import SplitBatch, count_samples

__all__ = ["ScheduledGroups", "loader_batch_size"]


class ScheduledGroups:
    """The groups of a fit under a :class:`~lightning_accum.BatchSchedule`: their sizes, their learning-rate factor,
    and what each stage reached has consumed."""

    def __init__(self, schedule: BatchSchedule | None) -> None:
        self.schedule = schedule
        self.microbatch_size: int | None = None  # m: the samples of the fit's first batch on one replica
        self.stage: Stage | None = None  # the stage of the open group
        self.stages: list[dict[str, int]] = []  # per stage reached: what its groups consumed
        self._counts_checked = False
        self._given = 1
        self._resumed = False  # `stages` holds a checkpoint's record, for the fit that resumes from it

    def load_state(self, stages: list[dict[str, int]] | None) -> None:
        """A fit resumes from a checkpoint whose entry holds ``stages`` (``None``: a checkpoint without the record):
        its record continues from there (read by :meth:`start`; a run without a schedule keeps none)."""
        self.stages = [dict(stage) for stage in stages or []] if self.schedule is not None else []
        self._resumed = True

    def forget_resume(self) -> None:
        """The entry point ends: a checkpoint's record read by a fit that never started training reaches no later
        fit."""
        self._resumed = False

    def start(self, trainer: Trainer, replicas: int) -> None:
        """Refuse what cannot share the groups with the schedule, and a stage's batch that is not a multiple of the
        loader's ``batch_size`` × ``replicas`` (``D``); forget the previous fit's batch size, and its record unless
        the fit resumes from a checkpoint."""
        self.microbatch_size, self.stage, self._counts_checked = None, None, False
        if not self._resumed:  # (a resumed run without a schedule loaded none)
            self.stages = []
        self._resumed = False
        if self.schedule is None:
            return
        self._given = trainer.accumulate_grad_batches  # the Trainer's own value, given back by `end`
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
            self.schedule.check(m, replicas)

    def end(self, trainer: Trainer) -> None:
        """Give the Trainer back its own ``accumulate_grad_batches`` (the fit's groups end with it)."""
        if isinstance(trainer.accumulate_grad_batches, GroupSize):
            trainer.accumulate_grad_batches = self._given

    def batch_start(
        self, trainer: Trainer, batch: Any, batch_idx: int, core: Any, split_batch: SplitBatch | None
    ) -> None:
        """Before a training batch: at a group's first batch, set ``trainer.accumulate_grad_batches`` to the size of
        the stage the ledger is in (at the fit's first batch a group resumed from a checkpoint keeps its size).
        ``core``: the strategy's core (its ledger, ``D``, a checkpoint's group), read at a group's first batch only."""
        schedule = self.schedule
        if schedule is None:
            return
        first = self.microbatch_size is None
        if not first and batch_idx and batch_idx % trainer.accumulate_grad_batches:
            return  # inside a group: its size stays
        ledger, replicas = core.engine.ledger, core.data_parallel_replicas
        if first:
            self.microbatch_size = count_samples(batch, split_batch)
            schedule.check(self.microbatch_size, replicas)
            resumed = core.group.loaded
            done = int(resumed.get("microbatches", 0)) if resumed else 0
            if done:  # the checkpoint's group: its size as written, its first batch `done` batches back
                size = int(resumed.get("accumulate") or (resumed.get("config") or {}).get("accumulate") or 1)  # type: ignore[union-attr]
                trainer.accumulate_grad_batches = GroupSize(size, phase=batch_idx - done)
                self._enter(schedule.stage_at(ledger), size)
                return
        if not self._counts_checked and ledger.updates_attempted:
            self._counts_checked = check_counts_reported("BatchSchedule", schedule.axis, ledger)
        assert self.microbatch_size is not None
        stage = schedule.stage_at(ledger)
        size = stage.samples // (self.microbatch_size * replicas)
        trainer.accumulate_grad_batches = GroupSize(size, phase=batch_idx)
        self._enter(stage, size)

    def _enter(self, stage: Stage, size: int) -> None:
        """A group of ``size`` micro-batches per replica starts in ``stage``: its record entry, new or continued."""
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
        """Listener of closed groups: add a group to its stage's record (a dropped partial group adds nothing)."""
        if not self.stages or record.dropped:
            return
        spent = self.stages[-1]
        spent["attempts"] += 1
        spent["updates"] += int(record.applied)
        spent["samples"] += record.samples
        spent["tokens"] += record.tokens

    @contextmanager
    def scaled_lr(self, optimizer: Optimizer) -> Iterator[None]:
        """The learning rates of ``optimizer`` times the open group's stage factor (``lr_scaling``) for the update
        only; what the user's scheduler set is given back after it, so no scheduler reads the factor back."""
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
    """``m`` as a training loader states it before its first batch: a ``DataLoader``'s ``batch_size`` (``None``
    where it batches by a ``batch_sampler``, or is not a ``DataLoader``: its first batch tells)."""
    size = loader.batch_size if isinstance(loader, DataLoader) else None
    return size if isinstance(size, int) and size > 0 else None
