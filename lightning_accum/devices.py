"""Which devices exact accumulation runs on: the one property it needs of a device, float64.

A group's sums, the evaluation's weighted mean and the ledger's values live in ``float64`` on the loss's device
(float32 is exact only up to 2^24). The strategies check the device when they bind the engine to it, before any
training, and name the way out; the supported accelerators are in docs/concepts.md ("Supported accelerators").
"""

from __future__ import annotations

import torch

__all__ = ["WITHOUT_FLOAT64", "require_float64"]

#: Device types (``torch.device.type``) that have no ``float64``, with what they are, for the message.
WITHOUT_FLOAT64: dict[str, str] = {"mps": "Apple's MPS"}


def require_float64(device: torch.device | str) -> None:
    """Raise a ``RuntimeError`` when ``device`` has no ``float64``, which exact accumulation needs.

    Decided by the device's type alone: nothing is allocated, so it can be called for a device this machine lacks.

    Example:
        >>> import torch
        >>> require_float64(torch.device("cpu"))  # CPU and CUDA have float64: nothing happens
        >>> try:
        ...     require_float64(torch.device("mps", 0))  # no Mac needed: decided by the type
        ... except RuntimeError as error:
        ...     print(str(error).split(": ")[0])
        lightning-accum needs float64 on the training device, and device 'mps:0' (Apple's MPS) has none
    """
    device = torch.device(device)
    kind = WITHOUT_FLOAT64.get(device.type)
    if kind is None:
        return
    raise RuntimeError(
        f"lightning-accum needs float64 on the training device, and device {str(device)!r} ({kind}) has none: a group's"
        " sums, the evaluation's weighted mean and the ledger's values are kept in float64 on the loss's device. Train"
        ' on the CPU (`accelerator="cpu"` in `L.Trainer(...)` or `L.Fabric(...)`) or on a CUDA GPU; supported'
        " accelerators are listed in the README (Supported accelerators)."
    )
