"""`fabric.load` does what Fabric's API says: a weights-only load restores weights only (the checkpoint's open group
and ledger stay in the file, one info line says so), a load with the optimizer resumes the group exactly, also
before `setup_optimizers` (FSDP2's order) or into objects not yet set up, a load into an open group is refused, and
`fabric.strategy.group_open` tells whether a group is open, a carried one included."""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import params_vector, sgd_reference
from test_fabric import EXAMPLES, LR, TinyNet, _groups, _model_and_optimizer, micro_batches, train

M, A, STOP = 2, 4, 6  # micro-batches of 2 examples, groups of 4: saved after 2 of the second group's 4


def _fabric() -> L.Fabric:
    return L.Fabric(strategy="accum", accelerator="cpu")


@pytest.fixture
def mid_group(tmp_path: Path) -> Path:
    """A checkpoint written inside the second group (2 of its 4 micro-batches), with the model and the optimizer."""
    path = tmp_path / "mid.ckpt"
    fabric = _fabric()
    model, optimizer = fabric.setup(*_model_and_optimizer())
    train(fabric, model, optimizer, micro_batches(EXAMPLES, M), A, stop=STOP)
    assert fabric.strategy.group_open  # 2 micro-batches reported since the last close
    fabric.save(path, {"model": model, "optimizer": optimizer})
    return path


def test_a_weights_only_load_restores_the_weights_alone(mid_group: Path, caplog: pytest.LogCaptureFixture) -> None:
    fabric = _fabric()
    model, optimizer = fabric.setup(*_model_and_optimizer(seed=99))  # a new loop with a new optimizer
    with caplog.at_level(logging.INFO):
        remainder = fabric.load(mid_group, {"model": model})
    assert "written inside an accumulation group (2 micro-batch(es) per replica)" in caplog.text
    assert "lightning_accum" in remainder  # left in the file's remainder, as plain Fabric returns what it did not load
    assert not fabric.strategy.group_open and fabric.strategy.ledger.microbatches == 0
    start = TinyNet().double()
    start.load_state_dict(torch.load(mid_group, weights_only=True)["model"])
    records = train(fabric, model, optimizer, micro_batches(EXAMPLES[:16], M), A)
    # Before: the old group's gradient and ledger joined the new run's first update (ledger 15 tokens / 5
    # micro-batches / 2 updates against 6 / 2 / 1 in the probe; the parameters 8.2e-2 off).
    assert [r.microbatches for r in records] == [4, 4]
    reference = sgd_reference(start, _groups(EXAMPLES[:16], 8), lr=LR)
    torch.testing.assert_close(params_vector(model), reference, rtol=0, atol=1e-12)
    assert fabric.strategy.ledger.updates_applied == 2 and fabric.strategy.ledger.samples == 16


@pytest.mark.parametrize("order", ["between setup_module and setup_optimizers", "before fabric.setup"])
def test_a_load_with_the_optimizer_before_it_is_set_up_resumes_the_group(mid_group: Path, order: str) -> None:
    fabric = _fabric()
    model, optimizer = _model_and_optimizer(seed=99)
    if order == "before fabric.setup":
        fabric.load(mid_group, {"model": model, "optimizer": optimizer})  # plain objects, as plain Fabric loads them
        model, optimizer = fabric.setup(model, optimizer)
    else:
        model = fabric.setup_module(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        fabric.load(mid_group, {"model": model, "optimizer": optimizer})
        optimizer = fabric.setup_optimizers(optimizer)
    assert fabric.strategy.group_open  # the carried group waits for its optimizer
    train(fabric, model, optimizer, micro_batches(EXAMPLES, M), A, start=STOP)
    # Before: the intact file was refused as "damaged" (its parameters were not known yet).
    reference = sgd_reference(TinyNet(), _groups(EXAMPLES, 8), lr=LR)
    torch.testing.assert_close(params_vector(model), reference, rtol=0, atol=1e-12)
    assert (fabric.strategy.ledger.updates_applied, fabric.strategy.ledger.samples) == (3, 24)


def test_group_open_reflects_a_carried_group_until_its_close(mid_group: Path) -> None:
    fabric = _fabric()
    model, optimizer = fabric.setup(*_model_and_optimizer(seed=99))
    fabric.load(mid_group, {"model": model, "optimizer": optimizer})
    # Before: `engine.microbatches_in_group` read 0 here, although the carried group was open.
    assert fabric.strategy.group_open
    train(fabric, model, optimizer, micro_batches(EXAMPLES, M), A, start=STOP, stop=STOP + 2)  # the group closes
    assert not fabric.strategy.group_open


def test_a_load_into_an_open_group_is_refused(mid_group: Path) -> None:
    fabric = _fabric()
    model, optimizer = fabric.setup(*_model_and_optimizer())
    train(fabric, model, optimizer, micro_batches(EXAMPLES, M), A, stop=1)
    with pytest.raises(RuntimeError, match=r"while an accumulation group is open in the running loop.*weights alone"):
        fabric.load(mid_group, {"model": model, "optimizer": optimizer})
    assert fabric.strategy.engine.microbatches_in_group == 1  # nothing replaced


def test_teardown_ends_what_a_loop_left_on_the_strategy(mid_group: Path) -> None:
    # Fabric never calls `Strategy.teardown` itself: `fabric.strategy.teardown()` is the documented end of a loop's
    # state on the strategy (its modules and optimizers, a pending or open group), so a second loop starts clean.
    fabric = _fabric()
    model, optimizer = fabric.setup(*_model_and_optimizer(seed=99))
    fabric.load(mid_group, {"model": model, "optimizer": optimizer})
    assert fabric.strategy.group_open
    fabric.strategy.teardown()
    assert not fabric.strategy.group_open
    assert fabric.strategy._modules == [] and fabric.strategy._optimizers == []  # nothing of the first loop held
    model, optimizer = fabric.setup(*_model_and_optimizer())
    train(fabric, model, optimizer, micro_batches(EXAMPLES[:16], M), A)
    reference = sgd_reference(TinyNet(), _groups(EXAMPLES[:16], 8), lr=LR)
    torch.testing.assert_close(params_vector(model), reference, rtol=0, atol=1e-12)


@pytest.fixture
def between_groups(tmp_path: Path) -> Path:
    """A checkpoint written after the first group's close and step (no group open)."""
    path = tmp_path / "between.ckpt"
    fabric = _fabric()
    model, optimizer = fabric.setup(*_model_and_optimizer())
    train(fabric, model, optimizer, micro_batches(EXAMPLES, M), A, stop=A)
    assert not fabric.strategy.group_open
    fabric.save(path, {"model": model, "optimizer": optimizer})
    return path


@pytest.mark.parametrize("written", ["mid_group", "between_groups"])
@pytest.mark.parametrize("order", ["after fabric.setup", "between setup_module and setup_optimizers"])
def test_the_same_file_loaded_twice_before_training_resumes_once(
    written: str, order: str, request: pytest.FixtureRequest
) -> None:
    # Before: the second load was refused ("would replace the group's micro-batches already reported", none were),
    # and a file written between groups left `group_open` True with no group open when loaded before
    # `setup_optimizers`.
    path, start = request.getfixturevalue(written), STOP if written == "mid_group" else A
    fabric = _fabric()
    model, optimizer = _model_and_optimizer(seed=99)
    if order == "after fabric.setup":
        model, optimizer = fabric.setup(model, optimizer)
    else:
        model = fabric.setup_module(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(2):
        fabric.load(path, {"model": model, "optimizer": optimizer})
        assert fabric.strategy.group_open == (written == "mid_group")
    if order != "after fabric.setup":
        optimizer = fabric.setup_optimizers(optimizer)
    train(fabric, model, optimizer, micro_batches(EXAMPLES, M), A, start=start)
    reference = sgd_reference(TinyNet(), _groups(EXAMPLES, 8), lr=LR)
    torch.testing.assert_close(params_vector(model), reference, rtol=0, atol=1e-12)
    assert (fabric.strategy.ledger.updates_applied, fabric.strategy.ledger.samples) == (3, 24)


def test_a_group_left_open_by_an_earlier_loop_is_named_at_the_next_setup() -> None:
    # Before: the second loop's close said its backward "also reached the parameters of another optimizer", the first
    # loop's, whose gradient was the group left open.
    fabric = _fabric()
    model, optimizer = fabric.setup(*_model_and_optimizer())
    train(fabric, model, optimizer, micro_batches(EXAMPLES, M), A, stop=2)  # the loop ends inside its first group
    with pytest.raises(RuntimeError, match=r"`fabric.setup_module` was called while an accumulation group holds 2"):
        fabric.setup(*_model_and_optimizer())
    fabric.strategy.teardown()  # the way out the error names
    model, optimizer = fabric.setup(*_model_and_optimizer())
    train(fabric, model, optimizer, micro_batches(EXAMPLES[:16], M), A)
    reference = sgd_reference(TinyNet(), _groups(EXAMPLES[:16], 8), lr=LR)
    torch.testing.assert_close(params_vector(model), reference, rtol=0, atol=1e-12)
