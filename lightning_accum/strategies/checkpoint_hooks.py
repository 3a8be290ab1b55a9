"""The checkpoint side of an accumulation strategy: Lightning's ``save_checkpoint`` and ``load_checkpoint`` with the
package's entry (the ledger, an open group and its gradient, the slicing record), and the protected hooks each engine
adapter overrides to say what a checkpoint written inside a group carries and who adds it back.

:class:`CheckpointHooks` is a base of :class:`~lightning_accum.strategies.base.ExactAccumulation` (never used alone):
the strategy's base sets up the parts it reads (``_engine``, ``_checkpoint``, ``_slicer``, ``_trainer_ref``) and
provides ``data_parallel_replicas`` and ``reduce_sum``. The lifecycle of an open group in a checkpoint (write, check,
load, reopen, install) is :class:`~lightning_accum.strategies.checkpoint.OpenGroupCheckpoint`; this class is the
strategy's side of it, kept out of the strategy's base so that the hooks of every micro-batch and the hooks of a
checkpoint each read in one file. Engine adapters override ``_carry_gradients`` (the replicas' sum),
``_write_checkpoint`` and ``_distributed_reader`` (a sharded folder under the model-parallel strategy),
``_holds_group_sums`` and ``_carried_part`` (which rank adds the carried counters and what of the carried sum each
rank adds), and ``_collectives_failed`` / ``_peers_lost_in`` (DDP's lost peers).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch import Trainer
from lightning.pytorch.strategies import Strategy
from torch import Tensor
from typing_extensions import override

from lightning_accum.engine import AccumulationEngine
from lightning_accum.gradients import summed_gradients
from lightning_accum.strategies.checkpoint import (
    CHECKPOINT_KEY,
    OpenGroupCheckpoint,
    own_slicing,
    save_without_peers,
    slicing_state,
)
from lightning_accum.strategies.slicing import BatchSlicer

__all__ = ["CheckpointHooks"]

_Path = str | Path  # what Lightning's checkpoint methods accept


class CheckpointHooks(Strategy):
    """What an accumulation strategy writes into a checkpoint and reads back, and the hooks its adapters override."""

    # Set up by `ExactAccumulation._init_accumulation`.
    _engine: AccumulationEngine
    _checkpoint: OpenGroupCheckpoint
    _slicer: BatchSlicer
    _trainer_ref: Trainer | None

    if TYPE_CHECKING:  # provided by ExactAccumulation and its engine adapters

        @property
        def data_parallel_replicas(self) -> int: ...

        def reduce_sum(self, tensor: Tensor) -> Tensor: ...

    def _group_parameters(self) -> list[tuple[str, Tensor]]:
        """The optimized parameters by name, in a fixed order (the same on every replica)."""
        module = self.lightning_module
        assert module is not None
        optimized = {
            id(p) for optimizer in self.optimizers for group in optimizer.param_groups for p in group["params"]
        }
        return [(name, p) for name, p in module.named_parameters() if id(p) in optimized]

    def _carry_gradients(self) -> dict[str, Tensor] | None:
        """The open group's gradient summed over replicas, by parameter name, for a checkpoint written inside a
        group (a collective: every replica calls it); ``None`` where the strategy cannot carry it (it says why)."""
        reduce = self.reduce_sum if self.data_parallel_replicas > 1 else None
        return summed_gradients(self._group_parameters(), reduce)

    def _reopen(self, batch_idx: int) -> None:
        """At the first micro-batch of a resumed run: reopen the group the checkpoint carries."""
        self._checkpoint.reopen(
            self._engine, self._configuration(), batch_idx, self._holds_group_sums(), self._group_parameters()
        )

    def _holds_group_sums(self) -> bool:
        """Whether this rank adds a carried group's counters (one rank per data-parallel group: the close's all-reduce
        adds them to the others')."""
        return bool(self.is_global_zero)

    def _carried_part(self, parameter: Tensor, carried: Tensor) -> Tensor | None:
        """What this rank adds to ``parameter``'s gradient of a carried group's gradient (the replicas' sum): all of it
        on the rank holding the group's sums, nothing elsewhere; DDP's average at the group's last backward and the
        close's ``c · D / W`` then treat it as any replica's part."""
        if not self._holds_group_sums():
            return None
        return carried.to(device=parameter.device, dtype=parameter.dtype, copy=True)

    def _distributed_reader(self, path: _Path) -> Callable[[list[str]], dict[str, Tensor]] | None:
        """Reads a carried gradient from a distributed checkpoint's shards at ``path`` (``None``: this strategy reads
        single files only)."""
        return None

    def _write_checkpoint(self, checkpoint: dict[str, Any], filepath: _Path, storage_options: Any | None) -> None:
        """Write ``checkpoint`` (with the package's entry) as the Lightning strategy underneath writes it."""
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def _collectives_failed(self) -> str | None:
        """Why the replicas cannot be reached for a collective now (``None``: they can, or there is one replica)."""
        return None

    def _attached_trainer(self) -> Trainer | None:
        """The Trainer running this strategy, or ``None`` (a module connected to the strategy without a Trainer, as
        Lightning's own strategies allow for ``save_checkpoint``)."""
        if self._trainer_ref is not None:
            return self._trainer_ref
        module = self.lightning_module
        try:
            return module.trainer if module is not None else None
        except RuntimeError:  # "... is not attached to a `Trainer`"
            return None

    def _configuration(self) -> dict[str, Any]:
        """What the checkpoint's groups depend on: ``A`` (where a Trainer says it), ``D``, the ``normalize=`` and
        ``partial_group=`` options."""
        trainer = self._attached_trainer()
        config: dict[str, Any] = {} if trainer is None else {"accumulate": int(trainer.accumulate_grad_batches)}
        config.update(
            strategy=type(self).__name__,
            replicas=int(self.data_parallel_replicas),
            normalize=self._engine.normalize,
            partial_group=self._engine.partial_group,
        )
        return config

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _Path, storage_options: Any | None = None) -> None:
        failed = self._collectives_failed() if self.data_parallel_replicas > 1 else None
        try:
            state = self._package_entry(failed)
        except Exception as error:
            # A collective of the entry failed: a peer died since training last reached one (a SIGTERM checkpoint
            # after another rank was killed, say). The survivors write what they hold, without the peers.
            failed = self._peers_lost_in(error) if failed is None else None
            if failed is None:
                raise
            state = self._package_entry(failed)
        checkpoint[CHECKPOINT_KEY] = state
        if failed is not None:
            rank = int(getattr(self, "global_rank", 0))
            save_without_peers(self.checkpoint_io, checkpoint, filepath, rank, storage_options)
            return
        self._write_checkpoint(checkpoint, filepath, storage_options)

    def _package_entry(self, failed: str | None) -> dict[str, Any]:
        """The package's checkpoint entry (collectives with several replicas unless ``failed`` says why not)."""
        trainer = self._attached_trainer()
        # The micro-batch whose step is running, which Lightning runs again on resume (None between micro-batches).
        running = None
        if trainer is not None:
            progress = trainer.fit_loop.epoch_loop.batch_progress.current
            running = progress.ready if progress.ready > getattr(progress, "processed", progress.ready) else None
        state = self._checkpoint.entry(
            self._engine,
            self._configuration(),
            running=running,
            failed=failed,
            carry=self._carry_gradients,
            parameter_names=[name for name, _ in self._group_parameters()],
        )
        if self._slicer.enabled:
            world = int(getattr(self, "world_size", 1))
            state["slicing"] = slicing_state(self._slicer.log.state_dict(), world, gather=failed is None)
        return state

    def _peers_lost_in(self, error: BaseException | None) -> str | None:
        """Why the replicas cannot be reached, when ``error`` is a failed collective (``None``: it is not one)."""
        return None

    @override
    def load_checkpoint(self, checkpoint_path: _Path, weights_only: bool | None = None) -> dict[str, Any]:
        # Lightning 2.5.0 has no `weights_only` (and never passes it): call its method as it is declared there.
        checkpoint: dict[str, Any] = (
            super().load_checkpoint(checkpoint_path)
            if weights_only is None
            else super().load_checkpoint(checkpoint_path, weights_only)
        )
        state = self._checkpoint.load(
            self._engine, checkpoint, str(checkpoint_path), self._distributed_reader(checkpoint_path)
        )
        if state is not None and self._slicer.enabled and state.get("slicing") is not None:
            # Lightning restores checkpoints before `setup`: the rank comes from the strategy's cluster environment.
            rank = int(getattr(self, "global_rank", 0))
            self._slicer.log.load_state_dict(own_slicing(state["slicing"], rank))
        return checkpoint
