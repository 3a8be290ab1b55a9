"""What only a Trainer asks of an engine beside the core's adapter: :class:`TrainerSide`, one device's answers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_accum.core.adapter import EngineAdapter

__all__ = ["TrainerSide", "ends_group_by_position"]


def ends_group_by_position(trainer: Any) -> bool:
    """Whether the running micro-batch ends its group in Lightning's grouping (the fit loop's answer) or its epoch."""
    epoch_loop = trainer.fit_loop.epoch_loop
    return bool(epoch_loop._accumulated_batches_reached() or epoch_loop.batch_progress.is_last_batch)


class TrainerSide:
    """The Trainer-only side of an engine, beside its core ``adapter``; each default is what one device does."""

    def __init__(self, strategy: Any, adapter: EngineAdapter) -> None:
        self.strategy, self.adapter = strategy, adapter

    # ------------------------------------------------------------------ the micro-batch

    def synchronises(self, trainer: Any) -> bool:
        """Whether the running backward synchronises gradients over the replicas (a group's last micro-batch, D > 1)."""
        return self.adapter.data_parallel_size > 1 and ends_group_by_position(trainer)

    def sync_blocked(self) -> bool:
        """Whether a backward run now leaves its gradient uncombined over the replicas (a manual loop's close after a
        last backward like that is refused where it matters): never on one device."""
        return False

    def microbatch_agreement(self) -> Callable[[Any], None] | None:
        """What runs before each training micro-batch, called with the trainer, or ``None``."""
        return None

    def agree_slice_count(self, count: int, num_samples: int) -> int:
        """The number of slices every rank cuts a loader batch into; ``count`` (this rank's) where none need agree."""
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
        """Whether this process writes a checkpoint Lightning asks for."""
        return True

    # ------------------------------------------------------------------ the run

    def setup(self, trainer: Any) -> None:
        """The strategy's ``setup``, before Lightning's: after ``configure_model``, before the model is wrapped."""

    def on_train_start(self, trainer: Any) -> None:
        """The strategy's ``on_train_start``."""

    def on_exception(self, exception: BaseException) -> None:
        """The strategy's ``on_exception``: Lightning is handling ``exception``."""

    def teardown(self) -> None:
        """The strategy's ``teardown``, before Lightning's."""
