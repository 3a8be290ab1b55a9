"""DDP's side of the core: :class:`DDPAdapter` (``D`` = the world size, its all-reduce), and the DDP strategy strings
both doors register (:data:`DDP_STRINGS`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed
from torch import Tensor
from typing_extensions import override

from lightning_accum.core.adapter import EngineAdapter

__all__ = ["DDP_STRINGS", "DDPAdapter", "register_ddp_strings"]

#: The DDP strategy strings and their constructor arguments, in Lightning's registry and in Fabric's.
DDP_STRINGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("accum_ddp", {"start_method": "popen"}),
    ("accum_ddp_spawn", {"start_method": "spawn"}),
    ("accum_ddp_fork", {"start_method": "fork"}),
    ("accum_ddp_notebook", {"start_method": "fork"}),
    ("accum_ddp_find_unused_parameters_true", {"start_method": "popen", "find_unused_parameters": True}),
)


def register_ddp_strings(registry: Any, strategy: type, where: str) -> None:
    """Register :data:`DDP_STRINGS` for ``strategy`` in ``registry`` (Lightning's or Fabric's; ``where``: " in a Fabric
    loop" or "")."""
    for name, options in DDP_STRINGS:
        description = f"Exact gradient accumulation{where} with DDP ({options})"
        registry.register(name, strategy, description=description, override=True, **options)


class DDPAdapter(EngineAdapter):
    """DDP's side of the core (see :class:`~lightning_accum.core.adapter.EngineAdapter` for the interface): ``D`` = the
    world size and its all-reduce; the rest is one device's."""

    @property
    @override
    def data_parallel_size(self) -> int:
        return int(self.strategy.num_nodes * self.strategy.num_processes)

    @override
    def reduce_sum(self, tensor: Tensor) -> Tensor:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
        return tensor
