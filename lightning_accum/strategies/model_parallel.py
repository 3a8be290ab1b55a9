"""Exact gradient accumulation for sharded and tensor-parallel models: ``"accum_fsdp"``, ``"accum_model_parallel"``.

Lightning's :class:`~lightning.pytorch.strategies.ModelParallelStrategy` lays the processes out on a 2-D device mesh
(``data_parallel`` × ``tensor_parallel``); the module applies FSDP2 (``fully_shard``) and tensor parallelism in
``configure_model``. What differs from DDP is the core's :class:`~lightning_accum.core.mesh.MeshAdapter`; what a
Trainer asks beyond it is :class:`MeshSide`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.distributed
from lightning.pytorch.strategies import ModelParallelStrategy
from typing_extensions import override

from lightning_accum.batch_schedule import BatchSchedule
from lightning_accum.core.mesh import (
    MeshAdapter,
    check_mesh_sizes,
    mesh_environment,
    refuse_unsharded,
    register_fsdp_string,
)
from lightning_accum.options import AccumulationOptions, Normalize, OnNonfinite, PartialGroup, ScheduleOn, TokenCounter
from lightning_accum.strategies.base import ExactAccumulation
from lightning_accum.strategies.trainer_side import TrainerSide
from lightning_accum.token_batches import TokenBatches

__all__ = ["GRADIENT_SYNC_MODES", "MeshSide", "ModelParallelAccumulationStrategy"]

#: The values of ``gradient_sync``.
GRADIENT_SYNC_MODES = ("every_microbatch", "last_microbatch")


class MeshSide(TrainerSide):
    """FSDP2's and tensor parallelism's Trainer-only side (see
    :class:`~lightning_accum.strategies.trainer_side.TrainerSide`): the slice count agreed over the mesh, the sharding
    checked at ``setup``, and a failed collective in the module's own code named at ``on_exception``."""

    def __init__(self, strategy: Any, adapter: MeshAdapter) -> None:
        super().__init__(strategy, adapter)
        self.adapter: MeshAdapter = adapter
        self._slice_group: Any = None  # a gloo group for the slice count when the backend is not gloo
        #: Inside a ``block_backward_sync`` that holds FSDP2's reduction (``gradient_sync="last_microbatch"``).
        self.blocked = False

    @override
    def sync_blocked(self) -> bool:
        return self.blocked

    @override
    def agree_slice_count(self, count: int, num_samples: int) -> int:
        # FSDP2 all-gathers in every forward and tensor parallelism communicates inside every layer: every rank must
        # run the same number of slices. One small all-reduce per loader batch, on the CPU (a gloo group when the
        # backend is not gloo: no device synchronisation), and only with `microbatch_size=` set.
        if self.strategy.world_size == 1 or not (
            torch.distributed.is_available() and torch.distributed.is_initialized()
        ):
            return count
        if self._slice_group is None and torch.distributed.get_backend() != "gloo":
            self._slice_group = torch.distributed.new_group(backend="gloo", timeout=self.strategy._timeout)
        values = torch.tensor([count, -num_samples], dtype=torch.int64)
        torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX, group=self._slice_group)
        agreed, fewest = int(values[0]), -int(values[1])
        if fewest < agreed:
            raise RuntimeError(
                f"`microbatch_size={self.strategy.slicing.configured}`: a rank's loader batch holds {fewest} sample(s),"
                f" fewer than the {agreed} slices another rank's batch needs, and every rank must run the same number"
                " of slices (FSDP2 and tensor parallelism communicate inside each forward). Give every rank batches of"
                " the same size (DistributedSampler with `drop_last=True`), or raise `microbatch_size`."
            )
        return agreed

    # ------------------------------------------------------------------ the run

    @override
    def setup(self, trainer: Any) -> None:
        strategy = self.strategy
        refuse_unsharded(
            strategy.model,
            strategy,
            f"`{type(strategy.lightning_module).__name__}.configure_model()`",
            "In `configure_model`, apply `fully_shard(module, mesh=self.device_mesh['data_parallel'])` (FSDP2) and/or"
            " `parallelize_module(module, self.device_mesh['tensor_parallel'], plan)`",
        )

    @override
    def on_exception(self, exception: BaseException) -> None:
        # The Trainer's door: a rank whose failed collective ran in the module's own code (the forward of a micro-batch
        # more: FSDP2's all-gather) is told too, once (the close and the backward raise the message themselves).
        message = self.adapter.unpaired_collectives(exception)
        if message is not None and message != str(exception):
            warnings.warn(message, UserWarning, stacklevel=1)


class ModelParallelAccumulationStrategy(ExactAccumulation, ModelParallelStrategy):
    """Exact gradient accumulation with FSDP2 and tensor parallelism (``"accum_fsdp"``, ``"accum_model_parallel"``).

    The module shards itself in ``configure_model`` (``fully_shard`` over ``self.device_mesh["data_parallel"]``,
    ``parallelize_module`` over ``self.device_mesh["tensor_parallel"]``), as with Lightning's strategy. The group's
    counts are reduced over the data-parallel process group (one small all-reduce per update), ``D`` is the
    data-parallel size, and the gradient's local shards are rescaled by ``c · D / W`` before unscale, clipping
    and the optimizer.

    Args:
        count_tokens: ``batch -> int | Tensor``: the micro-batch's supervised tokens where ``training_step`` reports
            none (on the command line an import path, e.g. ``lightning_accum.causal_lm_tokens``).
        normalize, partial_group, schedule_on, on_nonfinite, max_consecutive_skips, global_order: The options of exact
            accumulation, documented once in :class:`~lightning_accum.options.AccumulationOptions`.
            The NaN/Inf check of each rank's shard is summed over the whole mesh, so every rank takes the same decision.
        gradient_sync: ``"every_microbatch"`` (default, FSDP2's own behaviour): every micro-batch's backward
            reduce-scatters its gradient, and each rank holds only its sharded gradient between micro-batches (least
            memory, ``A`` reduce-scatters per update). ``"last_microbatch"``: the non-final micro-batches run with
            ``set_requires_gradient_sync(False)`` on every FSDP module, so the unsharded gradient is accumulated
            locally and reduce-scattered once, at the group's last backward (one reduce-scatter per update, the
            unsharded gradient held meanwhile). Both are exact; tensor-parallel collectives run in both.
        data_parallel_size: ``D``, the size of the mesh's ``data_parallel`` dimension, or ``"auto"``.
        tensor_parallel_size: The devices sharing one model replica, or ``"auto"``. With both ``"auto"``, Lightning's
            sizes (``D`` = number of nodes, tensor parallel over a node's devices); with one of them an int, the
            other is the world size divided by it (``tensor_parallel_size=1``: FSDP2 over every device, what
            ``"accum_fsdp"`` selects).
        microbatch_size, split_batch, batch_schedule, token_batches: As in :class:`AccumulationStrategy`; every rank
            runs the same number of slices (one small CPU all-reduce per loader batch agrees on it), and ``"auto"`` is
            an error.
        **kwargs: Passed to :class:`~lightning.pytorch.strategies.ModelParallelStrategy`
            (``save_distributed_checkpoint``, ``process_group_backend``, ``timeout``).

    A checkpoint written inside a group carries it under ``"every_microbatch"`` only (docs/howto.md, "Checkpoints
    under FSDP2").

    Example:
        >>> import lightning as L
        >>> import lightning_accum
        >>> trainer = L.Trainer(strategy="accum_fsdp", devices=2, accelerator="cpu", logger=False,
        ...                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        >>> type(trainer.strategy).__name__, trainer.strategy.gradient_sync
        ('ModelParallelAccumulationStrategy', 'every_microbatch')
    """

    strategy_name = "accum_model_parallel"
    adapter_type = MeshAdapter
    side_type = MeshSide
    _side: MeshSide

    def __init__(
        self,
        *,
        normalize: Normalize = "auto",
        count_tokens: TokenCounter | None = None,
        partial_group: PartialGroup = "rescale",
        schedule_on: ScheduleOn = "applied",
        on_nonfinite: OnNonfinite = "skip",
        max_consecutive_skips: int | None = 100,
        global_order: bool = False,
        gradient_sync: Literal["every_microbatch", "last_microbatch"] = "every_microbatch",
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = "auto",
        microbatch_size: int | Literal["auto"] | None = None,
        split_batch: Callable[[Any, int, int], Any] | None = None,
        batch_schedule: BatchSchedule | dict[int, int] | str | None = None,
        token_batches: TokenBatches | None = None,
        **kwargs: Any,
    ) -> None:
        if gradient_sync not in GRADIENT_SYNC_MODES:
            raise ValueError(
                f"`gradient_sync` must be one of {', '.join(map(repr, GRADIENT_SYNC_MODES))}, got {gradient_sync!r}."
                " Use 'every_microbatch' (least memory) or 'last_microbatch' (fewest collectives)."
            )
        check_mesh_sizes(data_parallel_size, tensor_parallel_size)
        options = AccumulationOptions.pick(locals())  # the options declared above, one by one for LightningCLI
        self._init_accumulation(options, microbatch_size, split_batch, batch_schedule, token_batches)
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size, **kwargs)
        self.gradient_sync = gradient_sync
        if microbatch_size == "auto":
            raise ValueError(
                "`microbatch_size='auto'` is not available with sharded or tensor-parallel training: FSDP2 and tensor"
                " parallelism run collectives inside every forward and backward, so a slice run again on the rank that"
                " ran out of memory would pair its collectives with different ones on the other ranks. Pass a fixed"
                " `microbatch_size=` (an int; every rank must cut its batch into the same number of slices), or None."
            )

    @override
    def setup_environment(self) -> None:
        with mesh_environment(self, "the Trainer's `devices=` / `num_nodes=`"):
            super().setup_environment()

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning enters this on a group's non-final micro-batches: with ``gradient_sync="last_microbatch"``,
        FSDP2 accumulates the unsharded gradient locally there instead of reduce-scattering it."""
        if self.gradient_sync != "last_microbatch" or self.model is None:
            with super().block_backward_sync():
                yield
            return
        from torch.distributed.fsdp import FSDPModule

        modules = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        for m in modules:
            m.set_requires_gradient_sync(False, recurse=False)
        self._side.blocked = True  # a manual loop's close after a last backward here is refused
        try:
            yield
        finally:
            self._side.blocked = False
            for m in modules:
                m.set_requires_gradient_sync(True, recurse=False)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_fsdp_string(strategy_registry, cls, "", "data parallel = world size")
        strategy_registry.register(
            "accum_model_parallel",
            cls,
            description="Exact gradient accumulation with FSDP2 + tensor parallelism (Lightning's automatic sizes)",
            override=True,
        )
