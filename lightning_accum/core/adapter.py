"""What differs between the engines an accumulation strategy runs on, for both doors: :class:`EngineAdapter`.

Where one device (:class:`EngineAdapter`'s defaults), DDP (:class:`~lightning_accum.core.ddp.DDPAdapter`) and FSDP2 /
tensor parallelism (:class:`~lightning_accum.core.mesh.MeshAdapter`) differ (the replicas a group is summed over,
sharded gradients, clipping, what a checkpoint written inside a group carries and where), the core asks the adapter
of the class its strategy names in ``adapter_type``. The adapter reads the strategy it serves (its public members and
the few private ones ``docs/internals.md`` lists) and is handed everything else; the methods below are the whole
interface. What only a Trainer asks, because Lightning runs the loop (Lightning's grouping, lost peers, data that ends
on some replicas, the slice count, the checks at ``setup``), is the Trainer door's own part,
:class:`~lightning_accum.strategies.trainer_side.TrainerSide`.
"""

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
    """The parameters ``optimizers`` optimize (``None``: every parameter), by name, in the modules' order (the same on
    every replica); with several modules (Fabric's ``setup`` called more than once) a name is prefixed by its module's
    place. The one way both doors name what a checkpoint's carried gradient belongs to."""
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
    """A short description when ``exception`` (or one it was raised from) is a failed collective, else ``None``.

    Recognised by its type, a ``torch.distributed.DistError`` (backend, network and store errors), or, for the plain
    ``RuntimeError`` gloo raises, by where it was raised: inside torch.distributed or DDP's wrapper, or inside the
    autograd engine during a backward that synchronises gradients over the replicas (``synchronising``). Only in that
    last place, where autograd raises the user's own graph errors too (an in-place modification), is its text read:
    it must name a communication backend (:data:`_BACKEND_NAMES`). Elsewhere it is never read: an HTTP timeout or a
    ``ValueError`` naming a backend raised by the user's code is not a lost peer.
    """
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
    """Whether the innermost frame of ``exception``'s traceback (where it was raised) is a collective's."""
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
        """This process's global rank (from the cluster environment, also before ``setup``; 0 on one device)."""
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
        """This rank, named beside a non-finite gradient where each rank checks its own shard (``None``: every rank
        checks the whole gradient)."""
        return None

    # ------------------------------------------------------------------ the micro-batch

    @property
    def sync_matters(self) -> bool:
        """Whether a backward with gradient synchronisation blocked leaves its gradient uncombined over the replicas
        (several data-parallel replicas; FSDP2 holds it unreduced on one replica too): a group's last backward must
        then synchronise."""
        return self.data_parallel_size > 1

    # ------------------------------------------------------------------ clipping, after the group's close

    def clip_norm(
        self, parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> Tensor:
        """Scale the gradients of ``parameters`` to a total norm of at most ``max_norm``; return the norm before. Both
        doors clip here (``self.clip_gradients``, ``gradient_clip_val=``, ``fabric.clip_gradients``): torch's."""
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite)

    def clip_value(self, parameters: Iterable[Tensor], clip_val: float) -> None:
        """Clamp every gradient element of ``parameters`` to ``[-clip_val, clip_val]`` (both doors): torch's."""
        torch.nn.utils.clip_grad_value_(parameters, clip_val)

    # ------------------------------------------------------------------ a checkpoint written inside a group

    def carry_gradients(self, parameters: NamedParameters, unsynced: bool) -> dict[str, Tensor] | None:
        """The open group's gradient summed over replicas, by parameter name (a collective: every replica calls it);
        ``None`` where this engine cannot carry it (it says why); ``unsynced``: a backward of it ran unsynchronised."""
        reduce = self.reduce_sum if self.data_parallel_size > 1 else None
        return summed_gradients(parameters, reduce)

    def holds_group_sums(self) -> bool:
        """Whether this rank adds a carried group's counters (one rank per data-parallel group: the close's all-reduce
        adds them to the others')."""
        return bool(self.strategy.is_global_zero)

    def carried_part(self, parameter: Tensor, carried: Tensor) -> Tensor | None:
        """What this rank adds to ``parameter``'s gradient of a carried group's gradient (the replicas' sum): all of it
        on the rank holding the group's sums, nothing elsewhere; DDP's average at the group's last backward and the
        close's ``c · D / W`` then treat it as any replica's part."""
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
        """Write ``checkpoint`` (with the package's entry) with ``write``, the framework's own ``save_checkpoint``."""
        write(checkpoint, filepath, storage_options)

    def distributed_reader(self, path: str | Path, parameters: Callable[[], NamedParameters]) -> GradientReader | None:
        """Reads a carried gradient from a distributed checkpoint's shards at ``path`` (``None``: single files only)."""
        return None

    def unpaired_collectives(self, error: BaseException) -> str | None:
        """What a manual loop's close or backward (either door) raises from ``error`` when it is a failed collective
        whose likely cause is the engine's to name (``None``: ``error`` reaches the loop as it is)."""
        return None
