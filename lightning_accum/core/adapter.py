"""What differs between the engines an accumulation strategy runs on, for both doors: :class:`EngineAdapter`."""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_accum.engine import Replicas
from lightning_accum.gradients import summed_gradients

__all__ = [
    "EngineAdapter",
    "GradientReader",
    "NamedParameters",
    "Split",
    "Write",
    "collective_failure",
    "optimized_parameters",
]

#: The optimized parameters by name, in a fixed order (the same on every replica).
NamedParameters = list[tuple[str, Tensor]]
#: Reads the carried gradient of the named parameters from a distributed checkpoint's shards.
GradientReader = Callable[[list[str]], dict[str, Tensor]]
#: Lightning's ``Strategy.save_checkpoint`` of the strategy underneath.
Write = Callable[[dict[str, Any], Any, Any], None]
#: A checkpoint split as its framework's distributed save splits it: the sharded state (taken out) and the metadata.
Split = Callable[[dict[str, Any]], tuple[dict[str, Any], dict[str, Any]]]


def optimized_parameters(modules: Sequence[Any], optimizers: Sequence[Any] | None) -> NamedParameters:
    """The parameters ``optimizers`` optimize (``None``: all), by name in the modules' order (alike everywhere)."""
    optimized = None if optimizers is None else {id(p) for o in optimizers for g in o.param_groups for p in g["params"]}
    named: NamedParameters = []
    for index, module in enumerate(modules):
        prefix = f"{index}." if len(modules) > 1 else ""
        named += [
            (prefix + name, p) for name, p in module.named_parameters() if optimized is None or id(p) in optimized
        ]
    return named


#: Where a failed collective raises a plain ``RuntimeError`` (gloo's "Connection closed by peer" is one, not a
#: ``DistError``): torch.distributed's collectives and DDP's wrapper (its buffer broadcast before a forward).
_COLLECTIVE_SOURCES = (f"torch{os.sep}distributed{os.sep}", f"torch{os.sep}nn{os.sep}parallel{os.sep}distributed.py")
#: The autograd engine: DDP's gradient all-reduce runs in hooks of a synchronising backward and fails there.
_BACKWARD_SOURCE = f"torch{os.sep}autograd{os.sep}"
#: What a backend's own error names (gloo's begin with the path of its source file, NCCL's name it): raised in the
#: autograd engine, where autograd's own errors of the user's graph (an in-place modification) are raised too, the one
#: sign that the gradient all-reduce failed, not the graph.
_BACKEND_NAMES = ("gloo", "nccl", "NCCL", "ProcessGroup", "c10d")


def collective_failure(exception: BaseException | None, synchronising: bool = False) -> str | None:
    """A short description when ``exception`` or its cause is a failed collective (docs/reliability.md), or ``None``."""
    seen = 0
    while exception is not None and seen < 8:
        if isinstance(exception, torch.distributed.DistError) or (
            type(exception) is RuntimeError and _raised_in_collective(exception, synchronising)
        ):
            text = str(exception).strip()
            first = text.splitlines()[0] if text else type(exception).__name__
            return f"{type(exception).__name__}: {first[:200]}"
        exception = exception.__cause__ or exception.__context__
        seen += 1
    return None


def _raised_in_collective(exception: BaseException, synchronising: bool) -> bool:
    frames = traceback.extract_tb(exception.__traceback__)
    if not frames:
        return False
    where = frames[-1].filename
    if any(source in where for source in _COLLECTIVE_SOURCES):
        return True
    return synchronising and _BACKWARD_SOURCE in where and any(name in str(exception) for name in _BACKEND_NAMES)


class EngineAdapter:
    """The engine-specific side of the accumulation ``strategy`` it serves; each default is what one device does."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    # ------------------------------------------------------------------ replicas

    @property
    def rank(self) -> int:
        """This process's global rank (also before ``setup``; 0 on one device)."""
        return int(self.strategy.global_rank)

    @property
    def data_parallel_size(self) -> int:
        """``D``: the replicas that see different data and whose gradients are averaged."""
        return 1

    @property
    def tensor_parallel_size(self) -> int:
        """The devices that share one model replica."""
        return 1

    def reduce_sum(self, tensor: Tensor) -> Tensor:
        """Sum ``tensor`` in place over the data-parallel replicas (a collective when ``D > 1``); return it."""
        return tensor

    def replicas(self) -> Replicas:
        """What the engine sums a group over, bound at ``setup``."""
        return Replicas(self.data_parallel_size, self.reduce_sum)

    def local_gradient(self, gradient: Tensor) -> Tensor:
        """The part of a gradient this rank rescales and checks (all of it unless gradients are sharded)."""
        return gradient

    def shard_rank(self) -> int | None:
        """The rank named beside a non-finite gradient when each rank checks its own shard, else ``None``."""
        return None

    # ------------------------------------------------------------------ the micro-batch

    @property
    def sync_matters(self) -> bool:
        """Whether a group's last backward must synchronise the gradients over the replicas."""
        return self.data_parallel_size > 1

    # ------------------------------------------------------------------ clipping, after the group's close

    def clip_norm(
        self, parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> Tensor:
        """Scale the gradients to a total norm of at most ``max_norm``; return the norm before."""
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite)

    def clip_value(self, parameters: Iterable[Tensor], clip_val: float) -> None:
        """Clamp every gradient element to ``[-clip_val, clip_val]``."""
        torch.nn.utils.clip_grad_value_(parameters, clip_val)

    # ------------------------------------------------------------------ a checkpoint written inside a group

    def carry_gradients(self, parameters: NamedParameters, unsynced: bool) -> dict[str, Tensor] | None:
        """The open group's gradient summed over replicas, by name (a collective); ``None`` if it cannot be carried."""
        reduce = self.reduce_sum if self.data_parallel_size > 1 else None
        return summed_gradients(parameters, reduce)

    def holds_group_sums(self) -> bool:
        """Whether this rank adds a carried group's counters (one rank per data-parallel group)."""
        return bool(self.strategy.is_global_zero)

    def carried_part(self, parameter: Tensor, carried: Tensor) -> Tensor | None:
        """What this rank adds to ``parameter``'s gradient of a carried group's summed gradient (``None``: nothing)."""
        if not self.holds_group_sums():
            return None
        return carried.to(device=parameter.device, dtype=parameter.dtype, copy=True)

    def write_checkpoint(
        self,
        checkpoint: dict[str, Any],
        filepath: str | Path,
        storage_options: Any,
        write: Write,
        split: Split,
        parameters: Callable[[], NamedParameters],
    ) -> None:
        """Write ``checkpoint`` with ``write``, the framework's own ``save_checkpoint``."""
        write(checkpoint, filepath, storage_options)

    def distributed_reader(self, path: str | Path, parameters: Callable[[], NamedParameters]) -> GradientReader | None:
        """Reads a carried gradient from a distributed checkpoint's shards (``None``: single files only)."""
        return None

    def unpaired_collectives(self, error: BaseException) -> str | None:
        """The error a manual loop raises for a failed collective ``error`` (``None``: ``error`` as it is)."""
        return None
