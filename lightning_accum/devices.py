"""Which devices exact accumulation runs on: those with float64 (docs/concepts.md, "Supported accelerators")."""

from __future__ import annotations

import torch

__all__ = ["WITHOUT_FLOAT64", "require_float64"]

#: Device types (``torch.device.type``) that have no ``float64``, with what they are, for the message.
WITHOUT_FLOAT64: dict[str, str] = {"mps": "Apple's MPS"}


def require_float64(device: torch.device | str) -> None:
    """Raise a ``RuntimeError`` when ``device``'s type has no ``float64`` (nothing is allocated).

    Example:
        >>> import torch
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
