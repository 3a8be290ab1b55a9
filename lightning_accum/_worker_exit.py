"""A worker of the package's spawn/fork launchers: modules of its own, its process group closed (troubleshooting.md)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed
from torch import nn

__all__ = ["ClosingWorkers", "close_process_group", "launcher_configuration", "unshare"]


def close_process_group(strategy: Any) -> bool:
    """``strategy``'s barrier, ``destroy_process_group()`` and a collection; whether a process group was destroyed."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    strategy.barrier("lightning_accum.close_process_group")
    torch.distributed.destroy_process_group()
    gc.collect()
    return True


def unshare(data: Any) -> None:
    """Copies into this process's memory the shared CPU parameters and buffers of the modules in ``data`` (nested)."""
    if isinstance(data, nn.Module):
        for tensor in [*data.parameters(), *data.buffers()]:
            if tensor.device.type == "cpu" and tensor.is_shared():
                tensor.data = tensor.data.clone()
    elif isinstance(data, (tuple, list, dict)):
        for item in data.values() if isinstance(data, dict) else data:
            unshare(item)


class ClosingWorkers:
    """The base of the package's spawn/fork launchers: each worker unshares the modules it was sent (the framework does
    it under ``"spawn"`` only) and closes its process group once its work returned."""

    _strategy: Any

    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        if self._strategy._start_method == "forkserver" and self._strategy.parallel_devices[0].type == "cpu":
            unshare(args)  # the launched function's arguments, pickled into shared memory: one storage for all workers
        super()._wrapping_function(*args, **kwargs)  # type: ignore[misc]  # the framework's launcher, after this base
        close_process_group(self._strategy)


def launcher_configuration(framework: Any, replaced: type, launcher: type) -> Callable[[Any], None]:
    """The ``_configure_launcher`` of a strategy over ``framework`` (Lightning's or Fabric's ``DDPStrategy``, both
    doors): ``framework``'s, then ``launcher`` in place of the ``replaced`` spawn/fork launcher it configured."""

    def _configure_launcher(strategy: Any) -> None:
        framework._configure_launcher(strategy)
        if isinstance(strategy._launcher, replaced) and strategy._start_method != "popen":
            strategy._launcher = launcher(strategy, start_method=strategy._start_method)

    return _configure_launcher
