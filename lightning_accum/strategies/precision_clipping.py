"""The Trainer's clipping, set on the precision plugin for a run (Lightning has no strategy hook for it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer

from lightning_accum.core.adapter import EngineAdapter
from lightning_accum.patching import InstancePatch

__all__ = ["PrecisionClipping"]


class PrecisionClipping:
    """The plugin's ``clip_gradients`` refused inside a manual loop's open group, and its clipping by norm and by value
    the engine adapter's (a plugin clipping its own way keeps it)."""

    def __init__(self) -> None:
        self._patches: list[InstancePatch] = []

    def install(self, plugin: Precision, adapter: EngineAdapter, refuse: Callable[[str], None] | None) -> None:
        """Set the methods on ``plugin`` for the run; ``refuse(call)`` raises inside an open group."""
        self._patches = []
        if refuse is not None:

            def guard(below: Callable[..., Any], optimizer: Optimizer, *args: Any, **kwargs: Any) -> Any:
                refuse("self.clip_gradients(optimizer, ...)")
                return below(optimizer, *args, **kwargs)

            self._patches.append(InstancePatch(plugin, "clip_gradients", guard))
        for name, clip in (("clip_grad_by_norm", adapter.clip_norm), ("clip_grad_by_value", adapter.clip_value)):
            if getattr(type(plugin), name) is getattr(Precision, name) and name not in vars(plugin):

                def through(optimizer: Optimizer, clip_val: float, clip: Callable[..., Any] = clip) -> None:
                    clip(plugin.main_params(optimizer), clip_val)

                self._patches.append(InstancePatch(plugin, name, through, wraps=False))

    def release(self) -> None:
        """Give the plugin back what it held."""
        for patch in self._patches:
            patch.release()
        self._patches = []
