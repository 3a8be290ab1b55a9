"""Step-interval LR schedules that advance on updates (applied or attempted), not on Lightning's batch index.

Lightning steps a ``interval="step"`` scheduler after every batch that ends a group, whether the update
was applied or skipped by the GradScaler, and checks ``frequency`` against the batch index of the epoch.
The strategies take such schedulers over: Lightning's own calls become no-ops and the strategy advances
the scheduler (through the LightningModule's ``lr_scheduler_step`` hook) when
:meth:`~lightning_accum.engine.AccumulationEngine.schedule_due` says so.

The scheduler object itself is untouched: its ``state_dict`` is what goes into checkpoints, so they stay
loadable by plain Lightning, and the originals are put back when training ends.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.types import LRSchedulerConfig

__all__ = ["UpdateDrivenScheduler", "release_schedulers", "take_over_schedulers"]


class UpdateDrivenScheduler:
    """Stands in for a step-interval scheduler in Lightning's scheduler configs.

    ``step()`` is ignored unless called from :meth:`advance`; every other attribute (``optimizer``,
    ``get_last_lr``, ``state_dict``, ``load_state_dict``, ...) is the wrapped scheduler's.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        >>> inner = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        >>> proxy = UpdateDrivenScheduler(inner)
        >>> proxy.step(); opt.param_groups[0]["lr"]  # Lightning's call: ignored
        1.0
        >>> opt.step(); proxy.advance(lambda scheduler: scheduler.step()); opt.param_groups[0]["lr"]
        0.5
    """

    def __init__(self, scheduler: Any) -> None:
        self.__dict__["scheduler"] = scheduler
        self.__dict__["_armed"] = False

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self._armed:
            self.scheduler.step(*args, **kwargs)

    def advance(self, step_fn: Any) -> None:
        """Advance the wrapped scheduler once through ``step_fn(scheduler)`` (the module's hook)."""
        self.__dict__["_armed"] = True
        try:
            step_fn(self)
        finally:
            self.__dict__["_armed"] = False

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()  # type: ignore[no-any-return]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["scheduler"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.scheduler, name, value)


def take_over_schedulers(configs: list[LRSchedulerConfig]) -> list[LRSchedulerConfig]:
    """Wrap every step-interval, non-plateau scheduler of ``configs``; return the configs taken over."""
    taken = []
    for config in configs:
        if config.interval == "step" and not config.reduce_on_plateau:
            if not isinstance(config.scheduler, UpdateDrivenScheduler):
                config.scheduler = UpdateDrivenScheduler(config.scheduler)  # type: ignore[assignment]
            taken.append(config)
    return taken


def release_schedulers(configs: list[LRSchedulerConfig]) -> None:
    """Put the original schedulers back into ``configs``."""
    for config in configs:
        if isinstance(config.scheduler, UpdateDrivenScheduler):
            config.scheduler = config.scheduler.scheduler
