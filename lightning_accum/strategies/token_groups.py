"""``token_batches=`` in a Trainer: the training loader cut by tokens, its groups and each epoch's count told to
Lightning's loop. Why a strategy option and the loop's names written: docs/internals.md, "Micro-batches cut by tokens".
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
from lightning.pytorch import Trainer

from lightning_accum.batch_schedule import Stage
from lightning_accum.sampler import GlobalOrderSampler
from lightning_accum.strategies.global_order import processed_microbatches
from lightning_accum.strategies.group_boundaries import GroupSizer
from lightning_accum.strategies.scheduled_groups import ScheduledGroups
from lightning_accum.token_batches import TokenBatches, TokenBatchSampler

__all__ = ["TokenGroups"]


class TokenGroups:
    """A fit's training loader under ``token_batches=``: re-created around a :class:`~lightning_accum.TokenBatchSampler`
    (:meth:`install`), its groups' sizer (:meth:`start`) with ``batch_schedule=``'s stages, each epoch's count set in
    Lightning's loop, its state."""

    def __init__(self, options: TokenBatches | None, scheduled: ScheduledGroups | None = None) -> None:
        if options is not None and not isinstance(options, TokenBatches):
            raise TypeError(
                f"`token_batches` must be a `lightning_accum.TokenBatches` or None, got {type(options).__name__}."
                " Pass e.g. `token_batches=TokenBatches(max_tokens=4096, lengths='input_ids')`."
            )
        self.scheduled = scheduled or ScheduledGroups(None)  # the stages of `batch_schedule=`, recorded
        self.schedule = self.scheduled.schedule
        if options is not None and self.schedule is not None and options.samples_per_update is not None:
            raise ValueError(
                f"`TokenBatches(samples_per_update={options.samples_per_update!r})` beside `batch_schedule=`: the"
                " schedule's stages set each group's B. Drop one of them."
            )
        self.options, self.accumulate = options, 1  # `accumulate`: the Trainer's as given, the fixed run's A
        self.sampler: TokenBatchSampler | None = None  # the training loader's, for the fit
        self._trainer: Trainer | None = None
        self._sizes: list[int] = []  # the running epoch's micro-batches per replica of each group, planned on need
        self._spans: list[tuple[int, int, int]] = []  # their first position, rows and B
        self._starts: list[int] = []  # their first batch in Lightning's count of the epoch
        self._loaded: Mapping[str, Any] = {}  # the sampler state a checkpoint's loader state continues
        self._stages: tuple[tuple[int, int], dict[int, tuple[int, Stage]]] = ((-1, -1), {})

    def install(self, loader: Any, trainer: Trainer, layout: Mapping[str, int] | None) -> Any:
        """The training ``loader`` (as ``process_dataloader`` receives it) batched by tokens; raises as
        :meth:`TokenBatches.loader <lightning_accum.TokenBatches.loader>`."""
        assert self.options is not None
        replicas, rank = (layout["num_replicas"], layout["rank"]) if layout else (1, 0)
        options, accumulate = self.options, self.accumulate
        if self.schedule is not None:  # each group's B is its stage's, planned with the epoch (`_stage_table`)
            self.schedule.check(1, replicas)
            options, accumulate = dataclasses.replace(options, samples_per_update=self._stage_samples), 1
        ours = options.loader(loader, replicas, rank, int(os.getenv("PL_GLOBAL_SEED", "0")), accumulate)
        assert ours is not None and isinstance(ours.batch_sampler, TokenBatchSampler)  # or refused
        self.sampler, self._trainer, self._sizes, self._loaded = ours.batch_sampler, trainer, [], {}
        self._stages = ((-1, -1), {})
        self.sampler.sampler.set_epoch = self._set_epoch  # type: ignore[method-assign]  # Lightning calls it first
        # Plain attributes of the loader made for this fit, as `global_order=True`'s: Lightning saves and restores it.
        ours.state_dict = self._state  # type: ignore[attr-defined]
        ours.load_state_dict = self._load  # type: ignore[attr-defined]
        return ours

    def start(self, trainer: Trainer) -> GroupSizer | None:
        """The sizer of the fit's groups (``None`` without ``token_batches=``); a manual loop is refused."""
        if self.options is not None and not trainer.lightning_module.automatic_optimization:
            raise ValueError(
                "`token_batches=` sets the groups of automatic optimization, but this LightningModule sets"
                " `automatic_optimization = False`. Batch the loader with a `TokenBatchSampler` and close each group"
                " where `sampler.groups(loader)` ends it, or use a Fabric loop (docs/howto.md)."
            )
        return None if self.options is None else self.group_size

    def group_size(self, batch: Any, batch_idx: int, resumed: int | None) -> int:
        """The :data:`~lightning_accum.strategies.group_boundaries.GroupSizer`: the plan's group at ``batch_idx``
        (a checkpoint's open group: the one holding it); an epoch's last group of fewer rows than ``B`` is partial,
        its size ``⌈k·B / rows⌉`` for its ``k`` micro-batches, so that the epoch's end closes it."""
        sampler = self.sampler
        assert sampler is not None
        if not self._sizes:
            self._sizes, self._spans = sampler.group_sizes(), sampler.group_spans()
            first = len(sampler) - sum(self._sizes)  # the open group a resumed epoch continues started that far back
            self._starts = list(itertools.accumulate(self._sizes[:-1], initial=first))
        k = bisect.bisect_right(self._starts, batch_idx) - 1
        if k < 0 or (resumed is None and self._starts[k] != batch_idx):
            raise RuntimeError(
                f"Lightning starts a group at batch {batch_idx} of epoch {sampler.epoch}, where the token plan has"
                " none: leave the training loader's batch sampler and `trainer.fit_loop.max_batches` to the strategy."
            )
        (position, rows, samples), size = self._spans[k], self._sizes[k]
        if self.schedule is not None:
            self._enter(position, size)
        return size if rows == samples else -(-size * samples // rows)

    def _enter(self, position: int, size: int) -> None:
        """The stage of the group at ``position`` as planned, checked against the ledger's count, recorded."""
        assert self.schedule is not None and self.sampler is not None
        planned, stage = self._stage_table(epoch := self.sampler.epoch)[position]
        if (counted := self._count()) != planned:
            raise RuntimeError(
                f"`batch_schedule=` on {self.schedule.axis} beside `token_batches=`: epoch {epoch}'s plan put the group"
                f" at position {position} after {planned} {self.schedule.axis} of the run, but the ledger counts"
                f" {counted}. The stages are planned from `lengths`: pass the tokens each row's step reports (one fewer"
                " per row under a causal shift), or state the schedule on samples."
            )
        self.scheduled.enter(stage, size)

    def _count(self) -> int:
        """The ledger's count on the schedule's axis (of updates: attempted ones, known before a group closes)."""
        assert self.schedule is not None and self._trainer is not None
        axis = "updates_attempted" if self.schedule.axis == "updates" else self.schedule.axis
        return int(getattr(self._trainer.strategy.ledger, axis))  # type: ignore[attr-defined]

    def _stage_samples(self, epoch: int, position: int) -> int:
        """``samples_per_update`` under ``batch_schedule=``: the stage's ``B`` of the group at ``position``."""
        return self._stage_table(epoch)[position][1].samples

    def _stage_table(self, epoch: int) -> dict[int, tuple[int, Stage]]:
        """Per group of ``epoch`` from where its iteration starts: its first position -> the run's count on the
        schedule's axis there and its stage, from the ledger's count at that start (docs/internals.md)."""
        assert self.schedule is not None and self.sampler is not None
        loaded = self._loaded if self._loaded.get("epoch") == epoch else {}
        first, open_samples = int(loaded.get("position", 0)), int(loaded.get("samples", 0))
        if self._stages[0] == (epoch, first):
            return self._stages[1]
        sampler, axis, count = self.sampler, self.schedule.axis, self._count()
        end = first + sampler.num_replicas * ((sampler.length - first) // sampler.num_replicas)  # the tail rule
        order = sampler.sampler.order(epoch)
        lengths = sampler.lengths[order] if axis == "tokens" else np.ones(len(order), dtype=np.int64)
        before, position = np.concatenate(([0], np.cumsum(lengths))), first  # the samples or tokens before each
        table: dict[int, tuple[int, Stage]] = {}
        while position < end:
            here = count + (len(table) if axis == "updates" else int(before[position] - before[first]))
            table[position] = (here, self.schedule.stage_at(here))
            position += open_samples if position == first and open_samples else table[position][1].samples
        self._stages = ((epoch, first), table)
        return table

    def refusal(self) -> str:
        """Why ``trainer.estimated_stepping_batches`` is refused, with the run's updates per epoch where known."""
        per_epoch = "ceil(P / B)" if self.sampler is None else str(len(self.sampler.group_sizes()))
        return (
            "under `token_batches=`: Lightning's count of micro-batches over `accumulate_grad_batches` is not the"
            f" number of updates. An epoch makes {per_epoch} (one per B = m·A·D examples of its P, the data rounded"
            " down to a multiple of D; fewer where `limit_train_batches` or `max_steps` ends it): size by that"
        )

    def _set_epoch(self, epoch: int) -> None:
        """The order's ``set_epoch``, then the epoch's micro-batches in Lightning's loop (docs/internals.md)."""
        sampler, trainer = self.sampler, self._trainer
        assert sampler is not None and trainer is not None
        GlobalOrderSampler.set_epoch(sampler.sampler, epoch)
        count, limit = len(sampler), trainer.limit_train_batches
        batches = min(count, limit) if isinstance(limit, int) else int(count * limit)  # Lightning's rule
        trainer.fit_loop.max_batches = batches
        combined = trainer.fit_loop._combined_loader  # its limit is the length the data fetcher counts an epoch by
        if combined is not None:
            combined.limits = [batches]
        if isinstance(trainer.val_check_interval, float) and trainer.val_check_batch is not None:
            trainer.val_check_batch = max(1, int(batches * trainer.val_check_interval))  # Lightning's rule
        self._sizes = []

    def _state(self) -> dict[str, Any]:
        assert self.sampler is not None and self._trainer is not None
        return self.sampler.state_dict(processed_microbatches(self._trainer) - self.sampler.resumed_microbatches)

    def _load(self, state: Mapping[str, Any]) -> None:
        assert self.sampler is not None
        self._loaded = dict(state) if isinstance(state, Mapping) else {}
        self.sampler.load_state_dict(state)
