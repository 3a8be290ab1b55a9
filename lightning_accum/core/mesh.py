"""FSDP2's and tensor parallelism's side of the core: :class:`MeshAdapter`, and what both doors' mesh strategies check
(:func:`check_mesh_sizes`, :func:`derive_mesh_sizes`, :func:`refuse_unsharded`).

Three things differ from DDP: ``D`` is the size of the ``data_parallel`` mesh dimension (a tensor-parallel group holds
one replica and reads the same batch: its counts are summed over the data-parallel group only); the rescale
``c · D / W`` acts on each rank's local shard of the DTensor gradients (exact: one scalar for every element); and each
rank checks only its own shard for NaN/Inf, so the check is summed over the whole mesh before the one host read (FSDP's
reduce-scatter brings a NaN only to the rank that owns those elements).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn import Module
from typing_extensions import override

from lightning_accum.core.adapter import (
    EngineAdapter,
    GradientReader,
    NamedParameters,
    Split,
    Write,
    collective_failure,
)
from lightning_accum.core.entry import CHECKPOINT_KEY, DISTRIBUTED_KEY, check_gradient, malformed
from lightning_accum.core.mesh_clipping import clip_grad_norm_, clip_grad_value_, local_part
from lightning_accum.core.reading import checkpoint_location, fsspec_reader
from lightning_accum.engine import Replicas

__all__ = [
    "MeshAdapter",
    "bound_mesh_groups",
    "check_mesh_sizes",
    "derive_mesh_sizes",
    "mesh_environment",
    "refuse_unsharded",
    "register_fsdp_string",
]


def register_fsdp_string(registry: Any, strategy: type, where: str, layout: str, **init: Any) -> None:
    """Register ``"accum_fsdp"`` (FSDP2 over every device: ``tensor_parallel_size=1``) for ``strategy`` in ``registry``
    (Lightning's or Fabric's; ``where``: " in a Fabric loop" or "", ``layout``: what the description adds)."""
    description = f"Exact gradient accumulation{where} with FSDP2 over every device ({layout})"
    registry.register("accum_fsdp", strategy, description=description, override=True, tensor_parallel_size=1, **init)


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


@contextmanager
def mesh_environment(strategy: Any, devices: str) -> Iterator[None]:
    """Around the framework's ``setup_environment`` (both doors): :func:`derive_mesh_sizes` before the mesh is built,
    :func:`bound_mesh_groups` after."""
    derive_mesh_sizes(strategy, devices)
    yield
    bound_mesh_groups(strategy)


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


def _save_sharded(folder: Path | str, state: dict[str, Any], metadata: dict[str, Any], rank: int) -> None:
    """Each rank's shards of ``state`` into ``folder`` and, from rank zero, ``metadata`` into Lightning's metadata file:
    the layout of Lightning's distributed save, at a local path or a remote (fsspec) URL."""
    from lightning.fabric.utilities.load import _METADATA_FILENAME
    from torch.distributed.checkpoint import save

    if isinstance(folder, Path):
        if folder.is_file():
            folder.unlink()
        folder.mkdir(parents=True, exist_ok=True)
        save(state, checkpoint_id=folder)
        if rank == 0:
            torch.save(metadata, folder / _METADATA_FILENAME)
        return
    # A remote URL, where Lightning's own sharded save takes one: torch writes the shards through fsspec (and makes the
    # folder where the storage has folders).
    fs = get_filesystem(folder)
    if fs.isfile(folder):
        fs.rm(folder)
    save(state, checkpoint_id=folder)
    if rank == 0:
        with fs.open(f"{folder.rstrip('/')}/{_METADATA_FILENAME}", "wb") as file:
            torch.save(metadata, file)


class MeshAdapter(EngineAdapter):
    """FSDP2's and tensor parallelism's side of the core (the module says what differs from DDP; the interface is
    :class:`~lightning_accum.core.adapter.EngineAdapter`'s), with clipping over the mesh and a checkpoint's open group
    written and read shard by shard. Of its strategy (the Trainer's or Fabric's) it reads, beyond public members, the
    private ``_data_parallel_size``, ``_tensor_parallel_size`` and ``_save_distributed_checkpoint``."""

    def _mesh_size(self, dimension: str, given: Literal["auto"] | int) -> int:
        try:
            return int(self.strategy.device_mesh[dimension].size())
        except RuntimeError:  # before the processes are set up: the size given, or 1 while "auto"
            return given if isinstance(given, int) else 1

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
        checkpoint_location(filepath)  # a remote URL on a Lightning that would write it as a local path: refused
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
        # Lightning's distributed save (the Trainer's or Fabric's), with the open group's gradient as one more entry of
        # the sharded state: each rank writes its own shards, nothing is gathered.
        if storage_options is not None:
            name = type(self.strategy).__name__
            raise TypeError(
                f"`{name}.save_checkpoint(..., storage_options=...)` is not supported because `{name}` does not use"
                " the `CheckpointIO`."
            )
        state, metadata = split(checkpoint)
        state[DISTRIBUTED_KEY] = shards
        _save_sharded(
            checkpoint_location(self.strategy.broadcast(filepath)), state, metadata, self.strategy.global_rank
        )

    @override
    def distributed_reader(self, path: Any, parameters: Callable[[], NamedParameters]) -> GradientReader | None:
        folder = checkpoint_location(path)
        if not (folder.is_dir() if isinstance(folder, Path) else get_filesystem(folder).isdir(folder)):
            return None

        def read(names: list[str]) -> dict[str, Tensor]:
            # Each rank reads its own shards, in the layout of this run (another D or mesh than the writer's too).
            from torch.distributed.checkpoint import FileSystemReader, TensorStorageMetadata, load

            reader = FileSystemReader(folder) if isinstance(folder, Path) else fsspec_reader()(folder)
            stored = reader.read_metadata().state_dict_metadata
            by_name = dict(parameters())
            shapes = {n: tuple(p.shape) for n, p in by_name.items()}
            templates: dict[str, Tensor] = {}
            for name in names:
                meta = stored.get(f"{DISTRIBUTED_KEY}.{name}")
                if not isinstance(meta, TensorStorageMetadata):
                    expected = f"a tensor in the distributed checkpoint under {DISTRIBUTED_KEY!r}"
                    raise malformed(f"open_group.gradients[{name!r}]", expected, "missing")
                check_gradient(name, meta.size, meta.properties.dtype, shapes)
                templates[name] = torch.zeros_like(by_name[name], dtype=meta.properties.dtype)
            load({DISTRIBUTED_KEY: templates}, checkpoint_id=folder)
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
    def carried_part(self, parameter: Tensor, carried: Tensor) -> Tensor | None:
        # Every rank adds its shard of the replicas' sum divided by this run's D: FSDP2's reduce-scatter averages the
        # remaining micro-batches' gradients over the replicas, and the close multiplies by c · D / W.
        return _as_shard(carried, parameter).to(dtype=parameter.dtype) / self.data_parallel_size


def _as_shard(gradient: Tensor, parameter: Tensor | None) -> Tensor:
    """``gradient`` in ``parameter``'s layout: a whole tensor becomes this rank's shard of it (no communication); a
    sharded one is already in it (read into templates of this run's parameters)."""
    if isinstance(parameter, DTensor) and not isinstance(gradient, DTensor):
        local = gradient.to(device=parameter.device)
        return distribute_tensor(local, parameter.device_mesh, parameter.placements, src_data_rank=None)
    if parameter is not None and not isinstance(gradient, DTensor):
        return gradient.to(device=parameter.device, copy=True)
    return gradient
