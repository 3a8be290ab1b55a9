"""Kernels on the gradients: the group's rescale and its NaN/Inf check, the GradScaler skip test, the sum over replicas
a checkpoint inside a group carries. No Lightning here; collectives arrive as a ``reduce_sum(tensor)`` callable."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import Tensor

__all__ = [
    "GradientsByKind",
    "by_kind",
    "rescale_gradients",
    "scale_gradients",
    "scaler_skipped",
    "summed_gradients",
]


def by_kind(tensors: Iterable[Tensor]) -> dict[tuple[torch.device, torch.dtype], list[Tensor]]:
    """``tensors`` grouped by device and dtype (one fused kernel each)."""
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    return groups


def scale_gradients(parameters: Iterable[Tensor], factor: float) -> None:
    """Multiply every existing gradient in place by ``factor``, rounded as :func:`rescale_gradients` rounds.

    Example:
        >>> p = torch.nn.Parameter(torch.ones(2)); p.grad = torch.tensor([1.0, 2.0])
        >>> scale_gradients([p], 0.5); p.grad
        tensor([0.5000, 1.0000])
    """
    for (device, dtype), grads in by_kind(p.grad for p in parameters if p.grad is not None).items():
        if dtype in (torch.float16, torch.bfloat16):
            torch._foreach_mul_(grads, torch.tensor(factor, dtype=torch.float32, device=device))
        else:
            torch._foreach_mul_(grads, factor)


#: Gradients grouped by device and dtype (what :func:`by_kind` returns), one fused kernel per group.
GradientsByKind = Mapping[tuple[torch.device, torch.dtype], list[Tensor]]


def rescale_gradients(
    gradients: Sequence[Tensor] | GradientsByKind, factor: Tensor | float, check: bool
) -> Tensor | None:
    """Multiply ``gradients`` (a list, or :func:`by_kind`'s groups) in place by ``factor``, in float64 for float64
    gradients, else in float32 by the float32 factor, rounded once (docs/concepts.md, "Cost"); a float 1.0
    multiplies nothing. With ``check``, also return a 0-d tensor, positive where a gradient held a NaN/Inf before.

    Example:
        >>> g = [torch.tensor([1.0, float("nan")])]
        >>> flag = rescale_gradients(g, torch.tensor(2.0), check=True)
        >>> float(flag) > 0
        True
        >>> g = [torch.tensor([1.0, 3.0])]
        >>> rescale_gradients(g, 0.5, check=False), g[0]
        (None, tensor([0.5000, 1.5000]))
    """
    flags: list[Tensor] = []
    identity = not isinstance(factor, Tensor) and factor == 1.0
    groups = gradients if isinstance(gradients, Mapping) else by_kind(gradients)
    for (device, dtype), grads in groups.items():
        if not grads or (identity and not check):
            continue
        exact = identity or dtype == torch.float64  # the kernel's float32 factor is 1, the gradients unchanged by it
        if check:
            flag = torch.zeros((), dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(
                grads, flag, _one(device) if exact else _float32(factor, device)
            )
            flags.append(flag)
        if identity:
            continue
        if dtype == torch.float64:
            torch._foreach_mul_(grads, factor.to(device) if isinstance(factor, Tensor) else factor)
        elif not check:
            torch._foreach_mul_(grads, _float32(factor, device))
    if not flags:
        return None
    return flags[0] if len(flags) == 1 else torch.stack([f.to(flags[0].device) for f in flags]).sum()


@functools.cache
def _one(device: torch.device) -> Tensor:
    """The float32 factor 1 on ``device``, formed once (the check's factor where nothing is multiplied)."""
    return torch.ones((), dtype=torch.float32, device=device)


def _float32(factor: Tensor | float, device: torch.device) -> Tensor:
    """``factor`` as a float32 scalar on ``device`` (a float by ``torch.full``: no host copy that waits on a GPU)."""
    if isinstance(factor, Tensor):
        return factor.to(device, torch.float32)
    return torch.full((), factor, dtype=torch.float32, device=device)


def scaler_skipped(scale_before: float, scale_after: float) -> bool:
    """Whether a GradScaler skipped the update it just made (its scale shrinks exactly then), from its scale before
    and after ``update()``.

    Example:
        >>> scaler_skipped(65536.0, 32768.0), scaler_skipped(65536.0, 65536.0), scaler_skipped(65536.0, 131072.0)
        (True, False, False)
    """
    return scale_after < scale_before


def summed_gradients(
    named_parameters: Sequence[tuple[str, Tensor]], reduce_sum: Callable[[Tensor], Tensor] | None
) -> dict[str, Tensor]:
    """The accumulated gradient by parameter name, summed over replicas (``reduce_sum``: a collective every replica
    calls with the same parameters in the same order), on the CPU, in each parameter's dtype.

    Example:
        >>> p = torch.nn.Parameter(torch.zeros(2)); p.grad = torch.ones(2)
        >>> summed_gradients([("w", p)], None)["w"]
        tensor([1., 1.])
    """
    if not named_parameters:
        return {}
    device = named_parameters[0][1].device
    has_grad = torch.tensor(
        [float(p.grad is not None) for _, p in named_parameters], device=device, dtype=torch.float64
    )
    if reduce_sum is not None:
        reduce_sum(has_grad)
    held = [(name, p) for (name, p), flag in zip(named_parameters, has_grad.tolist(), strict=True) if flag > 0]
    by_dtype: dict[torch.dtype, list[tuple[str, Tensor]]] = {}
    for name, p in held:
        by_dtype.setdefault(p.dtype, []).append((name, p))
    gradients: dict[str, Tensor] = {}
    for dtype, members in by_dtype.items():
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(dtype) for _, p in members]
        )
        if reduce_sum is not None:
            reduce_sum(flat)
        flat = flat.cpu()
        offset = 0
        for name, p in members:
            gradients[name] = flat[offset : offset + p.numel()].reshape(p.shape).clone()
            offset += p.numel()
    return gradients
