"""What only a Trainer asks of an engine, beside the core's adapter (:mod:`lightning_accum.core.adapter`, which
says why the two are apart): :class:`TrainerSide` (one device; every default),
:class:`~lightning_accum.strategies.ddp.DDPTrainerSide` or :class:`~lightning_accum.strategies.model_parallel.MeshSide`,
named in the strategy's ``side_type``. A Fabric loop has no such part (the loop is the user's): what a Fabric user
meets instead is listed in ``docs/concepts.md``'s deliberate differences.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_accum.core.adapter import EngineAdapter

__all__ = ["TrainerSide", "ends_group_by_position"]


def ends_group_by_position(trainer: Any) -> bool:
    """Whether the running micro-batch is its group's last in Lightning's grouping: the fit loop's own answer (the
    strategy's group boundaries where groups vary), or it is the epoch's last batch."""
    epoch_loop = trainer.fit_loop.epoch_loop
    return bool(epoch_loop._accumulated_batches_reached() or epoch_loop.batch_progress.is_last_batch)


class TrainerSide:
    """The Trainer-only side of an engine, serving ``strategy`` beside its core ``adapter``; each default is what one
    device does."""

    def __init__(self, strategy: Any, adapter: EngineAdapter) -> None:
        self.strategy, self.adapter = strategy, adapter

    # ------------------------------------------------------------------ the micro-batch

    def synchronises(self, trainer: Any) -> bool:
        """Whether the running backward synchronises gradients over the replicas (a group's last micro-batch, D > 1)."""
        return self.adapter.data_parallel_size > 1 and ends_group_by_position(trainer)

    def microbatch_agreement(self) -> Callable[[Any], None] | None:
        """What runs before each training micro-batch of the run (not the check's), called with the trainer: an
        agreement between replicas; ``None`` where there is nothing to agree on, so that no call is made. Read at
        ``on_train_start``, after :meth:`on_train_start`."""
        return None

    def agree_slice_count(self, count: int, num_samples: int) -> int:
        """The number of slices every rank cuts a loader batch of ``num_samples`` into (``microbatch_size=``);
        ``count`` (this rank's own) where ranks need not agree."""
        return count

    def before_forward_retry(self) -> None:
        """Called before the forward path runs again on the same loader batch after an out-of-memory error."""

    # ------------------------------------------------------------------ faults

    @property
    def peers_lost(self) -> str | None:
        """Why the replicas cannot be reached, once a collective failed (``None``: they can, or there is one)."""
        return None

    def collectives_failed(self, trainer: Any) -> str | None:
        """Why the replicas cannot be reached for a collective now, found without trying one."""
        return None

    def peers_lost_in(self, error: BaseException | None) -> str | None:
        """Why the replicas cannot be reached, when ``error`` is a failed collective (``None``: it is not one)."""
        return None

    def may_write_checkpoint(self, filepath: str | Path) -> bool:
        """Whether this process writes a checkpoint Lightning asks for (the main process of a launch whose workers
        failed holds no trained state)."""
        return True

    # ------------------------------------------------------------------ the run

    def setup(self, trainer: Any) -> None:
        """The strategy's ``setup``, before Lightning's: ``configure_model`` ran (a sharded model is sharded), the model
        is not yet wrapped (DDP), moved to its device or given its optimizers."""

    def on_train_start(self, trainer: Any) -> None:
        """The strategy's ``on_train_start``."""

    def on_exception(self, exception: BaseException) -> None:
        """The strategy's ``on_exception``: Lightning is handling ``exception``."""

    def teardown(self) -> None:
        """The strategy's ``teardown``, before Lightning's."""
