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

from lightning_accum.carry import Carried
from lightning_accum.core.lifecycle import LEAVES, Closed, GroupLifecycle, GroupState
from lightning_accum.engine import AccumulationEngine
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


@pytest.mark.parametrize("optimizers", ["set up first", "set up after the load"])
def test_a_save_right_after_a_mid_group_load_writes_the_group_as_read(tmp_path: Path, optimizers: str) -> None:
    # Before: the group was reopened (at once, or by the save itself when its optimizers were not set up yet) and then
    # written from the parameters' gradients, which did not hold its carried gradient yet: the run resumed from the
    # second file ended 0.024 off the uninterrupted one, said to "close exactly".
    path, again = _saved(tmp_path, stop=6), tmp_path / "again.ckpt"  # 2 of the second group's 4 micro-batches
    fabric = _fabric()
    if optimizers == "set up first":
        model, optimizer = fabric.setup(*_model_and_optimizer())
        fabric.load(path, {"model": model, "optimizer": optimizer})
        assert _state(fabric) is GroupState.REOPENED  # its gradient waits for the first backward
    else:
        model = fabric.setup_module(TinyNet().double())
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        fabric.load(path, {"model": model, "optimizer": optimizer})
        assert _state(fabric) is GroupState.LOADED  # waits for its optimizers
    fabric.save(again, {"model": model, "optimizer": optimizer})
    assert torch.load(again, weights_only=True)["lightning_accum"]["open_group"]["microbatches"] == 2
    fabric = _fabric()
    model, optimizer = fabric.setup(*_model_and_optimizer())
    fabric.load(again, {"model": model, "optimizer": optimizer})
    train(fabric, model, optimizer, micro_batches(EXAMPLES, M), A, start=6)
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


# ------------------------------------------------------------ the transitions, each from the states it leaves

_OPTIMIZER = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
#: Each transition, called with what its callers hand it.
_CALLS: dict[str, Any] = {
    "open": lambda group: group.open(),
    "hand_out": lambda group: group.hand_out(torch.zeros(())),
    "close": lambda group: group.close(),
    "await_step": lambda group: group.await_step(Closed(_OPTIMIZER, None)),
    "stepped": lambda group: group.stepped(_OPTIMIZER),
    "load": lambda group: group.load(None),
    "reopen_later": lambda group: group.reopen_later({}, 0),
    "reopen": lambda group: group.reopen(None),
    "install": lambda group: group.install(),
    "end": lambda group: group.end("the test ended it"),
}
#: Where each transition goes from each state it leaves (with the arguments above).
_TO = {"open": "open", "close": "idle", "await_step": "closed", "stepped": "idle", "load": "loaded"}
_TO |= {"reopen_later": "loaded", "reopen": "idle", "install": "open", "end": "idle"}


def _in(state: GroupState) -> GroupLifecycle:
    """A lifecycle driven into ``state`` through its transitions."""
    group = GroupLifecycle(AccumulationEngine())
    steps = {
        GroupState.IDLE: [],
        GroupState.OPEN: ["open"],
        GroupState.CLOSED: ["open", "close", "await_step"],
        GroupState.LOADED: ["load"],
    }
    for name in steps.get(state, ["load"]):
        _CALLS[name](group)
    if state is GroupState.REOPENED:
        group.reopen(Carried(microbatches=2, gradients={}))
    assert group.state is state
    return group


@pytest.mark.parametrize("state", list(GroupState), ids=lambda state: state.value)
@pytest.mark.parametrize("transition", list(_CALLS))
def test_each_transition_leaves_only_its_states_and_refuses_the_others(transition: str, state: GroupState) -> None:
    group = _in(state)
    if state in LEAVES[transition]:
        _CALLS[transition](group)
        assert group.state.value == (state.value if transition == "hand_out" else _TO[transition])
        return
    with pytest.raises(RuntimeError) as refused:
        _CALLS[transition](group)
    assert group.state is state  # refused: nothing changed
    message = str(refused.value)
    if state is GroupState.CLOSED and transition in ("open", "hand_out", "close", "await_step"):  # a loop's mistake
        assert "still waits for its update. Call `optimizer.step()` right after `close_group`" in message
    elif (transition, state) == ("close", GroupState.IDLE):
        assert message.startswith("`strategy.close_group` found no micro-batch in the open group.")
    elif transition == "stepped" and state in (GroupState.OPEN, GroupState.REOPENED):
        assert message.startswith("`SGD.step()` was called while 0 micro-batch(es) reported with")
    else:  # no loop can cause it
        assert message == (
            f"lightning_accum: the accumulation group cannot `{transition}` while it is {state.value} (0"
            f" micro-batch(es) held; it leaves {' or '.join(s.value for s in LEAVES[transition])} that way). This is a"
            " bug of lightning_accum: please report it."
        )


def test_a_step_of_another_optimizer_is_refused_and_the_group_still_waits() -> None:
    group, other = _in(GroupState.CLOSED), torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])
    with pytest.raises(RuntimeError, match=r"`Adam.step\(\)` was called while the group closed by .* \(SGD\)"):
        group.stepped(other)
    assert group.state is GroupState.CLOSED and group.stepped(_OPTIMIZER).optimizer is _OPTIMIZER


def test_the_transitions_table_of_the_docs_is_the_codes() -> None:
    docs = (Path(__file__).resolve().parents[2] / "docs" / "internals.md").read_text()
    table = docs.split("## The group's lifecycle", 1)[1].split("\n\n| transition |", 1)[1].split("\n\n", 1)[0]
    rows = [line.split("|")[1:4] for line in table.splitlines()[2:]]
    documented = {row[0].strip().strip("`"): (row[1].strip(), row[2].strip()) for row in rows}
    assert list(documented) == list(LEAVES)
    for name, (leaves, to) in documented.items():
        expected = "any" if LEAVES[name] == tuple(GroupState) else ", ".join(s.value for s in LEAVES[name])
        assert leaves == expected, name
        assert to.split(", or ")[-1] == ("the same" if name == "hand_out" else _TO[name]), name
