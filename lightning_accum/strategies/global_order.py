"""``global_order=True`` in a Trainer: the training loader re-created around a ``GlobalOrderSampler``, resumable."""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader
from torch.utils.data import DataLoader

from lightning_accum.sampler import GlobalOrderSampler, global_order_for

__all__ = ["install_global_order", "processed_microbatches"]


def install_global_order(loader: Any, trainer: Trainer, layout: Mapping[str, int] | None) -> Any:
    """The training ``loader`` re-created around a :class:`GlobalOrderSampler` (resumable mid-epoch), or ``loader``
    itself where it keeps its own order.

    Args:
        loader: What Lightning hands the strategy's ``process_dataloader`` for the training stage.
        trainer: The Trainer (its loop's processed micro-batches are the position a checkpoint saves).
        layout: The strategy's ``distributed_sampler_kwargs``, ``None`` on one device.
    """
    if not isinstance(loader, DataLoader):
        return loader
    replicas, rank = (layout["num_replicas"], layout["rank"]) if layout else (1, 0)
    sampler = global_order_for(loader, replicas, rank, seed=int(os.getenv("PL_GLOBAL_SEED", "0")))
    if sampler is None:
        return loader
    ours = _update_dataloader(loader, sampler, mode=RunningStage.TRAINING)
    if hasattr(ours, "state_dict") or hasattr(ours, "load_state_dict"):
        return ours  # a loader that saves its own position (torchdata's StatefulDataLoader) keeps doing so
    batch_size = int(ours.batch_size or 1)
    # Plain attributes of the loader made for this fit (not the user's object): Lightning's test for a resumable loader.
    # Partials of module functions, not lambdas: the Trainer holds the loader, and a Trainer (or a model) pickles.
    ours.state_dict = functools.partial(_state, sampler, trainer, batch_size)
    ours.load_state_dict = functools.partial(_resume, sampler, trainer, batch_size)
    return ours


def processed_microbatches(trainer: Trainer) -> int:
    """The micro-batches of this epoch Lightning's loop has processed on each replica."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)  # type: ignore[attr-defined]


def _state(sampler: GlobalOrderSampler, trainer: Trainer, batch_size: int) -> dict[str, Any]:
    return sampler.state_dict(processed_microbatches(trainer) * batch_size * sampler.num_replicas)


def _resume(sampler: GlobalOrderSampler, trainer: Trainer, batch_size: int, state: Mapping[str, Any]) -> None:
    sampler.load_state_dict(state)
    epoch = int(trainer.fit_loop.epoch_progress.current.processed)  # type: ignore[attr-defined]
    position, processed = state["position"], processed_microbatches(trainer)
    expected = processed * batch_size * sampler.num_replicas
    if state["epoch"] == epoch and position and position != expected:
        raise ValueError(
            f"The checkpoint's training data stands at global position {position} of epoch {epoch}, but this run"
            f" resumes after {processed} micro-batches of {batch_size} examples on each of {sampler.num_replicas}"
            f" replicas, position {expected}: Lightning's grouping and its count of the epoch's batches would not match"
            " the data. Resume mid-epoch with the same examples per micro-batch slot over all replicas (m × D) as the"
            " run that wrote it (another D with m changed to keep m × D is exact), or from a checkpoint written at the"
            " end of an epoch."
        )
