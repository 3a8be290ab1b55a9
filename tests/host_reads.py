"""Instruments of the tests (and the benchmarks): host reads of tensor data made by this package.

On a GPU a host read of device memory (``.item()``, ``bool(t)``, ``.tolist()``, ``.cpu()``) waits for the
device: the per-micro-batch path must make none. On the CPU there is nothing to wait for, so the probe
records the *calls* instead, attributed to this package's code, which is what would synchronize on a GPU.
"""

from __future__ import annotations

import sys
from typing import Any, ClassVar

import lightning as L
import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostReadProbe", "MicroBatchSyncCounter"]


class HostReadProbe(TorchDispatchMode):
    """Records host reads of tensor data issued from ``lightning_accum`` code while active.

    Two probes: ``aten._local_scalar_dense`` (what ``.item()``, ``bool(t)``, ``int(t)``, ``float(t)``
    dispatch to) and, through ``sys.setprofile``, calls of the tensor methods that copy to the host
    without dispatching (``tolist``, ``cpu``, ``numpy``). ``package_ops`` counts every tensor operation the
    package issued while watching, to show the probe saw the package at work.
    """

    HOST_READS: ClassVar[set[str]] = {"tolist", "cpu", "numpy"}

    def __init__(self) -> None:
        super().__init__()
        self.hits: list[str] = []
        self.package_ops = 0

    @staticmethod
    def _caller_in_package(frame: Any) -> str | None:
        while frame is not None:
            name = frame.f_globals.get("__name__", "")
            if not name.startswith("torch"):
                if name.startswith("lightning_accum"):
                    return f"{name}:{frame.f_lineno}"
                return None
            frame = frame.f_back
        return None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        where = self._caller_in_package(sys._getframe(1))
        if where:
            self.package_ops += 1
            if func is torch.ops.aten._local_scalar_dense.default:
                self.hits.append(f"{func} at {where}")
        return func(*args, **(kwargs or {}))

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "c_call" and getattr(arg, "__name__", "") in self.HOST_READS:
            where = self._caller_in_package(frame)
            if where:
                self.hits.append(f"{arg.__name__} at {where}")

    def __enter__(self) -> HostReadProbe:
        super().__enter__()
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.setprofile(None)
        super().__exit__(*exc)


class MicroBatchSyncCounter(L.Callback):
    """Counts the package's host reads in non-final micro-batches and in group-closing ones, separately: a micro-batch
    closes its group where Lightning's loop says its group ends (the strategy's group boundaries, where groups vary),
    or at the epoch's last batch."""

    def __init__(self) -> None:
        self.non_final = HostReadProbe()
        self.final = HostReadProbe()
        self.non_final_batches = 0
        self.final_batches = 0
        self._active: HostReadProbe | None = None

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._active = HostReadProbe().__enter__()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._active is None:
            return
        self._active.__exit__(None, None, None)
        last = batch_idx + 1 == trainer.num_training_batches
        if trainer.fit_loop.epoch_loop._accumulated_batches_reached() or last:
            self.final_batches += 1
            probe = self.final
        else:
            self.non_final_batches += 1
            probe = self.non_final
        probe.hits += self._active.hits
        probe.package_ops += self._active.package_ops
        self._active = None
