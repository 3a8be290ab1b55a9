"""core/checkpoint: the open group written into a checkpoint, loaded, reopened and installed in the resumed run, and
what is announced when the entry is missing or the configuration changed."""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import (
    _EXAMPLES,
    CheckpointAt,
    ListDataset,
    ResumableLoader,
    TinyLM,
    _loader,
    _plain_trainer,
    _resume,
    _written_at,
    make_examples,
    params_vector,
    random_lengths,
)
from strategies.test_checkpoint import _ignore_on_exception_checkpoint_notes, _Interrupted, _mid_group_trainer

from core.test_entry import _damage
from lightning_accum import AccumulationStrategy


@pytest.mark.parametrize("policy", ["rescale", "drop"])
@pytest.mark.parametrize(
    ("interrupt", "in_checkpoint", "carried"),
    [
        (("exception", 0, 4), 5, 2),  # fails after the 2nd micro-batch of the 2nd group (3, 4, 5)
        (("sigterm", 1, 6), 8 + 7, 1),  # epoch 1, after the 1st micro-batch of the partial final group (6, 7)
        (("callback", 1, 1), 8 + 2, 2),  # a checkpoint written by a callback between micro-batches 2 and 3
    ],
    ids=["exception", "sigterm", "callback"],
)
def test_resume_from_inside_a_group_is_exact(
    tmp_path: Path, policy: str, interrupt: tuple[str, int, int], in_checkpoint: int, carried: int
) -> None:
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    examples = make_examples(random_lengths(16, seed=52), seed=52)  # 8 micro-batches an epoch: groups 3, 3, 2

    def loader() -> ResumableLoader:
        return ResumableLoader(ListDataset(examples), batch_size=2)

    whole_model = _Interrupted()
    whole = _mid_group_trainer(policy, None)
    whole.fit(whole_model, loader())

    stopped_model = _Interrupted(interrupt, str(tmp_path))
    stopped = _mid_group_trainer(policy, tmp_path)
    expected = {"exception": RuntimeError, "sigterm": SIGTERMException, "callback": None}[interrupt[0]]
    with warnings.catch_warnings():
        _ignore_on_exception_checkpoint_notes()
        if expected is None:
            stopped.fit(stopped_model, loader())
        else:
            with pytest.raises(expected):
                stopped.fit(stopped_model, loader())
    path = tmp_path / ("by_callback.ckpt" if expected is None else "interrupted.ckpt")
    state = torch.load(path, weights_only=True)["lightning_accum"]
    assert state["open_group_microbatches"] == carried
    assert set(state["open_group"]["gradients"]) == {"embed.weight", "head.weight", "head.bias"}

    resumed_model = _Interrupted()
    resumed = _mid_group_trainer(policy, None)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*callbacks used to create the checkpoint")  # Lightning's note
        resumed.fit(resumed_model, loader(), ckpt_path=path)

    # Every example trained on exactly once: the data before the checkpoint and after the resume is the whole run's.
    assert stopped_model.seen_tokens[:in_checkpoint] + resumed_model.seen_tokens == whole_model.seen_tokens
    ledger = resumed.strategy.ledger
    assert ledger == whole.strategy.ledger
    assert ledger.microbatches + ledger.dropped_microbatches == 16
    assert ledger.tokens + ledger.dropped_tokens == sum(whole_model.seen_tokens)
    assert ledger.dropped_microbatches == (4 if policy == "drop" else 0)
    assert resumed.optimizers[0].param_groups[0]["lr"] == whole.optimizers[0].param_groups[0]["lr"]
    torch.testing.assert_close(params_vector(resumed_model), params_vector(whole_model), rtol=1e-6, atol=1e-7)


def test_a_group_that_cannot_be_carried_is_reported_and_not_counted_twice(tmp_path: Path) -> None:
    examples = make_examples(random_lengths(16, seed=53), seed=53)  # 8 micro-batches an epoch: groups 3, 3, 2

    def loader() -> ResumableLoader:
        return ResumableLoader(ListDataset(examples), batch_size=2)

    whole_model = _Interrupted()
    whole = _mid_group_trainer("drop", None)
    whole.fit(whole_model, loader())
    tokens = whole_model.seen_tokens[:8]  # of micro-batches 0..7, the same in both epochs

    # on_after_backward fails in micro-batch 4: its gradient is in the model, but Lightning runs it again.
    stopped = _mid_group_trainer("drop", tmp_path)
    with (
        warnings.catch_warnings(record=True) as caught,
        pytest.raises(RuntimeError, match="backward"),
    ):
        warnings.simplefilter("always")
        stopped.fit(_Interrupted(("backward", 0, 4), str(tmp_path)), loader())
    messages = [str(w.message) for w in caught]
    assert any("backward had not completed" in m for m in messages)
    assert any("while micro-batch 5 of the epoch was running" in m for m in messages)
    state = torch.load(tmp_path / "interrupted.ckpt", weights_only=True)["lightning_accum"]
    assert state["open_group_microbatches"] == 2 and "gradients" not in state["open_group"]

    resumed_model = _Interrupted()
    resumed = _mid_group_trainer("drop", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.fit(resumed_model, loader(), ckpt_path=tmp_path / "interrupted.ckpt")
    messages = [str(w.message) for w in caught]
    lost = [m for m in messages if "does not carry the 2 micro-batch(es) of that group" in m]
    assert len(lost) == 1 and "backward had not completed): 1 of them, which Lightning does not run" in lost[0]
    ended_early = [m for m in messages if "never reached an optimizer step" in m]
    assert len(ended_early) == 1 and ended_early[0].startswith("lightning_accum: 1 micro-batch(es)")

    # What happened, micro-batch by micro-batch: 0-2 updated before the checkpoint; 3 is lost (warned); Lightning
    # runs index 4 again but the loader's saved state already counts it, so it gets micro-batch 5 (Lightning's
    # behaviour, warned when saving); 5 and 6 close the group [3 lost, 5, 6] as a full group (not dropped as
    # partial); 7 arrives as Lightning's index 6, the loader then ends one batch early, so no step (warned).
    # Epoch 1 is whole: 0-5 updated, 6-7 dropped. Nothing is counted twice.
    assert resumed_model.seen_tokens == tokens[5:] + tokens
    ledger = resumed.strategy.ledger
    assert ledger.microbatches == 3 + 2 + 6 and ledger.dropped_microbatches == 2
    assert ledger.tokens == sum(tokens[0:3]) + sum(tokens[5:7]) + sum(tokens[0:6])
    assert ledger.dropped_tokens == sum(tokens[6:8])
    assert ledger.updates_applied == whole.strategy.ledger.updates_applied == 4


def test_a_plain_lightning_checkpoint_inside_a_group_is_not_taken_for_the_epochs_last_group(tmp_path: Path) -> None:
    # Written by plain Lightning after micro-batch 4 (the group 3, 4, 5 is open); resumed under "drop" at 5.
    ckpt = _written_at(tmp_path, 4, strategy="auto")
    assert "lightning_accum" not in torch.load(ckpt, weights_only=True)
    trainer, _, messages = _resume(ckpt, AccumulationStrategy(partial_group="drop"), 3)
    announced = [m for m in messages if "holds no 'lightning_accum' entry" in m]
    assert len(announced) == 1, messages
    assert sum("first 2 micro-batch(es) per replica" in m for m in messages) == 1, messages
    ledger = trainer.strategy.ledger
    # The rest of the open group (micro-batch 5) is updated as the end of a full group; only 6, 7 end the epoch.
    assert (ledger.updates_applied, ledger.microbatches, ledger.partial_groups) == (1, 1, 1)
    assert ledger.dropped_microbatches == 2


def test_a_boundary_checkpoint_resumed_with_another_accumulate_is_exact(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from helpers import sgd_reference

    ckpt = _written_at(tmp_path, 2)  # after the first update (A = 3), resumed with A = 4
    assert torch.load(ckpt, weights_only=True)["lightning_accum"]["config"] == {
        "accumulate": 3,
        "strategy": "AccumulationStrategy",
        "replicas": 1,
        "normalize": "auto",
        "partial_group": "rescale",
    }
    with caplog.at_level("INFO"):
        trainer, model, messages = _resume(ckpt, "accum", 4)
    assert not [m for m in messages if "lost" in m or "resumed" in m], messages
    assert any("accumulate_grad_batches 3 -> 4" in r.message and "3 place(s) of 4" in r.message for r in caplog.records)
    # Lightning groups by index: micro-batch 3 closes the first group after the resume, then 4..7.
    ex = _EXAMPLES
    expected = sgd_reference(TinyLM(), [ex[0:6], ex[6:8], ex[8:16]])
    torch.testing.assert_close(params_vector(model), expected, rtol=1e-5, atol=1e-6)
    ledger = trainer.strategy.ledger
    assert (ledger.updates_applied, ledger.microbatches, ledger.partial_groups) == (3, 8, 0)


def test_a_group_carried_into_another_accumulate_closes_exactly(tmp_path: Path) -> None:
    from helpers import sgd_reference

    ckpt = _written_at(tmp_path, 4)  # micro-batches 3, 4 of the second group (A = 3) are carried
    trainer, model, messages = _resume(ckpt, "accum", 4)
    assert not [m for m in messages if "lost" in m], messages
    # Resumed at 5 with A = 4: place 1 of Lightning's group 4..7; the carried 3, 4 join it, which closes at 7.
    ex = _EXAMPLES
    torch.testing.assert_close(params_vector(model), sgd_reference(TinyLM(), [ex[0:6], ex[6:16]]), rtol=1e-5, atol=1e-6)
    ledger = trainer.strategy.ledger
    assert (ledger.updates_applied, ledger.microbatches, ledger.last_group.microbatches) == (2, 8, 5)


def test_a_conflicting_normalize_wins_at_a_boundary_and_is_an_error_inside_a_group(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    boundary = _written_at(tmp_path, 2)
    with caplog.at_level("INFO"):
        trainer, _, _ = _resume(boundary, AccumulationStrategy(normalize="samples"), 3)
    assert any("micro-batches by tokens; from now on they are weighted by samples" in r.message for r in caplog.records)
    assert trainer.strategy.ledger.normalization == "samples"
    inside = _written_at(tmp_path, 4)
    with pytest.raises(ValueError, match=r"`normalize='samples'` conflicts with the checkpoint: .* weighted by tokens"):
        _resume(inside, AccumulationStrategy(normalize="samples"), 3)


def test_a_checkpoint_without_the_entry_is_announced_once(tmp_path: Path) -> None:
    ckpt = _written_at(tmp_path, 2)  # at an update boundary
    state = torch.load(ckpt, weights_only=True)
    _damage(state, "no entry")
    torch.save(state, ckpt)
    trainer, _, messages = _resume(ckpt, "accum", 3)
    assert sum("holds no 'lightning_accum' entry" in m for m in messages) == 1, messages
    assert trainer.strategy.ledger.updates_applied == 2  # the counters start again at 0, as announced


class _StopAtStart(L.Callback):
    """Writes a checkpoint when the resumed run starts, before its first micro-batch (a signal handler's save, or an
    exception checkpoint when the first fetch fails), and stops the run there."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.save_checkpoint(self.path)
        raise RuntimeError("stopped before the first micro-batch")


def test_a_checkpoint_written_before_the_first_micro_batch_of_a_resume_carries_the_open_group(tmp_path: Path) -> None:
    # The window after a mid-group resume and before its first training_step: the group the first checkpoint
    # carried is pending, not yet reopened in the engine. A checkpoint written then carried nothing (the resumed
    # run ended 2 micro-batches and their tokens short); it now writes the pending group again.
    examples = make_examples(random_lengths(16, seed=52), seed=52)

    def loader() -> ResumableLoader:
        return ResumableLoader(ListDataset(examples), batch_size=2)

    whole_model = _Interrupted()
    whole = _mid_group_trainer("rescale", None)
    whole.fit(whole_model, loader())

    first_model = _Interrupted(("callback", 1, 1), str(tmp_path))  # writes by_callback.ckpt inside a group
    with warnings.catch_warnings():
        _ignore_on_exception_checkpoint_notes()
        _mid_group_trainer("rescale", tmp_path).fit(first_model, loader())
    first = tmp_path / "by_callback.ckpt"
    window = tmp_path / "window.ckpt"
    stopped = _mid_group_trainer("rescale", None)
    stopped.callbacks.append(_StopAtStart(window))
    with warnings.catch_warnings(), pytest.raises(RuntimeError, match="stopped before the first micro-batch"):
        warnings.filterwarnings("ignore", message=".*callbacks used to create the checkpoint")  # Lightning's note
        stopped.fit(_Interrupted(), loader(), ckpt_path=first)
    written = torch.load(window, weights_only=True)
    assert written["lightning_accum"]["open_group_microbatches"] == 2
    assert written["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["consumed"] == 2  # the loader's place

    resumed_model = _Interrupted()
    resumed = _mid_group_trainer("rescale", None)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*callbacks used to create the checkpoint")
        resumed.fit(resumed_model, loader(), ckpt_path=window)
    assert first_model.seen_tokens[: 8 + 2] + resumed_model.seen_tokens == whole_model.seen_tokens
    assert resumed.strategy.ledger == whole.strategy.ledger
    torch.testing.assert_close(params_vector(resumed_model), params_vector(whole_model), rtol=1e-6, atol=1e-7)


def test_a_group_carried_through_two_checkpoints_records_what_it_carried_and_resumes_exactly(tmp_path: Path) -> None:
    # Written inside the group 4..7 (A = 4) after micro-batch 4, resumed, written again after 5 in the same group:
    # the second entry's total holds the micro-batch carried in (1) and the resumed run's own (1).
    whole = _plain_trainer("accum", 4)
    whole_model = TinyLM()
    whole.fit(whole_model, _loader())
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    _written_at(first, 4, accumulate=4)
    _resume(first / "at.ckpt", "accum", 4, callbacks=[CheckpointAt(second / "at.ckpt", 5)])
    state = torch.load(second / "at.ckpt", weights_only=True)
    group = state["lightning_accum"]["open_group"]
    assert (group["microbatches"], group["carried_microbatches"], group["total_microbatches"]) == (1, 1, 2)
    trainer, model, messages = _resume(second / "at.ckpt", "accum", 4)
    assert not [m for m in messages if "lost" in m], messages
    assert trainer.strategy.ledger == whole.strategy.ledger
    torch.testing.assert_close(params_vector(model), params_vector(whole_model), rtol=1e-6, atol=1e-7)
    group["total_microbatches"] = 1  # as if nothing had been carried in: the counters contradict it
    torch.save(state, second / "at.ckpt")
    with pytest.raises(ValueError, match=r"`open_group.total_microbatches` should be 2 \("):
        _resume(second / "at.ckpt", "accum", 4)
