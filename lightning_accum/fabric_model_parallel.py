"""What Fabric's ``ModelParallelStrategy`` needs beyond the core, for ``FabricModelParallelAccumulationStrategy``."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.nn import Module, ModuleList
from torch.optim import Optimizer
from typing_extensions import override

__all__ = ["BackwardSyncNotes", "shard_module_lists", "sharded_state"]


def shard_module_lists(module: Module, device_mesh: DeviceMesh) -> Module:
    """The ``parallelize_fn`` of ``"accum_fsdp"``: ``fully_shard`` on each child of every ``ModuleList`` of
    ``module``, the innermost first, then on ``module``, over ``device_mesh["data_parallel"]``; returns ``module``."""
    from torch.distributed.fsdp import fully_shard

    mesh = device_mesh["data_parallel"]
    blocks = {id(child): child for m in module.modules() if isinstance(m, ModuleList) for child in m}
    for block in reversed(list(blocks.values())):  # a block's inner blocks before the block that holds them
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


class BackwardSyncNotes(_BackwardSyncControl):
    """Fabric's ``no_backward_sync`` control of the strategy, noting in :attr:`blocking` whether synchronisation is
    blocked now.

    Args:
        control: Fabric's own control (``ModelParallelStrategy``'s), which does the blocking.
    """

    def __init__(self, control: _BackwardSyncControl) -> None:
        self.control = control
        #: Whether synchronisation is blocked now: a backward run leaves its gradient uncombined over the replicas.
        self.blocking = False

    @override
    @contextmanager
    def no_backward_sync(self, module: Module, enabled: bool) -> Generator[None, None, None]:
        with self.control.no_backward_sync(module, enabled):
            before, self.blocking = self.blocking, enabled
            try:
                yield
            finally:
                self.blocking = before


def sharded_state(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A ``fabric.save`` state as Fabric's distributed save splits it: the modules' and optimizers' sharded state
    dicts, and the rest (the metadata file's).

    Raises:
        ValueError: ``state`` does not hold exactly one sharded model (Fabric's rule for a distributed checkpoint).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    models = [obj for obj in state.values() if isinstance(obj, Module) and _sharded(obj)]
    if len(models) != 1:
        keys = sorted(key for key, obj in state.items() if any(obj is model for model in models))
        raise ValueError(
            f"`fabric.save(path, state)`: a distributed checkpoint holds one sharded model, but `state` holds"
            f" {len(models)} (under {keys}). Pass the model `fabric.setup_module` returned once, and save other"
            " sharded models to other paths."
        )
    options = StateDictOptions(cpu_offload=True)
    sharded: dict[str, Any] = {}
    metadata: dict[str, Any] = {}
    for key, obj in state.items():
        if isinstance(obj, Module):
            sharded[key] = get_model_state_dict(obj, options=options)
        elif isinstance(obj, Optimizer):
            sharded[key] = get_optimizer_state_dict(models[0], obj, options=options)
        else:
            stateful = callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
            metadata[key] = obj.state_dict() if stateful else obj
    return sharded, metadata


def _sharded(module: Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())
