"""Step-interval schedulers under an accumulation strategy: the user's own object reaches the module's hook,
at Lightning's place in the loop, once per applied update (per attempt under schedule_on="attempted")."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from helpers import TinyLM, fit, make_examples
from torch.optim.lr_scheduler import StepLR

from lightning_accum import AccumulationStrategy

A = 2


class HookLM(TinyLM):
    """A StepLR stepped by an `lr_scheduler_step` override that checks the scheduler's type; optionally a NaN loss
    in one group (skipped without a GradScaler) and the rate read right after `optimizer.step` in its own hook."""

    def __init__(self, bad_group: int | None = None, frequency: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.bad_group, self.frequency = bad_group, frequency
        self.hook_types: list[type] = []
        self.lr_after_step: list[float] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        if self.bad_group is not None and batch_idx // A == self.bad_group:
            out["loss"] = out["loss"] * float("nan")
        return out

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=1.0)
        scheduler = StepLR(optimizer, step_size=1, gamma=0.5)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": self.frequency},
        }

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        self.hook_types.append(type(scheduler))
        if isinstance(scheduler, StepLR):  # an override written for plain Lightning
            scheduler.step()

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        optimizer.step(closure=optimizer_closure)
        self.lr_after_step.append(optimizer.param_groups[0]["lr"])


def _lr(trainer: L.Trainer) -> float:
    return float(trainer.optimizers[0].param_groups[0]["lr"])


@pytest.mark.parametrize("schedule_on", ["applied", "attempted"])
def test_the_hook_gets_the_users_scheduler_and_the_rate_follows_updates_as_in_lightning(schedule_on: str) -> None:
    examples = make_examples([3, 5, 2, 6, 4, 4, 1, 5])  # 4 groups of A = 2
    model = HookLM()
    trainer = fit(model, examples, 1, A, strategy=AccumulationStrategy(schedule_on=schedule_on))
    plain = HookLM()
    plain_trainer = fit(plain, examples, 1, A, strategy="auto")

    assert _lr(plain_trainer) == 0.0625 == _lr(trainer)  # four updates halve the rate four times
    assert model.hook_types == [StepLR] * 4 == plain.hook_types  # once per update, the user's own object
    assert type(trainer.lr_scheduler_configs[0].scheduler) is StepLR
    # The scheduler advances where Lightning advances it: after the module's `optimizer_step` hook has returned.
    assert model.lr_after_step == plain.lr_after_step == [1.0, 0.5, 0.25, 0.125]


@pytest.mark.parametrize(("schedule_on", "advances"), [("applied", 3), ("attempted", 4)])
def test_a_skipped_update_does_not_reach_the_hook_unless_attempts_count(schedule_on: str, advances: int) -> None:
    examples = make_examples([3, 5, 2, 6, 4, 4, 1, 5])
    model = HookLM(bad_group=1)
    with pytest.warns(UserWarning, match="skipped update 2: its gradient is not finite"):
        trainer = fit(model, examples, 1, A, strategy=AccumulationStrategy(schedule_on=schedule_on))
    assert trainer.strategy.ledger.updates_skipped["nonfinite"] == 1  # type: ignore[attr-defined]
    assert _lr(trainer) == 0.5**advances
    assert model.hook_types == [StepLR] * advances


def test_frequency_counts_updates_and_the_module_and_config_are_left_as_given() -> None:
    examples = make_examples([3] * 12)  # 6 groups: the rate halves on updates 3 and 6
    model = HookLM(frequency=3)
    trainer = fit(model, examples, 1, A)
    assert _lr(trainer) == 0.25 and model.hook_types == [StepLR] * 2
    assert trainer.lr_scheduler_configs[0].frequency == 3
    assert "lr_scheduler_step" not in vars(model)  # the gate on the hook is removed when training ends


def test_a_direct_step_by_user_code_is_not_silenced() -> None:
    class StepsItself(HookLM):
        def on_train_end(self) -> None:
            self.lr_schedulers().step()  # type: ignore[union-attr]

    model = StepsItself()
    trainer = fit(model, make_examples([3, 5]), 1, A)
    assert _lr(trainer) == 0.25  # one update, one direct step
