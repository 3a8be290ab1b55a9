"""An orderly end of the process group in a worker the package's spawn/fork launcher started (troubleshooting.md)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed

__all__ = ["ClosingWorkers", "close_process_group", "launcher_configuration"]


def close_process_group(strategy: Any) -> bool:
    """``strategy``'s barrier, ``destroy_process_group()`` and a collection; whether a process group was destroyed."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    strategy.barrier("lightning_accum.close_process_group")
    torch.distributed.destroy_process_group()
    gc.collect()
    return True


class ClosingWorkers:
    """The base of the package's spawn/fork launchers: each worker closes its process group once its work returned."""

    _strategy: Any

    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
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
