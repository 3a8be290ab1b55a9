"""Exact gradient accumulation for sharded and tensor-parallel models: ``"accum_fsdp"``, ``"accum_model_parallel"``.

Lightning's :class:`~lightning.pytorch.strategies.ModelParallelStrategy` lays the processes out on a 2-D device mesh
(``data_parallel`` × ``tensor_parallel``); the module applies FSDP2 (``fully_shard``) and tensor parallelism in
``configure_model``. Three things differ from DDP:

* ``D`` is the size of the ``data_parallel`` mesh dimension, not the world size: the ranks of one tensor-parallel
  group hold one replica of the model and read the same batch, so the group's counts are summed over the
  data-parallel process group only (counted once per replica);
* the gradients are DTensors, sharded (FSDP2 reduce-scatters an *average* over the data-parallel dimension,
  tensor parallelism splits the rest): the rescale ``c · D / W`` acts on each rank's local shard, which is exact
  because it is one scalar for every element;
* each rank checks only its own shard for NaN/Inf, so the result is summed over the whole mesh before the one host
  read (a second one-element all-reduce, only when the strategy checks: no GradScaler and ``on_nonfinite`` other
  than ``"ignore"``). FSDP's reduce-scatter does not make that unnecessary: a NaN in one rank's local gradient
  reaches only the rank that owns those elements after the reduce-scatter.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.distributed
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor
from typing_extensions import override

from lightning_accum.engine import Replicas
from lightning_accum.group import group_position
from lightning_accum.microbatch import Count
from lightning_accum.options import AccumulationOptions
from lightning_accum.strategies.base import ExactAccumulation
from lightning_accum.strategies.closing import GroupClosing

__all__ = ["GRADIENT_SYNC_MODES", "ModelParallelAccumulationStrategy"]

#: The values of ``gradient_sync``.
GRADIENT_SYNC_MODES = ("every_microbatch", "last_microbatch")


def _local(tensor: Tensor) -> Tensor:
    """The rank's own part of a (DTensor) gradient, sharing its storage; a plain tensor as it is."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


class ModelParallelAccumulationStrategy(ExactAccumulation, ModelParallelStrategy):
    """Exact gradient accumulation with FSDP2 and tensor parallelism (``"accum_fsdp"``, ``"accum_model_parallel"``).

    The module shards itself in ``configure_model`` (``fully_shard`` over ``self.device_mesh["data_parallel"]``,
    ``parallelize_module`` over ``self.device_mesh["tensor_parallel"]``), as with Lightning's strategy. The group's
    counts are reduced over the data-parallel process group (one small all-reduce per update), ``D`` is the
    data-parallel size, and the gradient's local shards are rescaled by ``c · D / W`` before unscale, clipping
    and the optimizer.

    Args:
        normalize, count_tokens, partial_group, schedule_on, on_nonfinite, max_consecutive_skips: The options of
            exact accumulation, documented once in :class:`~lightning_accum.options.AccumulationOptions`. The NaN/Inf
            check of each rank's shard is summed over the whole mesh, so every rank takes the same decision.
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
        microbatch_size: ``None`` (default): the loader's batch is one micro-batch, as in Lightning. An int: each
            loader batch (still Lightning's batch for ``accumulate_grad_batches``, ``global_step`` and the hooks) is
            run as consecutive slices of at most that many samples (the fewest, as even as possible), forward and
            backward each (gradients reduce-scattered by every slice's backward under
            ``gradient_sync="every_microbatch"``, only by the group's last slice under ``"last_microbatch"``): the
            same update, exactly, with lower peak activation memory. Every rank runs the same number of slices (one
            small CPU all-reduce per loader batch agrees on it); ``"auto"`` is an error here. ``"auto"``:
            the whole batch, and after an out-of-memory error in a slice's forward or backward, that slice again at
            half the size (kept for the rest of the run); see ``docs/howto.md``.
        split_batch: ``(batch, start, stop) -> batch``: samples ``start:stop`` of a batch type the strategy cannot
            cut itself (by default every tensor whose leading dimension is the batch's sample count is sliced).
        **kwargs: Passed to :class:`~lightning.pytorch.strategies.ModelParallelStrategy`
            (``save_distributed_checkpoint``, ``process_group_backend``, ``timeout``).

    Checkpoints (distributed or full) carry the ledger. One written *inside* an accumulation group also carries the
    group under ``gradient_sync="every_microbatch"``: its counters and its gradient (gathered whole, a collective per
    parameter), so the resumed run closes the group exactly. Under ``"last_microbatch"`` the group's gradient is held
    unreduced inside FSDP2 and is not carried: a warning says so when the checkpoint is written, and the run resumed
    from it says which micro-batches are missing from that group's update (normalized by what remains).

    Example:
        >>> import lightning as L
        >>> import lightning_accum
        >>> trainer = L.Trainer(strategy="accum_fsdp", devices=2, accelerator="cpu", logger=False,
        ...                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        >>> type(trainer.strategy).__name__, trainer.strategy.gradient_sync
        ('ModelParallelAccumulationStrategy', 'every_microbatch')
    """

    strategy_name = "accum_model_parallel"

    def __init__(
        self,
        normalize: str = "auto",
        count_tokens: Callable[[Any], Count] | None = None,
        partial_group: str = "rescale",
        schedule_on: str = "applied",
        on_nonfinite: str = "skip",
        max_consecutive_skips: int | None = 100,
        gradient_sync: Literal["every_microbatch", "last_microbatch"] = "every_microbatch",
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = "auto",
        microbatch_size: int | Literal["auto"] | None = None,
        split_batch: Callable[[Any, int, int], Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if gradient_sync not in GRADIENT_SYNC_MODES:
            raise ValueError(
                f"`gradient_sync` must be one of {', '.join(map(repr, GRADIENT_SYNC_MODES))}, got {gradient_sync!r}."
                " Use 'every_microbatch' (least memory) or 'last_microbatch' (fewest collectives)."
            )
        for name, size in (("data_parallel_size", data_parallel_size), ("tensor_parallel_size", tensor_parallel_size)):
            if size != "auto" and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
                raise ValueError(f"`{name}` must be 'auto' or an int ≥ 1, got {size!r}.")
        options = AccumulationOptions.pick(locals())  # the options declared above, one by one for LightningCLI
        # The gradient this rank rescales and checks is its DTensor's local shard (which shares its storage).
        self._init_accumulation(options, microbatch_size, split_batch, closing=GroupClosing(local=_local))
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size, **kwargs)
        self.gradient_sync = gradient_sync
        self._slice_group: Any = None  # a gloo group for the slice count when the backend is not gloo
        if microbatch_size == "auto":
            raise ValueError(
                "`microbatch_size='auto'` is not available with sharded or tensor-parallel training: FSDP2 and tensor"
                " parallelism run collectives inside every forward and backward, so a slice run again on the rank that"
                " ran out of memory would pair its collectives with different ones on the other ranks. Pass a fixed"
                " `microbatch_size=` (an int; every rank must cut its batch into the same number of slices), or None."
            )

    # ------------------------------------------------------------------ the mesh

    def _mesh_size(self, dimension: str, given: Literal["auto"] | int) -> int:
        try:
            return int(self.device_mesh[dimension].size())
        except RuntimeError:  # before the processes are set up: the size given, or 1 while "auto"
            return given if isinstance(given, int) else 1

    @property
    @override
    def data_parallel_replicas(self) -> int:
        return self._mesh_size("data_parallel", self._data_parallel_size)

    @property
    def tensor_parallel_size(self) -> int:
        """The devices that share one model replica (the mesh's ``tensor_parallel`` size; 1 before set-up while
        ``"auto"``)."""
        return self._mesh_size("tensor_parallel", self._tensor_parallel_size)

    @override
    def reduce_sum(self, tensor: Tensor) -> Tensor:
        if self.data_parallel_replicas > 1:
            group = self.device_mesh["data_parallel"].get_group()
            torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM, group=group)
        return tensor

    @override
    def agree_slice_count(self, count: int, num_samples: int) -> int:
        # FSDP2 all-gathers in every forward and tensor parallelism communicates inside every layer: every rank must
        # run the same number of slices. One small all-reduce per loader batch, on the CPU (a gloo group when the
        # backend is not gloo: no device synchronisation), and only with `microbatch_size=` set.
        if self.world_size == 1 or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return count
        if self._slice_group is None and torch.distributed.get_backend() != "gloo":
            self._slice_group = torch.distributed.new_group(backend="gloo")
        values = torch.tensor([count, -num_samples], dtype=torch.int64)
        torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX, group=self._slice_group)
        agreed, fewest = int(values[0]), -int(values[1])
        if fewest < agreed:
            raise RuntimeError(
                f"`microbatch_size={self.slicing.configured}`: a rank's loader batch holds {fewest} sample(s), fewer"
                f" than the {agreed} slices another rank's batch needs, and every rank must run the same number of"
                " slices (FSDP2 and tensor parallelism communicate inside each forward). Give every rank batches of"
                " the same size (DistributedSampler with `drop_last=True`), or raise `microbatch_size`."
            )
        return agreed

    def _sum_over_mesh(self, tensor: Tensor) -> Tensor:
        """Sum over every rank of the mesh (the NaN/Inf check of each rank's own gradient shard)."""
        if torch.distributed.is_available() and torch.distributed.is_initialized() and self.world_size > 1:
            torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
        return tensor

    @override
    def setup_environment(self) -> None:
        world = self.num_nodes * self.num_processes
        dp, tp = self._data_parallel_size, self._tensor_parallel_size
        for given, other, name in ((dp, tp, "tensor_parallel_size"), (tp, dp, "data_parallel_size")):
            if isinstance(given, int) and other == "auto":
                if world % given:
                    raise ValueError(
                        f"The world size ({world} = {self.num_nodes} node(s) × {self.num_processes} device(s)) is not"
                        f" a multiple of {'data_parallel_size' if given is dp else 'tensor_parallel_size'}={given}, so"
                        f" `{name}` cannot be derived. Choose sizes whose product is the number of devices."
                    )
        if isinstance(dp, int) and tp == "auto":
            self._tensor_parallel_size = world // dp
        elif isinstance(tp, int) and dp == "auto":
            self._data_parallel_size = world // tp
        dp, tp = self._data_parallel_size, self._tensor_parallel_size
        if isinstance(dp, int) and isinstance(tp, int) and dp * tp != world:
            raise ValueError(
                f"`data_parallel_size={dp}` × `tensor_parallel_size={tp}` = {dp * tp}, but the world size is {world}"
                f" ({self.num_nodes} node(s) × {self.num_processes} device(s)). Their product must equal the world"
                " size: change one of them, or the Trainer's `devices=` / `num_nodes=`."
            )
        super().setup_environment()

    # ------------------------------------------------------------------ set-up

    @override
    def setup(self, trainer: Trainer) -> None:
        self._check_sharded()
        super().setup(trainer)
        # Bind again with the mesh-wide sum for the NaN/Inf check of the local shards (base.setup binds D and the sum
        # over the data-parallel group).
        self._engine.bind(
            self.root_device, Replicas(self.data_parallel_replicas, self.reduce_sum, check_sum=self._sum_over_mesh)
        )
        self._closing.rank = self.global_rank  # each rank checks its own shard: name it beside a non-finite gradient

    def _check_sharded(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        model = self.model
        if model is None or self.world_size <= 1:
            return
        sharded = any(isinstance(m, FSDPModule) for m in model.modules()) or any(
            isinstance(p, DTensor) for p in model.parameters()
        )
        if not sharded:
            module = self.lightning_module
            raise RuntimeError(
                f"{type(self).__name__} runs on {self.world_size} devices, but after"
                f" `{type(module).__name__}.configure_model()` no parameter is sharded (no `fully_shard` module, no"
                " DTensor parameter): every device would train its own unsynchronized copy. In `configure_model`,"
                " apply `fully_shard(module, mesh=self.device_mesh['data_parallel'])` (FSDP2) and/or"
                " `parallelize_module(module, self.device_mesh['tensor_parallel'], plan)`; or use strategy='accum_ddp'"
                " for a model that fits one device."
            )

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
        try:
            yield
        finally:
            for m in modules:
                m.set_requires_gradient_sync(True, recurse=False)

    # ------------------------------------------------------------------ checkpoints

    @override
    def _carry_gradients(self) -> dict[str, Tensor] | None:
        if self.gradient_sync == "last_microbatch":
            # The group's gradient sits unreduced in FSDP2's own accumulators, not in `.grad`: nothing public to save.
            open_microbatches = self._engine.microbatches_in_group
            rank_zero_warn(
                f"lightning_accum: this checkpoint is written inside an accumulation group ({open_microbatches}"
                f" micro-batch(es) of {self._trainer().accumulate_grad_batches}); under gradient_sync='last_microbatch'"
                " the group's gradient is held unreduced inside FSDP2 and cannot be carried, so a run resumed from it"
                " updates that group without those micro-batches (normalized by what remains, and said again on"
                " resume). Use gradient_sync='every_microbatch', or write checkpoints at update boundaries"
                " (ModelCheckpoint's default), for an exact resume."
            )
            return None
        # Every micro-batch was reduce-scattered: each rank's shard holds its part of the data-parallel average so far.
        # Gathered whole (a collective per parameter, the same order on every rank), as a full checkpoint holds it.
        gradients: dict[str, Tensor] = {}
        for name, p in self._group_parameters():
            if p.grad is None:
                continue
            full = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            gradients[name] = full.detach().to("cpu", copy=True)
        return gradients

    @override
    def _reopen(self, batch_idx: int) -> None:
        group = self._checkpoint.resumed
        assert group is not None
        carried = int(group["microbatches"])
        position = group_position(batch_idx, self._trainer().accumulate_grad_batches)
        if not (carried and position == carried and "gradients" in group):
            super()._reopen(batch_idx)
            return
        self._checkpoint.resumed = None
        # One rank per data-parallel group carries the counters (the close sums them over that group); every rank
        # takes back its own shard of the averaged gradient, to which the remaining backwards add.
        self._engine.resume_open_group(group, holds_sums=self.device_mesh["data_parallel"].get_local_rank() == 0)
        saved: dict[str, Tensor] = group["gradients"]
        for name, p in self._group_parameters():
            full = saved.get(name)
            if full is None:
                p.grad = None
            elif isinstance(p, DTensor):
                local = full.to(device=p.device, dtype=p.dtype)
                p.grad = distribute_tensor(local, p.device_mesh, p.placements, src_data_rank=None)
            else:
                p.grad = full.to(device=p.device, dtype=p.dtype, copy=True)
        rank_zero_info(
            f"lightning_accum: resumed inside an accumulation group; its first {carried} micro-batch(es) come from the"
            " checkpoint (sharded gradient and counters), so the group closes exactly."
        )

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "accum_fsdp",
            cls,
            description="Exact gradient accumulation with FSDP2 over every device (data parallel = world size)",
            override=True,
            tensor_parallel_size=1,
        )
        strategy_registry.register(
            "accum_model_parallel",
            cls,
            description="Exact gradient accumulation with FSDP2 + tensor parallelism (Lightning's automatic sizes)",
            override=True,
        )
