"""An orderly end of the process group in a worker that the package's spawn/fork launcher started (issue 23).

With gloo, Lightning leaves the default process group to the interpreter's exit, where a native thread of the group
that needs the GIL is ended with ``pthread_exit`` and the worker aborts (SIGABRT) although the fit completed: an
upstream problem, explained with its references in docs/troubleshooting.md ("A crash after a finished run").
:func:`close_process_group` removes that window: once the worker's function has returned, every rank meets at a
barrier, the group is destroyed and unreferenced objects are collected, while the interpreter is fully alive.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
import torch.distributed

__all__ = ["ClosingWorkers", "close_process_group", "use_launcher"]


def close_process_group(strategy: Any) -> bool:
    """Barrier, ``destroy_process_group()`` and a garbage collection, if a default process group exists.

    Called in a spawned or forked worker after Lightning's work in it is done (the worker exits next), on every
    rank and only on the success path: a rank that raised never gets here, and the main process then terminates
    the others. The group's threads are joined when its last reference goes (the DDP wrapper is already unwrapped
    by Lightning's teardown; the collection frees reference cycles).

    Args:
        strategy: The Lightning strategy whose ``barrier`` to use (it passes the device ids NCCL needs).

    Returns:
        Whether a process group was destroyed.

    Example:
        >>> from lightning.pytorch.strategies import DDPStrategy
        >>> close_process_group(DDPStrategy())  # no process group in this process: nothing to do
        False
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    strategy.barrier("lightning_accum.close_process_group")
    torch.distributed.destroy_process_group()
    gc.collect()
    return True


class ClosingWorkers:
    """The one base of the package's spawn/fork launchers, the Trainer's and Fabric's (listed first, before the
    framework's ``_MultiProcessingLauncher``): each worker closes its process group once the launched function has
    returned (:func:`close_process_group`)."""

    _strategy: Any

    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        super()._wrapping_function(*args, **kwargs)  # type: ignore[misc]  # the framework's launcher, after this base
        close_process_group(self._strategy)


def use_launcher(strategy: Any, replaced: type, launcher: type) -> None:
    """Put ``launcher`` in place of the framework's ``replaced`` spawn/fork launcher that ``strategy`` configured
    (``_configure_launcher``; a ``popen`` launch re-runs the script and keeps the framework's)."""
    if isinstance(strategy._launcher, replaced) and strategy._start_method != "popen":
        strategy._launcher = launcher(strategy, start_method=strategy._start_method)
