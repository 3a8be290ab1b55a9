"""``token_batches=`` in a Trainer: the training loader cut by tokens, its groups and each epoch's count told to
Lightning's loop. Why a strategy option and the loop's names written: docs/internals.md, "Micro-batches cut by tokens".
"""

from __future__ import annotations

import bisect
import itertools
import os
from collections.abc import Mapping
from typing import Any

from lightning.pytorch import Trainer

from lightning_accum.sampler import GlobalOrderSampler
from lightning_accum.strategies.global_order import processed_microbatches
from lightning_accum.strategies.group_boundaries import GroupSizer
from lightning_accum.token_batches import TokenBatches, TokenBatchSampler

__all__ = ["TokenGroups"]


class TokenGroups:
    """A fit's training loader under ``token_batches=``: re-created around a :class:`~lightning_accum.TokenBatchSampler`
    (:meth:`install`), its groups' sizer (:meth:`start`), each epoch's count set in Lightning's loop, its state."""

    def __init__(self, options: TokenBatches | None, scheduled: bool = False, partial_group: str = "rescale") -> None:
        if options is not None and not isinstance(options, TokenBatches):
            raise TypeError(
                f"`token_batches` must be a `lightning_accum.TokenBatches` or None, got {type(options).__name__}."
                " Pass e.g. `token_batches=TokenBatches(max_tokens=4096, lengths='input_ids')`."
            )
        if options is not None and (scheduled or partial_group == "drop"):  # the strategy's other options
            raise ValueError(
                f"`token_batches=` cannot be combined with `{'batch_schedule=' if scheduled else 'partial_group'}`"
                " yet: pass `TokenBatches(samples_per_update=lambda epoch, position: ...)`, or 'rescale'."
            )
        self.options, self.accumulate = options, 1  # `accumulate`: the Trainer's as given, the fixed run's A
        self.sampler: TokenBatchSampler | None = None  # the training loader's, for the fit
        self._trainer: Trainer | None = None
        self._sizes: list[int] = []  # the running epoch's micro-batches per replica of each group, planned on need
        self._starts: list[int] = []  # their first batch in Lightning's count of the epoch

    def install(self, loader: Any, trainer: Trainer, layout: Mapping[str, int] | None) -> Any:
        """The training ``loader`` (as ``process_dataloader`` receives it) batched by tokens; raises as
        :meth:`TokenBatches.loader <lightning_accum.TokenBatches.loader>`."""
        assert self.options is not None
        replicas, rank = (layout["num_replicas"], layout["rank"]) if layout else (1, 0)
        ours = self.options.loader(loader, replicas, rank, int(os.getenv("PL_GLOBAL_SEED", "0")), self.accumulate)
        assert ours is not None and isinstance(ours.batch_sampler, TokenBatchSampler)  # or refused
        self.sampler, self._trainer, self._sizes = ours.batch_sampler, trainer, []
        self.sampler.sampler.set_epoch = self._set_epoch  # type: ignore[method-assign]  # Lightning calls it first
        # Plain attributes of the loader made for this fit, as `global_order=True`'s: Lightning saves and restores it.
        ours.state_dict = self._state  # type: ignore[attr-defined]
        ours.load_state_dict = self.sampler.load_state_dict  # type: ignore[attr-defined]
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
        (a checkpoint's open group: the one holding it)."""
        sampler = self.sampler
        assert sampler is not None
        if not self._sizes:
            self._sizes = sampler.group_sizes()
            first = len(sampler) - sum(self._sizes)  # the open group a resumed epoch continues started that far back
            self._starts = list(itertools.accumulate(self._sizes[:-1], initial=first))
        k = bisect.bisect_right(self._starts, batch_idx) - 1
        if k < 0 or (resumed is None and self._starts[k] != batch_idx):
            raise RuntimeError(
                f"Lightning starts a group at batch {batch_idx} of epoch {sampler.epoch}, where the token plan has"
                " none: leave the training loader's batch sampler and `trainer.fit_loop.max_batches` to the strategy."
            )
        return self._sizes[k]

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
