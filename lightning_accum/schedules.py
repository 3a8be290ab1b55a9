"""Step-interval LR schedules that advance on updates (applied or attempted), not on Lightning's batch index."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.rank_zero import rank_zero_info

from lightning_accum.axis_lr import AxisLR
from lightning_accum.patching import InstancePatch

if TYPE_CHECKING:
    from lightning.pytorch.utilities.types import LRSchedulerConfig

    from lightning_accum.engine import AccumulationEngine

__all__ = ["UpdateSchedules", "bind_schedulers"]


class UpdateSchedules:
    """The step-interval schedulers of a fit, advanced when the strategy marks them due after an update.

    Args:
        module: The LightningModule whose ``lr_scheduler_step`` hook Lightning calls.
        configs: Lightning's scheduler configs; the ``interval="step"`` ones but ``ReduceLROnPlateau`` are taken over.

    Example:
        >>> import torch, lightning as L
        >>> from lightning.pytorch.utilities.types import LRSchedulerConfig
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        >>> module = L.LightningModule()
        >>> schedules = UpdateSchedules(module, [LRSchedulerConfig(sched, interval="step")])
        >>> module.lr_scheduler_step(sched, None); opt.param_groups[0]["lr"]  # Lightning's call, not due: nothing
        1.0
        >>> schedules.mark_due(lambda frequency: True)
        >>> opt.step(); module.lr_scheduler_step(sched, None); opt.param_groups[0]["lr"]  # due: the user's hook
        0.5
    """

    def __init__(self, module: Any, configs: list[LRSchedulerConfig]) -> None:
        self.module = module
        self.configs = [c for c in configs if c.interval == "step" and not c.reduce_on_plateau]
        #: The frequency each taken-over config was given (counted on updates by the strategy).
        self.frequencies = {id(c): int(c.frequency) for c in self.configs}
        self._due: set[int] = set()  # ids of schedulers whose next hook call from Lightning goes through
        self._gate: InstancePatch | None = None
        if not self.configs:
            return
        taken = {id(c.scheduler) for c in self.configs}

        def lr_scheduler_step(original: Callable[..., Any], scheduler: Any, metric: Any = None) -> None:
            key = id(scheduler)
            if key not in taken:
                original(scheduler, metric)  # an epoch-interval or plateau scheduler: Lightning's own call
            elif key in self._due:
                self._due.discard(key)
                original(scheduler, metric)

        for config in self.configs:
            config.frequency = 1  # Lightning asks after every group; the strategy counts the frequency on updates
        self._gate = InstancePatch(module, "lr_scheduler_step", lr_scheduler_step)

    def mark_due(self, is_due: Callable[[int], bool]) -> None:
        """Let Lightning's next call of the hook through for every scheduler for which ``is_due(frequency)``."""
        for config in self.configs:
            if is_due(self.frequencies[id(config)]):
                self._due.add(id(config.scheduler))

    def release(self) -> None:
        """Remove the gate from the module and give the configs their frequencies back."""
        for config in self.configs:
            config.frequency = self.frequencies[id(config)]
        self._due.clear()
        if self._gate is not None:
            self._gate.release()
            self._gate = None
        self.configs = []


def bind_schedulers(configs: Sequence[LRSchedulerConfig], engine: AccumulationEngine) -> None:
    """Bind every :class:`AxisLR` of ``configs`` to ``engine`` and make its config advance once per update."""
    for config in configs:
        scheduler = config.scheduler
        if not isinstance(scheduler, AxisLR):
            continue
        scheduler.bind(engine)
        if config.interval != "step" or config.frequency != 1:
            rank_zero_info(
                f"lightning_accum: AxisLR advances once per update; its config said interval={config.interval!r},"
                f" frequency={config.frequency}."
            )
            config.interval, config.frequency = "step", 1
