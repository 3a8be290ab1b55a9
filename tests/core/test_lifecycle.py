"""lightning_accum.core.lifecycle: one owner of the group's lifecycle, its states read at both doors, and one end."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from helpers import (
    CheckpointAt,
    EvalLM,
    ListDataset,
    ResumableLoader,
    make_examples,
    make_trainer,
    params_vector,
    random_lengths,
    sgd_reference,
)
from test_fabric import EXAMPLES, LR, TinyNet, _groups, _model_and_optimizer, micro_batches, train
from torch.utils.data import DataLoader

from lightning_accum.core.lifecycle import GroupState
from lightning_accum.ledger import COUNTERS

M, A = 2, 4  # micro-batches of 2 examples, groups of 4


def _fabric() -> L.Fabric:
    return L.Fabric(strategy="accum", accelerator="cpu")


def _state(fabric: L.Fabric) -> GroupState:
    return fabric.strategy._core.group.state  # type: ignore[attr-defined,no-any-return]


def _saved(tmp_path: Path, stop: int) -> Path:
    path = tmp_path / f"after-{stop}.ckpt"
    fabric = _fabric()
    model, optimizer = fabric.setup(*_model_and_optimizer())
    train(fabric, model, optimizer, micro_batches(EXAMPLES, M), A, stop=stop)
    fabric.save(path, {"model": model, "optimizer": optimizer})
    return path


def test_a_groups_states_through_a_loop() -> None:
    fabric = _fabric()
    model, optimizer = fabric.setup(*_model_and_optimizer())
    assert _state(fabric) is GroupState.IDLE and not fabric.strategy.group_open
    batches = micro_batches(EXAMPLES, M)
    for batch in batches[:2]:
        fabric.backward(fabric.strategy.accumulate(*_loss(model, batch)))
    assert _state(fabric) is GroupState.OPEN and fabric.strategy.group_open
    fabric.strategy.close_group(optimizer)
    assert _state(fabric) is GroupState.CLOSED and not fabric.strategy.group_open
    optimizer.step()
    optimizer.zero_grad()
    assert _state(fabric) is GroupState.IDLE


def _loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(batch["input_ids"])
    labels = batch["labels"]
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    return loss, (labels != -100).sum()


def test_a_loaded_group_waits_then_is_reopened_then_installed(tmp_path: Path) -> None:
    path = _saved(tmp_path, stop=6)  # 2 of the second group's 4 micro-batches
    fabric = _fabric()
    model = fabric.setup_module(TinyNet().double())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    fabric.load(path, {"model": model, "optimizer": optimizer})
    assert _state(fabric) is GroupState.LOADED and fabric.strategy.group_open  # waits for its optimizer
    optimizer = fabric.setup_optimizers(optimizer)
    fabric.strategy._core.reopen_deferred()  # what the next accumulate, backward, close or save does first
    assert _state(fabric) is GroupState.REOPENED and fabric.strategy.group_open
    train(fabric, model, optimizer, micro_batches(EXAMPLES, M), A, start=6)
    assert _state(fabric) is GroupState.IDLE
    reference = sgd_reference(TinyNet(), _groups(EXAMPLES, 8), lr=LR)
    torch.testing.assert_close(params_vector(model), reference, rtol=0, atol=1e-12)


@pytest.mark.parametrize("times", [1, 2])
def test_a_checkpoint_written_between_groups_opens_no_group_and_loads_again(tmp_path: Path, times: int) -> None:
    # Before: loading it before `setup_optimizers` left `group_open` True with no group open (the deferred reopen was
    # taken for a group), and a second load of the same file was then refused as a load into an open group.
    path = _saved(tmp_path, stop=4)  # after the first group's close and step
    fabric = _fabric()
    model = fabric.setup_module(TinyNet().double())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(times):
        fabric.load(path, {"model": model, "optimizer": optimizer})
        assert not fabric.strategy.group_open
    optimizer = fabric.setup_optimizers(optimizer)
    train(fabric, model, optimizer, micro_batches(EXAMPLES, M), A, start=4)
    reference = sgd_reference(TinyNet(), _groups(EXAMPLES, 8), lr=LR)
    torch.testing.assert_close(params_vector(model), reference, rtol=0, atol=1e-12)


def test_teardown_ends_the_group_in_one_place(tmp_path: Path) -> None:
    fabric = _fabric()
    model, optimizer = fabric.setup(*_model_and_optimizer())
    train(fabric, model, optimizer, micro_batches(EXAMPLES, M), A, stop=2)
    assert _state(fabric) is GroupState.OPEN
    fabric.strategy.teardown()
    group = fabric.strategy._core.group  # type: ignore[attr-defined]
    assert group.state is GroupState.IDLE and fabric.strategy.engine.microbatches_in_group == 0
    assert (group.handed_out, group.closed, group.loaded, group.written, group.deferred, group.carried) == (None,) * 6


# ------------------------------------------------------------ state scoped to the entry point
# State scoped to the entry point that made it: a checkpoint's ledger and open group reach only the `fit` resuming
# from it (`validate` / `test` / `predict(ckpt_path=...)` restore the weights, as Lightning does), and a group a fit
# left open ends with that fit.

SCOPE_EXAMPLES = make_examples(random_lengths(16, seed=55), seed=55)  # 8 micro-batches of 2
SCOPE_A = 3
# The module evaluates (for `validate` / `test`); the fits here have no validation loader.
NO_VAL_LOADER = pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`")


def _loader() -> ResumableLoader:
    return ResumableLoader(ListDataset(SCOPE_EXAMPLES), batch_size=2)


class _Evaluates(EvalLM):
    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        return self(batch["input_ids"])


def _counters(trainer: Any) -> dict[str, Any]:
    ledger = trainer.strategy.ledger
    return {name: getattr(ledger, name) for name in COUNTERS}


@NO_VAL_LOADER
@pytest.mark.parametrize("entry", ["validate", "test", "predict"])
def test_an_evaluation_from_a_mid_group_checkpoint_leaves_the_next_fit_fresh(tmp_path: Path, entry: str) -> None:
    checkpoint = tmp_path / "at.ckpt"  # written after micro-batch 4, inside the group 3, 4, 5
    make_trainer(accumulate_grad_batches=SCOPE_A, callbacks=[CheckpointAt(checkpoint, at=4)]).fit(EvalLM(), _loader())
    assert torch.load(checkpoint, weights_only=True)["lightning_accum"]["open_group"]["microbatches"] == 2

    model = _Evaluates(seed=1)
    trainer = make_trainer(accumulate_grad_batches=SCOPE_A)
    run = getattr(trainer, entry)
    loader = DataLoader(ListDataset(SCOPE_EXAMPLES), batch_size=4)
    run(model, loader, ckpt_path=checkpoint)
    assert _counters(trainer) == _counters(make_trainer())  # the checkpoint's ledger was not restored
    trainer.fit(model, _loader())

    fresh = _Evaluates(seed=1)
    fresh.load_state_dict(torch.load(checkpoint, weights_only=True)["state_dict"])  # what `entry` restored
    fresh_trainer = make_trainer(accumulate_grad_batches=SCOPE_A)
    fresh_trainer.fit(fresh, _loader())
    # Before: the fit reopened the checkpoint's group (ledger 62 tokens / 22 micro-batches / 5 updates against 46 /
    # 16 / 4 in the repro; parameters 0.037 apart).
    assert _counters(trainer) == _counters(fresh_trainer)
    assert torch.equal(params_vector(model), params_vector(fresh))


class _FailsAt(EvalLM):
    def __init__(self, at: int | None) -> None:
        super().__init__()
        self.at = at

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if batch_idx == self.at:
            raise RuntimeError("planted failure inside a group")
        return super().training_step(batch, batch_idx)


class _StopsAt(EvalLM):
    """Asks the Trainer to stop after micro-batch `at` (Lightning then ends the fit there, inside a group)."""

    def __init__(self, at: int | None) -> None:
        super().__init__()
        self.at = at

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.at:
            self.trainer.should_stop = True


@NO_VAL_LOADER
@pytest.mark.parametrize("how", ["exception", "stop"])
def test_a_group_a_fit_left_open_ends_with_that_fit_and_says_why(how: str) -> None:
    model: EvalLM = _FailsAt(at=4) if how == "exception" else _StopsAt(at=3)  # inside the group 3, 4, 5
    trainer = make_trainer(accumulate_grad_batches=SCOPE_A, max_epochs=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if how == "exception":
            with pytest.raises(RuntimeError, match="planted failure inside a group"):  # the user's error, on top
                trainer.fit(model, _loader())
        else:
            trainer.fit(model, _loader())
    stopped = [str(w.message) for w in caught if "stopped inside an accumulation group" in str(w.message)]
    # After an exception the exception says why (no warning that `-W error` would raise in its place).
    assert len(stopped) == (0 if how == "exception" else 1)
    if stopped:
        assert "its 1 micro-batch(es)" in stopped[0]
    assert trainer.strategy.engine.microbatches_in_group == 0  # type: ignore[attr-defined]
    assert trainer.strategy.ledger.microbatches == 3  # type: ignore[attr-defined]  # the first group only
    model.at = None  # type: ignore[attr-defined]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, _loader())
    # The second fit is not taken for one whose loader yielded fewer batches than its length announced.
    assert not [w for w in caught if "loader ended" in str(w.message) or "stopped inside" in str(w.message)]
