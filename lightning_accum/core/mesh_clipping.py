"""Gradient clipping for parameters mixing DTensors (any meshes) and plain tensors, each counted once over the mesh."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate

__all__ = ["clip_grad_norm_", "clip_grad_value_", "is_sharded", "local_part", "total_norm"]


def local_part(grad: Tensor) -> Tensor:
    """This rank's part of a (DTensor) gradient, sharing its storage; a plain tensor as it is."""
    return grad.to_local() if isinstance(grad, DTensor) else grad


def is_sharded(placement: Placement) -> bool:
    """Whether a placement splits the tensor: all but ``Replicate`` (FSDP2's strided shard is no ``Shard``)."""
    return not placement.is_replicate()


def total_norm(grads: Iterable[Tensor], norm_type: float = 2.0) -> Tensor:
    """The ``norm_type``-norm of all ``grads`` together, each counted once over its mesh (a float64 0-d tensor)."""
    infinite = math.isinf(norm_type)
    reduce_op = "max" if infinite else "sum"
    device: torch.device | None = None
    plain: list[Tensor] = []
    layouts: dict[tuple[object, tuple[bool, ...]], list[Tensor]] = {}
    for grad in grads:
        device = device or local_part(grad).device
        if isinstance(grad, DTensor):
            if any(p.is_partial() for p in grad.placements):  # not a layout backward leaves; reduce it first
                grad = grad.redistribute(placements=[Replicate() if p.is_partial() else p for p in grad.placements])
            key = (grad.device_mesh, tuple(is_sharded(p) for p in grad.placements))
            layouts.setdefault(key, []).append(grad.to_local())
        else:
            plain.append(grad)
    if device is None:
        return torch.zeros((), dtype=torch.float64)
    parts = [_power(plain, norm_type, device)]
    for (mesh, sharded), locals_ in layouts.items():
        local = _power(locals_, norm_type, device)
        placements = [Partial(reduce_op) if shard else Replicate() for shard in sharded]
        # The sharded dimensions add (or take the max of) their ranks' parts; a replicated one holds it once.
        parts.append(DTensor.from_local(local, mesh, placements, run_check=False).full_tensor())  # type: ignore[arg-type]
    combined = torch.stack(parts)
    return combined.max() if infinite else combined.sum() ** (1.0 / norm_type)


def _power(tensors: list[Tensor], norm_type: float, device: torch.device) -> Tensor:
    if not tensors:
        return torch.zeros((), device=device, dtype=torch.float64)
    # Each norm in its tensor's precision (half precision in float32), combined in float64.
    norms = torch.stack([_norm(t, norm_type).to(device=device, dtype=torch.float64) for t in tensors])
    return norms.max() if math.isinf(norm_type) else (norms**norm_type).sum()


def _norm(tensor: Tensor, norm_type: float) -> Tensor:
    dtype = torch.float32 if tensor.dtype in (torch.float16, torch.bfloat16) else None
    return torch.linalg.vector_norm(tensor, norm_type, dtype=dtype)


def clip_grad_norm_(
    parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> Tensor:
    """torch's ``clip_grad_norm_`` over the mesh; returns the norm before (``error_if_nonfinite``: as torch's)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = total_norm(grads, float(norm_type))
    if not grads:
        return norm
    if error_if_nonfinite and not bool(torch.isfinite(norm)):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it cannot"
            " be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set"
            " `error_if_nonfinite=False`"
        )
    factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for grad in grads:
        local = local_part(grad)
        local.mul_(factor.to(device=local.device, dtype=local.dtype))
    return norm


def clip_grad_value_(parameters: Iterable[Tensor], clip_value: float) -> None:
    """Clamp every gradient element to ``[-clip_value, clip_value]``, each local shard in place."""
    for p in parameters:
        if p.grad is not None:
            local_part(p.grad).clamp_(-clip_value, clip_value)
