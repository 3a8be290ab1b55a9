"""The Trainer strategy's checkpoints: the core's entry with every rank's ``microbatch_size=`` record and the stages
``batch_schedule=`` reached.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.tensor import DTensor

from lightning_accum.core.adapter import Write
from lightning_accum.core.entry import CHECKPOINT_KEY
from lightning_accum.core.reading import WAY_OUT, read_checkpoint
from lightning_accum.strategies.scheduled_groups import ScheduledGroups
from lightning_accum.strategies.slicing import BatchSlicer
from lightning_accum.strategies.trainer_side import TrainerSide

__all__ = ["TrainerCheckpoint", "own_slicing", "save_without_peers", "slicing_state"]


def slicing_state(mine: dict[str, Any], world: int, gather: bool) -> dict[str, Any]:
    """Every rank's slicing record (``per_rank``; a collective unless ``gather`` is false)."""
    rows: list[Any] = [mine]
    if gather and world > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        rows = [None] * world
        torch.distributed.all_gather_object(rows, mine)
    return {**mine, "per_rank": rows}


def own_slicing(state: Mapping[str, Any], rank: int) -> Mapping[str, Any]:
    rows = state.get("per_rank")
    if isinstance(rows, list) and rank < len(rows) and isinstance(rows[rank], Mapping):
        return rows[rank]  # type: ignore[no-any-return]
    return state


def save_without_peers(
    checkpoint_io: Any, checkpoint: dict[str, Any], filepath: Any, rank: int, storage_options: Any | None
) -> None:
    """Every surviving rank writes the checkpoint: a private file, then an atomic rename."""
    path = str(filepath)
    if "://" in path:  # a remote file system: no atomic rename to rely on
        checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        return
    partial = f"{path}.rank{rank}.partial"
    checkpoint_io.save_checkpoint(checkpoint, partial, storage_options=storage_options)
    os.replace(partial, path)


def folder_refusal(folder: Path, strategy: Any) -> str | None:
    """Why ``strategy`` cannot read the folder at all (``None``: it can try)."""
    named = f"`ckpt_path={str(folder)!r}`"
    # A distributed checkpoint written by Lightning: torch's index of the shards, and Lightning's metadata file.
    if not ((folder / ".metadata").is_file() and (folder / _METADATA_FILENAME).is_file()):
        return (
            f"{named} is a folder that is not a checkpoint (no `.metadata` and `{_METADATA_FILENAME}` in it). Give"
            " `ckpt_path` the checkpoint file (a `.ckpt` written by `Trainer.save_checkpoint` or `ModelCheckpoint`),"
            " or the folder of a sharded checkpoint."
        )
    if not isinstance(strategy, ModelParallelStrategy):
        return (
            f"{named} is a sharded (distributed) checkpoint folder; {type(strategy).__name__} reads single files"
            f" only. {WAY_OUT}"
        )
    module = strategy.model if strategy.model is not None else strategy.lightning_module
    if module is None or any(isinstance(p, DTensor) for p in module.parameters()):
        return None
    return (
        f"{named} is a sharded (distributed) checkpoint folder, and this run's model has no sharded (DTensor)"
        f" parameter on its {strategy.world_size} device(s) (Lightning: 'Could not find a distributed model')."
        f" {WAY_OUT}"
    )


def _sharded_state(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Lightning's checkpoint split as its distributed save splits it: the sharded state (taken out), the metadata."""
    optimizers = {f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))}
    return {"state_dict": checkpoint.pop("state_dict"), **optimizers}, checkpoint


class TrainerCheckpoint:
    """The Trainer strategy's ``save_checkpoint`` / ``load_checkpoint``: the entry written (by the survivors alone
    when a peer is lost) and read back by a ``fit`` only.
    """

    def __init__(
        self,
        strategy: Any,
        core: Any,
        side: TrainerSide,
        slicer: BatchSlicer,
        trainer: Callable[[], Trainer | None],
        scheduled: ScheduledGroups,
    ) -> None:
        self.strategy, self.core, self.side, self.slicer = strategy, core, side, slicer
        self.scheduled, self.trainer = scheduled, trainer

    def save(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None, write: Write) -> None:
        """Add the package's entry to ``checkpoint`` and write it (``write``: Lightning's ``save_checkpoint``)."""
        adapter, side = self.core.adapter, self.side
        if not side.may_write_checkpoint(filepath):
            return
        failed = side.collectives_failed(self.trainer()) if self.core.adapter.data_parallel_size > 1 else None
        try:
            state = self._entry(failed)
        except Exception as error:
            # A collective of the entry failed: a peer died since training last reached one (a SIGTERM checkpoint
            # after another rank was killed, say). The survivors write what they hold, without the peers.
            failed = side.peers_lost_in(error) if failed is None else None
            if failed is None:
                raise
            state = self._entry(failed)
        checkpoint[CHECKPOINT_KEY] = state
        if failed is not None:
            save_without_peers(self.strategy.checkpoint_io, checkpoint, filepath, adapter.rank, storage_options)
            return
        adapter.write_checkpoint(checkpoint, filepath, storage_options, write, _sharded_state, self.core.parameters)

    def _entry(self, failed: str | None) -> dict[str, Any]:
        trainer = self.trainer()
        # The micro-batch whose step is running, which Lightning runs again on resume (None between micro-batches).
        running = None
        if trainer is not None:
            progress = trainer.fit_loop.epoch_loop.batch_progress.current
            running = progress.ready if progress.ready > getattr(progress, "processed", progress.ready) else None
        state: dict[str, Any] = self.core.entry(self.configuration(), self.core.parameters(), running, failed)
        if self.slicer.enabled:
            world = int(getattr(self.strategy, "world_size", 1))
            state["slicing"] = slicing_state(self.slicer.log.state_dict(), world, gather=failed is None)
        if self.scheduled.schedule is not None:  # the same on every replica: every closed group is counted
            state["batch_stages"] = [dict(stage) for stage in self.scheduled.stages]
        return state

    def load(self, checkpoint_path: Any, weights_only: bool | None, load: Callable[..., Any]) -> dict[str, Any]:
        """Read the checkpoint with ``load`` (Lightning's ``load_checkpoint``) and, in a fit, take its entry."""
        checkpoint = read_checkpoint(
            lambda: load(checkpoint_path, weights_only),
            checkpoint_path,
            lambda folder: folder_refusal(folder, self.strategy),
        )
        trainer = self.trainer()  # None: no Trainer runs the strategy (a direct call), read as a fit
        if trainer is not None and trainer.state.fn != TrainerFn.FITTING:
            # `validate` / `test` / `predict(ckpt_path=...)`: Lightning restores the weights only, and so does the
            # package (the ledger and an open group belong to a fit resuming from the checkpoint, never to a later one).
            return checkpoint
        reader = self.core.adapter.distributed_reader(checkpoint_path, self.core.parameters)
        state = self.core.checkpoint.load(self.core.engine, checkpoint, str(checkpoint_path), reader)
        if state is not None and self.slicer.enabled and state.get("slicing") is not None:
            # Lightning restores checkpoints before `setup`: the rank comes from the strategy's cluster environment.
            self.slicer.log.load_state_dict(own_slicing(state["slicing"], self.core.adapter.rank))
        self.scheduled.load_state(None if state is None else state.get("batch_stages"))
        return checkpoint

    def configuration(self) -> dict[str, Any]:
        """What the checkpoint's groups depend on."""
        trainer = self.trainer()
        # Under `token_batches=` a group's micro-batches vary by design: no `A` to compare on resume.
        tokens = self.strategy.token_batches is not None
        accumulate = None if trainer is None or tokens else trainer.accumulate_grad_batches
        return self.core.configuration(type(self.strategy).__name__, accumulate)  # type: ignore[no-any-return]
