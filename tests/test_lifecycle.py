"""lightning_accum.core.lifecycle: one owner of the group's lifecycle, its states read at both doors, and one end."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import params_vector, sgd_reference
from test_fabric import EXAMPLES, LR, TinyNet, _groups, _model_and_optimizer, micro_batches, train

from lightning_accum.core.lifecycle import GroupState

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
    assert (group.handed_out, group.closed, group.loaded, group.carried, group.reopen_later) == (None,) * 5
