"""lightning_accum.strategies.run: what each Trainer entry point sets up on the strategy's parts, and ends with it."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from helpers import ListDataset, TinyLM, fit, make_examples, make_trainer
from torch.utils.data import DataLoader

from lightning_accum import AccumulationStrategy

_BOUND = {"clip_grad_by_norm", "clip_grad_by_value"}  # what the run sets on the precision plugin instance


class _AccumulatesItself(AccumulationStrategy):
    @property
    def handles_gradient_accumulation(self) -> bool:
        return True


def test_a_strategy_that_accumulates_itself_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match=r"handles gradient accumulation itself .*strategy='accum' or 'accum_ddp'"):
        fit(TinyLM(), make_examples([3, 4]), batch_size=1, accumulate=2, strategy=_AccumulatesItself())


class _Seen(L.Callback):
    """What the run bound, seen from inside each entry point's loop."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, bool, bool]] = []

    def _note(self, trainer: L.Trainer, stage: str) -> None:
        strategy: Any = trainer.strategy
        bound = _BOUND <= set(vars(strategy.precision_plugin))
        self.seen.append((stage, strategy._run.trainer is trainer, bound))

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._note(trainer, "fit")

    def on_validation_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._note(trainer, "validate")


class _FailsIn(TinyLM):
    def __init__(self) -> None:
        super().__init__()
        self.fail = False

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        if self.fail:
            raise RuntimeError("planted failure in validate")
        return super().validation_step(batch, batch_idx)


def test_each_entry_point_binds_the_run_at_setup_and_ends_it_at_teardown_after_an_exception_too() -> None:
    loader = DataLoader(ListDataset(make_examples([3, 4, 5, 6])), batch_size=2)
    seen, model = _Seen(), _FailsIn()
    trainer = make_trainer(accumulate_grad_batches=2, callbacks=[seen], limit_val_batches=1)
    strategy: Any = trainer.strategy
    trainer.fit(model, loader, loader)
    ended = (strategy._run.trainer, _BOUND & set(vars(strategy.precision_plugin)), strategy.group_open)
    assert ended == (None, set(), False)
    model.fail = True
    with pytest.raises(RuntimeError, match="planted failure in validate"):
        trainer.validate(model, loader)
    assert strategy._run.trainer is None and not _BOUND & set(vars(strategy.precision_plugin))
    assert not strategy._run.failed  # the next entry point starts as a fresh one would
    # Inside each loop: the Trainer read by the hooks of every micro-batch, and the plugin's clipping, bound.
    assert {stage for stage, _, _ in seen.seen} == {"fit", "validate"}
    assert all(own and bound for _, own, bound in seen.seen), seen.seen
    assert strategy.ledger.updates_applied == 1 and torch.isfinite(model.head.weight).all()
