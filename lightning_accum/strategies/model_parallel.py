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

import warnings
from collections.abc import Callable, Generator, Iterable
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn import Module
from typing_extensions import override

from lightning_accum.engine import Replicas
from lightning_accum.microbatch import Count
from lightning_accum.options import AccumulationOptions
from lightning_accum.strategies.adapter import (
    EngineAdapter,
    GradientReader,
    NamedParameters,
    Split,
    Write,
    collective_failure,
)
from lightning_accum.strategies.base import ExactAccumulation
from lightning_accum.strategies.checkpoint import CHECKPOINT_KEY, DISTRIBUTED_KEY, malformed
from lightning_accum.strategies.mesh_clipping import clip_grad_norm_, clip_grad_value_, local_part

__all__ = [
    "GRADIENT_SYNC_MODES",
    "MeshAdapter",
    "ModelParallelAccumulationStrategy",
    "bound_mesh_groups",
    "check_mesh_sizes",
    "derive_mesh_sizes",
    "refuse_unsharded",
]

#: The values of ``gradient_sync``.
GRADIENT_SYNC_MODES = ("every_microbatch", "last_microbatch")


def check_mesh_sizes(data_parallel_size: Any, tensor_parallel_size: Any) -> None:
    """Refuse a mesh size that is neither ``"auto"`` nor an int ≥ 1 (both doors' constructors)."""
    for name, size in (("data_parallel_size", data_parallel_size), ("tensor_parallel_size", tensor_parallel_size)):
        if size != "auto" and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise ValueError(f"`{name}` must be 'auto' or an int ≥ 1, got {size!r}.")


def derive_mesh_sizes(strategy: Any, devices: str) -> None:
    """Before the mesh is built (``setup_environment``): one size given as an int and the other ``"auto"`` makes the
    other the world size divided by it; a product that is not the world size is named. ``strategy`` is Lightning's or
    Fabric's ``ModelParallelStrategy`` (its ``_data_parallel_size`` and ``_tensor_parallel_size`` are written);
    ``devices`` names where the user sets the world size (``"the Trainer's `devices=` / `num_nodes=`"``)."""
    world = strategy.num_nodes * strategy.num_processes
    dp, tp = strategy._data_parallel_size, strategy._tensor_parallel_size
    where = f"{world} = {strategy.num_nodes} node(s) × {strategy.num_processes} device(s)"
    for given, other, name in ((dp, tp, "tensor_parallel_size"), (tp, dp, "data_parallel_size")):
        if isinstance(given, int) and other == "auto" and world % given:
            raise ValueError(
                f"The world size ({where}) is not a multiple of"
                f" {'data_parallel_size' if given is dp else 'tensor_parallel_size'}={given}, so `{name}` cannot be"
                " derived. Choose sizes whose product is the number of devices."
            )
    if isinstance(dp, int) and tp == "auto":
        strategy._tensor_parallel_size = world // dp
    elif isinstance(tp, int) and dp == "auto":
        strategy._data_parallel_size = world // tp
    dp, tp = strategy._data_parallel_size, strategy._tensor_parallel_size
    if isinstance(dp, int) and isinstance(tp, int) and dp * tp != world:
        raise ValueError(
            f"`data_parallel_size={dp}` × `tensor_parallel_size={tp}` = {dp * tp}, but the world size is {world}"
            f" ({strategy.num_nodes} node(s) × {strategy.num_processes} device(s)). Their product must equal the world"
            f" size: change one of them, or {devices}."
        )


def refuse_unsharded(model: Module | None, strategy: Any, sharded_by: str, how: str) -> None:
    """Refuse, on several devices, a model that ``sharded_by`` left with no FSDP2 module and no DTensor parameter:
    every device would train its own unsynchronized copy. ``how`` says how to shard it."""
    from torch.distributed.fsdp import FSDPModule

    if model is None or strategy.world_size <= 1:
        return
    if any(isinstance(m, FSDPModule) for m in model.modules()) or any(
        isinstance(p, DTensor) for p in model.parameters()
    ):
        return
    raise RuntimeError(
        f"{type(strategy).__name__} runs on {strategy.world_size} devices, but after {sharded_by} no parameter is"
        " sharded (no `fully_shard` module, no DTensor parameter): every device would train its own unsynchronized"
        f" copy. {how}; or use strategy='accum_ddp' for a model that fits one device."
    )


def bound_mesh_groups(strategy: Any) -> None:
    """After the mesh is built (``setup_environment``): the strategy's ``timeout=`` on the process group of each of
    its dimensions. torch's device mesh makes those groups with torch's default timeout (30 minutes for gloo) whenever
    a dimension is not the whole world (a (2, 2) mesh), and on torch 2.9 for the data-parallel dimension of a (D, 1)
    mesh too, so a rank waiting for a lost partner there would wait 30 minutes instead of ``timeout=``.
    ``strategy`` is Lightning's or Fabric's ``ModelParallelStrategy`` (its ``_timeout`` is read)."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    timeout = strategy._timeout
    if timeout is None:
        return
    mesh = strategy.device_mesh
    for name in mesh.mesh_dim_names or ():
        _set_pg_timeout(timeout, mesh.get_group(name))


class MeshAdapter(EngineAdapter):
    """FSDP2's and tensor parallelism's side of an accumulation strategy (see
    :class:`~lightning_accum.strategies.adapter.EngineAdapter` for the interface): ``D`` = the data-parallel mesh size,
    the counts summed over the data-parallel group, the local gradient shards (rescaled and checked, the check summed
    over the whole mesh), clipping over the mesh, the slice count agreed over the mesh, and a checkpoint's open group
    written and read shard by shard.

    Of its strategy (the Trainer's or Fabric's) it reads, beyond public members, the mesh sizes and checkpoint form both
    frameworks keep private (``_data_parallel_size``, ``_tensor_parallel_size``, ``_save_distributed_checkpoint``)."""

    def __init__(self, strategy: Any) -> None:
        super().__init__(strategy)
        self._slice_group: Any = None  # a gloo group for the slice count when the backend is not gloo

    def _mesh_size(self, dimension: str, given: Literal["auto"] | int) -> int:
        try:
            return int(self.strategy.device_mesh[dimension].size())
        except RuntimeError:  # before the processes are set up: the size given, or 1 while "auto"
            return given if isinstance(given, int) else 1

    @property
    @override
    def rank(self) -> int:
        return int(self.strategy.global_rank)

    @property
    @override
    def data_parallel_size(self) -> int:
        return self._mesh_size("data_parallel", self.strategy._data_parallel_size)

    @property
    @override
    def tensor_parallel_size(self) -> int:
        return self._mesh_size("tensor_parallel", self.strategy._tensor_parallel_size)

    @override
    def reduce_sum(self, tensor: Tensor) -> Tensor:
        if self.data_parallel_size > 1:
            group = self.strategy.device_mesh["data_parallel"].get_group()
            torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM, group=group)
        return tensor

    @override
    def replicas(self) -> Replicas:
        # Each rank checks its own shard for NaN/Inf: the check is summed over the whole mesh (see the module).
        return Replicas(self.data_parallel_size, self.reduce_sum, check_sum=self._sum_over_mesh)

    def _sum_over_mesh(self, tensor: Tensor) -> Tensor:
        if torch.distributed.is_available() and torch.distributed.is_initialized() and self.strategy.world_size > 1:
            torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
        return tensor

    @override
    def local_gradient(self, gradient: Tensor) -> Tensor:
        return local_part(gradient)

    @property
    @override
    def sync_matters(self) -> bool:
        return True  # FSDP2 holds the gradient unreduced while synchronisation is blocked, on one replica too

    @override
    def shard_rank(self) -> int | None:
        return int(self.strategy.global_rank)

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

    # ------------------------------------------------------------------ clipping over the mesh

    @override
    def clip_norm(
        self, parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> Tensor:
        return clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite)

    @override
    def clip_value(self, parameters: Iterable[Tensor], clip_val: float) -> None:
        clip_grad_value_(parameters, clip_val)

    # ------------------------------------------------------------------ checkpoints

    @override
    def carry_gradients(self, parameters: NamedParameters, unsynced: bool) -> dict[str, Tensor] | None:
        strategy = self.strategy
        trainer_sync = getattr(strategy, "gradient_sync", None) == "last_microbatch"  # Fabric's strategy has none
        if trainer_sync or unsynced:
            # The group's gradient sits unreduced in FSDP2's own accumulators, not in `.grad`: nothing public to save.
            why, fix = (
                (
                    "under gradient_sync='last_microbatch'",
                    "Use gradient_sync='every_microbatch', or write checkpoints at update boundaries (ModelCheckpoint's"
                    " default)",
                )
                if trainer_sync
                else (
                    "after backwards inside `fabric.no_backward_sync(model, enabled=True)`",
                    "Save after a group's `optimizer.step()`, or run the micro-batches of a group you save inside"
                    " without `no_backward_sync` (each backward then reduce-scatters its gradient)",
                )
            )
            rank_zero_warn(
                f"lightning_accum: this checkpoint is written inside an accumulation group"
                f" ({strategy.engine.microbatches_in_group} micro-batch(es) so far); {why} the group's gradient is held"
                " unreduced inside FSDP2 and cannot be carried, so a run resumed from it updates that group without"
                f" those micro-batches (normalized by what remains, and said again on resume). {fix}, for an exact"
                " resume."
            )
            return None
        # Every micro-batch was reduce-scattered: each rank's shard holds its part of the replicas' average so far.
        # The checkpoint carries their sum (the one meaning of a carried gradient): the average times D. A distributed
        # checkpoint writes it shard by shard (`write_checkpoint`); one file holds it whole, gathered for rank zero.
        replicas = self.data_parallel_size
        sharded = bool(strategy._save_distributed_checkpoint)
        keep = strategy.global_rank == 0
        gradients: dict[str, Tensor] = {}
        for name, p in parameters:
            if p.grad is None:
                continue
            if sharded:
                gradients[name] = p.grad.detach() * replicas
                continue
            if isinstance(p.grad, DTensor):
                full = p.grad.full_tensor()  # a collective, in every rank's order; a new tensor, scaled in place
                if keep:
                    gradients[name] = full.mul_(replicas).to("cpu")
            elif keep:
                gradients[name] = (p.grad.detach() * replicas).to("cpu")
        return gradients

    @override
    def write_checkpoint(
        self,
        checkpoint: dict[str, Any],
        filepath: Any,
        storage_options: Any,
        write: Write,
        split: Split,
        parameters: Callable[[], NamedParameters],
    ) -> None:
        group = checkpoint.get(CHECKPOINT_KEY, {}).get("open_group")
        gradients = group.get("gradients") if isinstance(group, dict) else None
        if gradients is None:
            write(checkpoint, filepath, storage_options)
            return
        group = dict(group)
        checkpoint[CHECKPOINT_KEY] = {**checkpoint[CHECKPOINT_KEY], "open_group": group}
        if not self.strategy._save_distributed_checkpoint:
            # Whole tensors in one file (a group read from a distributed checkpoint and not yet reopened is gathered).
            group["gradients"] = {
                name: (g.full_tensor() if isinstance(g, DTensor) else g).to("cpu") for name, g in gradients.items()
            }
            write(checkpoint, filepath, storage_options)
            return
        by_name = dict(parameters())
        shards = {name: _as_shard(g, by_name.get(name)) for name, g in gradients.items()}
        del group["gradients"]
        group.update(gradients_stored="distributed", gradient_names=sorted(shards))
        from lightning.fabric.utilities.load import _METADATA_FILENAME
        from torch.distributed.checkpoint import save

        # Lightning's distributed save (the Trainer's or Fabric's), with the open group's gradient as one more entry of
        # the sharded state: each rank writes its own shards, nothing is gathered.
        if storage_options is not None:
            name = type(self.strategy).__name__
            raise TypeError(
                f"`{name}.save_checkpoint(..., storage_options=...)` is not supported because `{name}` does not use"
                " the `CheckpointIO`."
            )
        path = Path(self.strategy.broadcast(filepath))
        if path.is_file():
            path.unlink()
        path.mkdir(parents=True, exist_ok=True)
        state, metadata = split(checkpoint)
        state[DISTRIBUTED_KEY] = shards
        save(state, checkpoint_id=path)
        if self.strategy.global_rank == 0:
            torch.save(metadata, path / _METADATA_FILENAME)

    @override
    def distributed_reader(self, path: Any, parameters: Callable[[], NamedParameters]) -> GradientReader | None:
        folder = Path(path)
        if not folder.is_dir():
            return None

        def read(names: list[str]) -> dict[str, Tensor]:
            # Each rank reads its own shards, in the layout of this run (another D or mesh than the writer's too).
            from torch.distributed.checkpoint import FileSystemReader, TensorStorageMetadata, load

            stored = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
            by_name = dict(parameters())
            templates: dict[str, Tensor] = {}
            for name in names:
                key = f"open_group.gradients[{name!r}]"
                p = by_name.get(name)
                if p is None:
                    raise malformed(key, f"the gradient of one of the parameters {sorted(by_name)}", name)
                meta = stored.get(f"{DISTRIBUTED_KEY}.{name}")
                if not isinstance(meta, TensorStorageMetadata):
                    raise malformed(key, f"a tensor in the distributed checkpoint under {DISTRIBUTED_KEY!r}", "missing")
                if tuple(meta.size) != tuple(p.shape):
                    raise malformed(key, f"a tensor of shape {tuple(p.shape)}", meta.size)
                if not meta.properties.dtype.is_floating_point:
                    raise malformed(key, "a floating-point tensor", meta.properties.dtype)
                templates[name] = torch.zeros_like(p, dtype=meta.properties.dtype)
            load({DISTRIBUTED_KEY: templates}, checkpoint_id=str(folder))
            return templates

        return read

    @override
    def holds_group_sums(self) -> bool:
        return bool(self.strategy.device_mesh["data_parallel"].get_local_rank() == 0)

    @override
    def unpaired_collectives(self, error: BaseException) -> str | None:
        failure = collective_failure(error)
        if failure is None or self.strategy.world_size == 1:
            return None
        return (
            f"lightning_accum: a collective failed ({failure}): the ranks' collectives did not pair up. Under FSDP2"
            " or tensor parallelism every micro-batch's forward and backward run collectives, so the usual cause is"
            " a rank that ran a different number of micro-batches in this group than another (a loop counting its"
            " own micro-batches, or data of unequal length per rank); a rank that died is the other (its own log"
            " says so). Keep the micro-batch counts equal on every rank (one loader length per rank, `group_size=`"
            " on a short last group). The wait for the missing partner is bounded by the strategy's `timeout=`."
        )

    @override
    def on_exception(self, exception: BaseException) -> None:
        # The Trainer's door: a rank whose failed collective ran in the module's own code (the forward of a micro-batch
        # more: FSDP2's all-gather) is told too, once (the close and the backward raise the message themselves).
        message = self.unpaired_collectives(exception)
        if message is not None and message != str(exception):
            warnings.warn(message, UserWarning, stacklevel=1)

    @override
    def carried_part(self, parameter: Tensor, carried: Tensor) -> Tensor | None:
        # Every rank adds its shard of the replicas' sum divided by this run's D: FSDP2's reduce-scatter averages the
        # remaining micro-batches' gradients over the replicas, and the close multiplies by c · D / W.
        return _as_shard(carried, parameter).to(dtype=parameter.dtype) / self.data_parallel_size


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
            small CPU all-reduce per loader batch agrees on it); see ``docs/howto.md``. ``"auto"`` is an error here.
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
    adapter_type = MeshAdapter

    def __init__(
        self,
        *,
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
        check_mesh_sizes(data_parallel_size, tensor_parallel_size)
        options = AccumulationOptions.pick(locals())  # the options declared above, one by one for LightningCLI
        self._init_accumulation(options, microbatch_size, split_batch)
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
        derive_mesh_sizes(self, "the Trainer's `devices=` / `num_nodes=`")
        super().setup_environment()
        bound_mesh_groups(self)

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
        self._sync_blocked = True  # a manual loop's close after a last backward here is refused
        try:
            yield
        finally:
            self._sync_blocked = False
            for m in modules:
                m.set_requires_gradient_sync(True, recurse=False)

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


def _as_shard(gradient: Tensor, parameter: Tensor | None) -> Tensor:
    """``gradient`` in ``parameter``'s layout: a whole tensor becomes this rank's shard of it (no communication); a
    sharded one is already in it (read into templates of this run's parameters)."""
    if isinstance(parameter, DTensor) and not isinstance(gradient, DTensor):
        local = gradient.to(device=parameter.device)
        return distribute_tensor(local, parameter.device_mesh, parameter.placements, src_data_rank=None)
    if parameter is not None and not isinstance(gradient, DTensor):
        return gradient.to(device=parameter.device, copy=True)
    return gradient
