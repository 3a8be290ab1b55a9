"""strategies/automatic: the group closed inside the optimizer's step, with Lightning's hook order and closure rules."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import TinyLM, fit, make_examples, params_vector

import lightning_accum  # noqa: F401  (registers the strategy strings)


class _Recorder(TinyLM):
    """Records the order of hooks, closure evaluations and the optimizer's step."""

    def __init__(self, optimizer: str = "sgd", **kwargs: Any) -> None:
        super().__init__(optimizer=optimizer, **kwargs)
        self.events: list[str] = []
        self.steps = 0

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        self.events.append("training_step")
        self.steps += 1
        return super().training_step(batch, batch_idx)

    def on_before_zero_grad(self, optimizer: Any) -> None:
        self.events.append("zero_grad")

    def on_after_backward(self) -> None:
        self.events.append("backward")

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.events.append("before_optimizer_step")

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "lbfgs":
            optimizer: torch.optim.Optimizer = torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=5)
        else:
            optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        optimizer.register_step_pre_hook(lambda *_: self.events.append("step_start"))
        optimizer.register_step_post_hook(lambda *_: self.events.append("step_end"))
        return optimizer


def test_hook_order_is_lightnings() -> None:
    examples = make_examples([3, 4, 5, 2])
    orders = []
    for strategy in ("auto", "accum"):
        model = _Recorder()
        fit(model, examples, batch_size=1, accumulate=2, strategy=strategy)
        orders.append(model.events)
    assert orders[0] == orders[1]
    # The optimizer evaluates the closure inside its step: the group's last training_step runs after step_start.
    assert orders[1][:6] == ["training_step", "zero_grad", "backward", "step_start", "training_step", "backward"]


def test_lbfgs_at_one_micro_batch_per_update_evaluates_the_closure_as_in_lightning() -> None:
    examples = make_examples([3, 4, 5, 2], seed=3)
    runs = {}
    for strategy in ("auto", "accum"):
        model = _Recorder(optimizer="lbfgs")
        trainer = fit(model, examples, batch_size=2, accumulate=1, strategy=strategy)
        runs[strategy] = (model, trainer)
    (plain, _), (ours, trainer) = runs["auto"], runs["accum"]
    assert ours.steps == plain.steps > 2 * 2  # many evaluations per update, not one
    torch.testing.assert_close(params_vector(ours), params_vector(plain), rtol=1e-6, atol=1e-7)
    ledger = trainer.strategy.ledger
    assert (ledger.updates_applied, ledger.microbatches, ledger.samples) == (2, 2, 4)  # re-evaluations not counted


def test_lbfgs_with_accumulation_is_an_error_at_fit_start() -> None:
    model = _Recorder(optimizer="lbfgs")
    with pytest.raises(ValueError, match=r"`LBFGS` evaluates the training closure several times.*accumulate_grad_bat"):
        fit(model, make_examples([3, 4]), batch_size=1, accumulate=2)
    assert model.steps == 0


class _EvaluatesTwice(torch.optim.SGD):
    """A first-order optimizer that evaluates the closure twice per step (like SAM)."""

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        closure()
        return super().step(closure)


class _IgnoresClosure(torch.optim.SGD):
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        return super().step()


class _WithOptimizer(TinyLM):
    def __init__(self, cls: type[torch.optim.Optimizer]) -> None:
        super().__init__()
        self.cls = cls

    def configure_optimizers(self) -> Any:
        return self.cls(self.parameters(), lr=0.1)


def test_an_optimizer_that_reevaluates_the_closure_while_accumulating_is_named() -> None:
    with pytest.raises(RuntimeError, match=r"`_EvaluatesTwice` evaluates the training closure several times"):
        fit(_WithOptimizer(_EvaluatesTwice), make_examples([3, 4]), batch_size=1, accumulate=2)


def test_an_optimizer_that_ignores_the_closure_gets_lightnings_error() -> None:
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    for strategy in ("auto", "accum"):
        with pytest.raises(MisconfigurationException, match=r"The closure hasn't been executed"):
            fit(_WithOptimizer(_IgnoresClosure), make_examples([3, 4]), batch_size=1, accumulate=2, strategy=strategy)
