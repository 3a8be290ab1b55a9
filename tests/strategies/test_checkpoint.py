"""Checkpoints: resume at update boundaries and inside a group, on one device and under DDP."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import pickle
import re
import shutil
import signal
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from helpers import (
    CheckpointAt,
    ListDataset,
    ResumableLoader,
    TinyLM,
    ddp_trainer,
    make_examples,
    make_trainer,
    params_vector,
    random_lengths,
    relative_error,
    run_ddp,
)
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_accum import AccumulationStrategy, DDPAccumulationStrategy


class _PoisonOnce(TinyLM):
    """The loss of micro-batch `bad` of epoch 0 is NaN: one skipped update before the checkpoint."""

    def __init__(self, bad: int = 2) -> None:
        super().__init__(lr=0.3, optimizer="adamw")
        self.bad = bad

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        if self.current_epoch == 0 and batch_idx == self.bad:
            out["loss"] = out["loss"] * float("nan")
        return out

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


@pytest.mark.parametrize("policy", ["rescale", "drop"])
def test_resume_at_an_update_boundary_equals_the_uninterrupted_run(tmp_path: Path, policy: str) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    examples = make_examples(random_lengths(14, seed=50), seed=50)  # 7 micro-batches: groups 3, 3, 1 (partial)

    def trainer(max_epochs: int, callbacks: list[L.Callback]) -> L.Trainer:
        return make_trainer(
            strategy=AccumulationStrategy(partial_group=policy),
            accumulate_grad_batches=3,
            max_epochs=max_epochs,
            callbacks=callbacks,
            enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        )

    def loader() -> ResumableLoader:
        return ResumableLoader(ListDataset(examples), batch_size=2)

    whole_model = _PoisonOnce()
    whole = trainer(3, [])
    with pytest.warns(UserWarning, match="skipped update 1"):
        whole.fit(whole_model, loader())

    # A checkpoint after the 2nd attempted update (global_step 2): mid-epoch, after the skipped first update.
    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    interrupted = trainer(1, [checkpoints])
    with pytest.warns(UserWarning, match="skipped update 1"):
        interrupted.fit(_PoisonOnce(), loader())
    path = tmp_path / "step=2.ckpt"
    assert torch.load(path, weights_only=True)["lightning_accum"]["ledger"]["updates_skipped"]["nonfinite"] == 1

    resumed_model = _PoisonOnce()
    resumed = trainer(3, [])
    with pytest.warns(UserWarning, match="callbacks used to create the checkpoint"):  # Lightning's note
        resumed.fit(resumed_model, loader(), ckpt_path=path)
    assert resumed.strategy.ledger == whole.strategy.ledger
    assert resumed.optimizers[0].param_groups[0]["lr"] == whole.optimizers[0].param_groups[0]["lr"]
    torch.testing.assert_close(params_vector(resumed_model), params_vector(whole_model), rtol=1e-6, atol=1e-7)
    ledger = whole.strategy.ledger
    assert ledger.partial_groups == 3 and ledger.updates_skipped["nonfinite"] == 1
    assert ledger.dropped_microbatches == (3 if policy == "drop" else 0)


class _Interrupted(TinyLM):
    """AdamW + a step schedule; records the supervised tokens of every micro-batch it trains on.

    `interrupt` = (how, epoch, batch): "exception" raises in on_train_batch_end (after the micro-batch ran);
    "sigterm" sends the process a SIGTERM after the micro-batch (Lightning stops at the batch's end); "callback"
    writes a checkpoint from on_train_batch_end and trains on; "step" raises in training_step (before the
    micro-batch runs); "backward" raises in on_after_backward (the micro-batch's gradient is already accumulated,
    but Lightning runs the micro-batch again on resume).
    """

    def __init__(self, interrupt: tuple[str, int, int] | None = None, folder: str = "") -> None:
        super().__init__(lr=0.3, optimizer="adamw")
        self.interrupt = interrupt
        self.folder = folder
        self.seen_tokens: list[int] = []

    def _now(self, how: str, batch_idx: int) -> bool:
        return self.interrupt is not None and self.interrupt == (how, self.current_epoch, batch_idx)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        if self._now("step", batch_idx):
            raise RuntimeError("killed mid-group")
        self.seen_tokens.append(int((batch["labels"] != -100).sum()))
        return super().training_step(batch, batch_idx)

    def on_after_backward(self) -> None:
        if self._now("backward", self.trainer.fit_loop.epoch_loop.batch_idx):
            raise RuntimeError("killed inside a backward hook")

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._now("exception", batch_idx):
            raise RuntimeError("killed mid-group")
        if self._now("sigterm", batch_idx):
            # To this thread (the main one), not to the process: a process-directed signal may be taken by another
            # thread (torch's), and Lightning's handler would then run at a moment that depends on scheduling.
            signal.raise_signal(signal.SIGTERM)
        if self._now("callback", batch_idx):
            self.trainer.save_checkpoint(os.path.join(self.folder, "by_callback.ckpt"))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _ignore_on_exception_checkpoint_notes() -> None:
    """Lightning's notes whenever OnExceptionCheckpoint is used without ckpt_path (it looks for a checkpoint)."""
    warnings.filterwarnings("ignore", message=".*was called without a model")
    warnings.filterwarnings("ignore", message=r".*ckpt_path=\"last\"\) is set, but there is no last checkpoint")


def _mid_group_trainer(policy: str, folder: Path | None) -> L.Trainer:
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    return make_trainer(
        strategy=AccumulationStrategy(partial_group=policy),
        accumulate_grad_batches=3,
        max_epochs=2,
        callbacks=[OnExceptionCheckpoint(dirpath=folder, filename="interrupted")] if folder else [],
        enable_checkpointing=folder is not None,
    )


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


def _ddp_resumable_fit(
    model: L.LightningModule,
    strategy: Any,
    max_epochs: int,
    callbacks: list[L.Callback],
    ckpt: str | None,
    examples: list[dict[str, torch.Tensor]],
) -> L.Trainer:
    """A 2-process fit (inside a run_ddp worker) on a resumable, rank-strided loader; A = 2."""
    from helpers import RankStridedSampler

    trainer = ddp_trainer(strategy, accumulate=2, max_epochs=max_epochs, callbacks=callbacks)
    loader = ResumableLoader(ListDataset(examples), batch_size=2, sampler=RankStridedSampler(len(examples)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the skipped-update warning, Lightning's resume notes
        trainer.fit(model, loader, ckpt_path=ckpt)
    return trainer


def _ddp_resume_runs(rank: int, folder: str) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    examples = make_examples(random_lengths(20, seed=60), seed=60)  # 5 micro-batches of 2 per rank, A = 2

    def run(max_epochs: int, callbacks: list[L.Callback], ckpt: str | None) -> tuple[L.Trainer, TinyLM]:
        model = _PoisonOnce(bad=2)
        return _ddp_resumable_fit(model, "accum_ddp", max_epochs, callbacks, ckpt, examples), model

    whole, whole_model = run(2, [], None)
    checkpoints = ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    run(1, [checkpoints], None)
    resumed, resumed_model = run(2, [], f"{folder}/step=2.ckpt")
    torch.save(
        {
            "whole": params_vector(whole_model),
            "resumed": params_vector(resumed_model),
            "same_ledger": resumed.strategy.ledger == whole.strategy.ledger,
            "ledger": whole.strategy.ledger.state_dict(),
            "lr": (whole.optimizers[0].param_groups[0]["lr"], resumed.optimizers[0].param_groups[0]["lr"]),
        },
        f"{folder}/resume-rank{rank}.pt",
    )


@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_ddp_resume_at_an_update_boundary_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    run_ddp(_ddp_resume_runs, str(tmp_path))
    for rank in (0, 1):
        result = torch.load(tmp_path / f"resume-rank{rank}.pt", weights_only=True)
        assert result["same_ledger"], result["ledger"]
        assert result["lr"][0] == result["lr"][1]
        torch.testing.assert_close(result["resumed"], result["whole"], rtol=1e-6, atol=1e-7)
        ledger = result["ledger"]
        # 2 epochs x (2 full groups + 1 partial group of 1 micro-batch per rank); update 2 (before the checkpoint
        # written at step 2) is skipped.
        assert (ledger["updates_attempted"], ledger["updates_skipped"]["nonfinite"], ledger["partial_groups"]) == (
            6,
            1,
            2,
        )


def _ddp_mid_group_runs(rank: int, folder: str, microbatch_size: int | None = None) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    examples = make_examples(random_lengths(20, seed=61), seed=61)  # 5 micro-batches of 2 per rank: groups 2, 2, 1

    def run(callbacks: list[L.Callback], ckpt: str | None, interrupt: Any = None) -> tuple[L.Trainer, _Interrupted]:
        model = _Interrupted(interrupt, folder)
        strategy = DDPAccumulationStrategy(partial_group="drop", start_method="popen", microbatch_size=microbatch_size)
        return _ddp_resumable_fit(model, strategy, 2, callbacks, ckpt, examples), model

    whole, whole_model = run([], None)
    # One run writes both: a checkpoint at an update boundary (step 2, mid-epoch 0) and one from a callback inside
    # the first group of epoch 1 (after its first micro-batch, batch 0).
    boundary = ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    run([boundary], None, ("callback", 1, 0))
    results: dict[str, Any] = {"whole": params_vector(whole_model), "ledger": whole.strategy.ledger.state_dict()}
    for name, path in (("boundary", f"{folder}/step=2.ckpt"), ("mid_group", f"{folder}/by_callback.ckpt")):
        resumed, resumed_model = run([], path)
        results[name] = {
            "params": params_vector(resumed_model),
            "same_ledger": resumed.strategy.ledger == whole.strategy.ledger,
            "lr": resumed.optimizers[0].param_groups[0]["lr"],
            "open": torch.load(path, weights_only=True)["lightning_accum"]["open_group_microbatches"],
            "ledger": resumed.strategy.ledger.state_dict(),
        }
    results["lr"] = whole.optimizers[0].param_groups[0]["lr"]
    torch.save(results, f"{folder}/mid-group-rank{rank}.pt")


def _check_ddp_mid_group_runs(folder: Path, exact_loss: bool = True) -> None:
    for rank in (0, 1):
        result = torch.load(folder / f"mid-group-rank{rank}.pt", weights_only=True)
        ledger = result["ledger"]
        # 2 epochs x (2 full groups + 1 dropped partial group of 1 micro-batch on each of the 2 replicas)
        assert (ledger["updates_applied"], ledger["dropped_microbatches"], ledger["microbatches"]) == (4, 4, 16)
        for name, open_microbatches in (("boundary", 0), ("mid_group", 1)):
            resumed = result[name]
            assert resumed["open"] == open_microbatches
            if exact_loss:
                assert resumed["same_ledger"], (name, ledger)
            else:
                # The carried gradient is the replicas' sum, added on one replica: the same sum in another order, so
                # the parameters may differ in their last bits and a later group's float32 loss with them.
                got, want = dict(resumed["ledger"]), dict(ledger)
                got_last, want_last = dict(got.pop("last_group")), dict(want.pop("last_group"))
                assert got == want, (name, got, want)
                assert got_last.pop("loss") == pytest.approx(want_last.pop("loss"), rel=1e-6)
                assert got_last == want_last
            assert resumed["lr"] == result["lr"]
            torch.testing.assert_close(resumed["params"], result["whole"], rtol=1e-6, atol=1e-7)


@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_ddp_resume_of_sliced_batches_at_a_boundary_and_inside_a_group(tmp_path: Path) -> None:
    # `microbatch_size=1`: every loader batch of 2 runs as 2 slices (issue #18). The checkpoint written inside a
    # group carries that group's gradient of sliced batches on both replicas; resumed, the run is the uninterrupted.
    run_ddp(_ddp_mid_group_runs, str(tmp_path), 1)
    _check_ddp_mid_group_runs(tmp_path, exact_loss=False)


@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_ddp_resume_with_drop_at_a_boundary_and_inside_a_group(tmp_path: Path) -> None:
    run_ddp(_ddp_mid_group_runs, str(tmp_path))
    _check_ddp_mid_group_runs(tmp_path)

    # The group written on 2 replicas (1 micro-batch each) resumed on one device: it counts 2 micro-batches, not 1.
    ckpt = tmp_path / "by_callback.ckpt"
    group = torch.load(ckpt, weights_only=True)["lightning_accum"]["open_group"]
    assert (group["microbatches"], group["replicas"], group["total_microbatches"]) == (1, 2, 2)
    examples = make_examples(random_lengths(10, seed=61), seed=61)  # 5 micro-batches; the loader skips the first
    trainer = make_trainer(
        strategy=AccumulationStrategy(partial_group="drop"),
        accumulate_grad_batches=2,
        max_epochs=2,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's resume notes
        trainer.fit(_Interrupted(), ResumableLoader(ListDataset(examples), batch_size=2), ckpt_path=ckpt)
    ledger = trainer.strategy.ledger
    # Written: epoch 0 (8 micro-batches in updates, 2 dropped). Resumed at batch 1 of epoch 1: the carried 2 and
    # batch 1 close a group of 3, then 2, 3; batch 4 is a partial group, dropped.
    assert ledger.microbatches == 8 + 3 + 2 and ledger.dropped_microbatches == 2 + 1


def test_accumulation_check_leaves_a_group_resumed_inside_the_first_group_alone(tmp_path: Path) -> None:
    # A checkpoint written after the 2nd micro-batch of the run's first group (no attempt yet): the check must not
    # run on (and consume) the resumed open group.
    from lightning_accum import AccumulationCheck

    examples = make_examples(random_lengths(16, seed=54), seed=54)

    def loader() -> ResumableLoader:
        return ResumableLoader(ListDataset(examples), batch_size=2)

    def trainer(folder: Path | None) -> L.Trainer:
        built = _mid_group_trainer("rescale", folder)
        built.callbacks.append(AccumulationCheck())
        return built

    whole_model = _Interrupted()
    whole = trainer(None)
    whole.fit(whole_model, loader())

    stopped = trainer(tmp_path)
    with warnings.catch_warnings(), pytest.raises(RuntimeError, match="killed mid-group"):
        _ignore_on_exception_checkpoint_notes()
        stopped.fit(_Interrupted(("exception", 0, 1)), loader())
    path = tmp_path / "interrupted.ckpt"
    state = torch.load(path, weights_only=True)["lightning_accum"]
    assert state["ledger"]["updates_attempted"] == 0 and state["open_group_microbatches"] == 2

    resumed_model = _Interrupted()
    resumed = trainer(None)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*callbacks used to create the checkpoint")  # Lightning's note
        resumed.fit(resumed_model, loader(), ckpt_path=path)
    assert resumed.strategy.ledger == whole.strategy.ledger
    assert resumed.strategy.ledger.microbatches == 16
    torch.testing.assert_close(params_vector(resumed_model), params_vector(whole_model), rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------- faults: a dead peer


@contextlib.contextmanager
def _two_workers(target: Callable[..., None], folder: Path) -> Iterator[list[Any]]:
    """Ranks 0 and 1 in processes of their own running `target(rank, folder)` (the test kills or waits for them, one
    by one); any still alive at the end is killed."""
    from helpers import _ddp_worker, free_port

    context = torch.multiprocessing.get_context("forkserver")  # clean processes, forked (tests/conftest.py)
    port = free_port()
    workers = [context.Process(target=_ddp_worker, args=(rank, 2, port, target, (str(folder),))) for rank in (0, 1)]
    for worker in workers:
        worker.start()
    try:
        yield workers
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.kill()


class _StopsForAKill(TinyLM):
    """On rank 1, after micro-batch `at` of epoch 0, writes `ready` and waits to be killed (SIGKILL from outside)."""

    def __init__(self, folder: str, at: int) -> None:
        super().__init__(lr=0.3, optimizer="adamw")
        self.folder, self.at = folder, at

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.global_rank == 1 and batch_idx == self.at:
            Path(self.folder, "ready").write_text(str(os.getpid()))
            while True:  # the test kills this process with SIGKILL; nothing here ends by itself
                signal.pause()


def _killed_peer_worker(rank: int, folder: str) -> None:
    import datetime
    import json
    import traceback

    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    examples = make_examples(random_lengths(24, seed=70), seed=70)
    strategy = DDPAccumulationStrategy(start_method="popen", timeout=datetime.timedelta(seconds=30))
    trainer = ddp_trainer(
        strategy, accumulate=3, max_epochs=1, callbacks=[OnExceptionCheckpoint(dirpath=folder, filename="dead_peer")]
    )
    from helpers import RankStridedSampler

    loader = ResumableLoader(ListDataset(examples), batch_size=2, sampler=RankStridedSampler(len(examples)))
    result: dict[str, Any] = {"error": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(_StopsForAKill(folder, at=4), loader)  # group 2 holds micro-batches 3, 4, 5
        except BaseException as err:
            result["error"] = f"{type(err).__name__}: {err}"
            result["context"] = repr(err.__context__)
            result["traceback"] = traceback.format_exc()
    result["warnings"] = [str(w.message) for w in caught]
    Path(folder, f"killed-rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.ddp
@pytest.mark.timeout(240)
def test_a_peer_killed_with_sigkill_leaves_a_checkpoint_from_the_survivor(tmp_path: Path) -> None:
    import json

    with _two_workers(_killed_peer_worker, tmp_path) as workers:
        ready = tmp_path / "ready"
        while not ready.exists() or not ready.read_text():  # rank 1 reached the point where it waits to be killed
            assert workers[1].is_alive(), "rank 1 ended before it could be killed"
            time.sleep(0.05)
        os.kill(int(ready.read_text()), signal.SIGKILL)
        workers[1].join(30)
        workers[0].join(120)
    assert workers[1].exitcode == -signal.SIGKILL
    result = json.loads((tmp_path / "killed-rank0.json").read_text())
    # The user sees the failure that stopped training (the collective with the dead peer), not a second one from
    # writing the checkpoint (which summed the open group's gradient over replicas, and waited at a barrier, before).
    # gloo sees the closed socket at once; a peer that stopped answering without closing would end at the timeout.
    failed = ("Connection closed by peer", "Connection reset by peer", "timeout")
    assert result["error"].startswith("RuntimeError:") and any(f in result["error"] for f in failed), result
    assert "During handling of the above exception" not in result["traceback"]
    assert "save_checkpoint" not in result["traceback"]
    assert any("a collective failed" in m for m in result["warnings"]), result["warnings"]
    assert any("cannot be carried exactly" in m for m in result["warnings"]), result["warnings"]

    checkpoint = torch.load(tmp_path / "dead_peer.ckpt", weights_only=True)
    assert set(checkpoint["state_dict"]) == {"embed.weight", "head.weight", "head.bias"}
    assert checkpoint["optimizer_states"][0]["state"]  # AdamW's moments after the first update
    state = checkpoint["lightning_accum"]
    assert state["ledger"]["updates_applied"] == 1 and state["ledger"]["microbatches"] == 6
    group = state["open_group"]
    assert group["carried"] is False and "gradients" not in group
    assert "could not be reached" in group["reason"] and any(f in group["reason"] for f in failed)
    assert (group["microbatches"], group["replicas"], group["total_microbatches"]) == (3, 2, 6)

    # Resumed on one device (D = 2 -> 1): the ledger goes on from the checkpoint and the loss is reported in numbers
    # of the run that wrote it (3 micro-batches on each of 2 replicas; the one that was running is run again).
    resumed = _mid_group_trainer("rescale", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.fit(
            TinyLM(optimizer="adamw"),
            ResumableLoader(ListDataset(make_examples([3] * 24)), batch_size=2),
            ckpt_path=tmp_path / "dead_peer.ckpt",
        )
    messages = [str(w.message) for w in caught]
    lost = [m for m in messages if "does not carry the 6 micro-batch(es) of that group it holds (over 2" in m]
    assert len(lost) == 1 and ": 4 of them, which Lightning does not run again, are lost" in lost[0], messages
    assert resumed.strategy.ledger.updates_applied > 1


class _SavesAfterThePeerDied(TinyLM):
    """After micro-batch 4 (inside the group 3, 4, 5): rank 1 kills itself (SIGKILL); rank 0 waits until the test
    has reaped it, then writes a checkpoint (its collectives meet a dead peer) and stops."""

    def __init__(self, folder: str) -> None:
        super().__init__(lr=0.3, optimizer="adamw")
        self.folder = folder

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx != 4:
            return
        if self.global_rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        go = Path(self.folder, "reaped")
        while not go.exists():  # the test writes it once rank 1's process is gone
            time.sleep(0.05)
        self.trainer.save_checkpoint(Path(self.folder, "after_death.ckpt"))
        raise RuntimeError("stopped after the checkpoint")


def _saves_after_death_worker(rank: int, folder: str) -> None:
    import json

    from helpers import RankStridedSampler

    examples = make_examples(random_lengths(24, seed=70), seed=70)
    strategy = DDPAccumulationStrategy(start_method="popen")
    trainer = ddp_trainer(strategy, accumulate=3)
    loader = ResumableLoader(ListDataset(examples), batch_size=2, sampler=RankStridedSampler(len(examples)))
    with warnings.catch_warnings(record=True) as caught, pytest.raises(RuntimeError, match="stopped after the"):
        warnings.simplefilter("always")
        trainer.fit(_SavesAfterThePeerDied(folder), loader)
    Path(folder, f"after-death-rank{rank}.json").write_text(json.dumps([str(w.message) for w in caught]))


@pytest.mark.ddp
@pytest.mark.timeout(240)
def test_a_checkpoint_whose_own_collectives_meet_a_dead_peer_is_written_by_the_survivor(tmp_path: Path) -> None:
    # A checkpoint written after a peer died and before any collective of training noticed it (a SIGTERM checkpoint,
    # a callback's save): its own collectives (the open group's sums and gradient) failed, and the save raised.
    import json

    with _two_workers(_saves_after_death_worker, tmp_path) as workers:
        workers[1].join(120)
        (tmp_path / "reaped").write_text("")
        workers[0].join(120)
    assert workers[1].exitcode == -signal.SIGKILL and workers[0].exitcode == 0
    said = json.loads((tmp_path / "after-death-rank0.json").read_text())
    assert any("a collective failed" in m for m in said), said
    state = torch.load(tmp_path / "after_death.ckpt", weights_only=True)["lightning_accum"]
    assert state["ledger"]["updates_applied"] == 1 and state["ledger"]["microbatches"] == 6
    group = state["open_group"]
    assert group["carried"] is False and "could not be reached" in group["reason"]
    assert (group["microbatches"], group["total_microbatches"]) == (2, 4)


class _KillsItself(TinyLM):
    """Rank 1 kills its own process (SIGKILL) after micro-batch 4 of the epoch, inside the group 3, 4, 5."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.global_rank == 1 and batch_idx == 4:
            os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.ddp
@pytest.mark.timeout(240)
def test_a_spawned_worker_killed_leaves_the_launchers_error_on_top_and_no_untrained_checkpoint(tmp_path: Path) -> None:
    # Under spawn, Lightning runs the exception hooks (OnExceptionCheckpoint) in the main process only, whose model
    # was never trained (the workers run `fit` without them). The package's `save_checkpoint` raised "... is not
    # attached to a `Trainer`" there, hiding the ProcessExitedException; written as Lightning's strategies write it,
    # the file would hold the untrained copy and an empty ledger under the name of an exception checkpoint.
    from lightning.pytorch.callbacks import OnExceptionCheckpoint
    from torch.multiprocessing import ProcessExitedException

    examples = make_examples(random_lengths(24, seed=70), seed=70)
    trainer = make_trainer(
        strategy="accum_ddp_spawn",
        devices=2,
        accumulate_grad_batches=3,
        callbacks=[OnExceptionCheckpoint(dirpath=tmp_path, filename="spawn_killed")],
        enable_checkpointing=True,
        use_distributed_sampler=True,
    )
    with (
        warnings.catch_warnings(record=True) as caught,
        pytest.raises(ProcessExitedException, match="process 1 terminated with signal SIGKILL"),
    ):
        warnings.simplefilter("always")
        trainer.fit(_KillsItself(optimizer="adamw"), ResumableLoader(ListDataset(examples), batch_size=2))
    said = [str(w.message) for w in caught if "no checkpoint written to" in str(w.message)]
    assert len(said) == 1 and "holds the model as it was before `fit`" in said[0], [str(w.message) for w in caught]
    assert not (tmp_path / "spawn_killed.ckpt").exists()


# ---------------------------------------------------------------------------- changes between runs, damaged entries


def _plain_trainer(strategy: Any, accumulate: int, callbacks: list[L.Callback] | None = None) -> L.Trainer:
    return make_trainer(
        strategy=strategy,
        accumulate_grad_batches=accumulate,
        callbacks=callbacks or [],
    )


_EXAMPLES = make_examples(random_lengths(16, seed=55), seed=55)  # 8 micro-batches of 2


def _loader() -> ResumableLoader:
    return ResumableLoader(ListDataset(_EXAMPLES), batch_size=2)


def _resume(
    ckpt: Path,
    strategy: Any,
    accumulate: int,
    model: L.LightningModule | None = None,
    callbacks: list[L.Callback] | None = None,
) -> tuple[L.Trainer, L.LightningModule, list[str]]:
    model = model if model is not None else TinyLM()
    trainer = _plain_trainer(strategy, accumulate, callbacks)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, _loader(), ckpt_path=ckpt)
    return trainer, model, [str(w.message) for w in caught if "callbacks used to create" not in str(w.message)]


def _written_at(folder: Path, at: int, strategy: Any = "accum", accumulate: int = 3) -> Path:
    _plain_trainer(strategy, accumulate, [CheckpointAt(folder / "at.ckpt", at)]).fit(TinyLM(), _loader())
    return folder / "at.ckpt"


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


def _damage(state: dict[str, Any], how: str) -> None:
    group = state["lightning_accum"].get("open_group") or {}
    if how == "no entry":
        del state["lightning_accum"]
    elif how == "unit":
        state["lightning_accum"]["ledger"]["normalization"] = "words"
    elif how == "ledger":
        state["lightning_accum"]["ledger"] = None
    elif how == "scale_ref":
        state["lightning_accum"]["scale_ref"] = 0.0
    elif how == "sums":
        del group["sums"]["units"]
    elif how == "microbatches":
        group["microbatches"] = "2"
    elif how == "gradient":
        del group["gradients"]["head.bias"]
    elif how == "shape":
        group["gradients"]["head.bias"] = torch.zeros(3)
    elif how == "open group None":
        state["lightning_accum"]["open_group"] = None
    elif how == "open group count":
        group["microbatches"] = 1
    elif how == "total 0":
        group["total_microbatches"] = 0
    elif how == "units 0":
        group["sums"]["units"] = 0.0
    elif how == "negative tokens":
        group["sums"]["tokens_lo"] = -3.0
    elif how == "huge samples":
        group["sums"]["samples_hi"] = 1e300
    elif how == "negative":
        group["sums"]["negative"] = 1.0
    elif how == "int64":
        group["gradients"]["head.bias"] = group["gradients"]["head.bias"].long()
    elif how == "applied":
        ledger = state["lightning_accum"]["ledger"]
        ledger["updates_applied"] = ledger["updates_attempted"] + 1
    elif how == "format":
        state["lightning_accum"]["format"] = 3
    elif how == "legacy":  # as written before format 2 on 2 replicas (the gradient's meaning unknown)
        del state["lightning_accum"]["format"]
        group.update(replicas=2, total_microbatches=4)


@pytest.mark.parametrize(
    ("how", "message"),
    [
        (
            "unit",
            r"`ledger.normalization` should be None or one of \('tokens', 'samples', 'batches',"
            r" 'documents'\), but it is 'words'",
        ),
        ("ledger", r"`ledger` should be a dict of the ledger's counters, but it is None"),
        ("scale_ref", r"`scale_ref` should be None or a number > 0, but it is 0.0"),
        ("sums", r"`open_group.sums` should be a dict of finite numbers with keys \['units'"),
        ("microbatches", r"`open_group.microbatches` should be an int >= 0, but it is '2'"),
        ("gradient", r"`open_group.gradients\['head.bias'\]` should be a tensor .*, but it is 'missing'"),
        ("shape", r"`open_group.gradients\['head.bias'\]` should be a tensor of shape \(11,\), but it is torch.Size"),
        (
            "open group None",
            r"`open_group` should be the group open at the checkpoint \(`open_group_microbatches` is 2",
        ),
        (
            "open group count",
            r"`open_group.microbatches` should be 2 \(as `open_group_microbatches` says\), but it is 1",
        ),
        ("total 0", r"`open_group.total_microbatches` should be at least 2 .*, but it is 0"),
        ("units 0", r"`open_group.sums.units` should be \d+ \(the group's tokens: .*, but it is 0.0"),
        (
            "negative tokens",
            r"`open_group.sums.tokens_lo` should be a whole number in \[0, 2\*\*53\) .*, but it is -3.0",
        ),
        (
            "huge samples",
            r"`open_group.sums.samples_hi` should be a whole number in \[0, 2\*\*53\) .*, but it is 1e\+300",
        ),
        ("negative", r"`open_group.sums.negative` should be 0 \(a micro-batch of the open group reported a negative"),
        ("int64", r"`open_group.gradients\['head.bias'\]` should be a floating-point tensor, but it is torch.int64"),
        (
            "applied",
            r"`ledger.updates_attempted` should be at least the applied and skipped updates \(2 \+ 0\), but it is 1",
        ),
        ("format", r"`format` should be 2 \(a later format is written by a later version\), but it is 3"),
    ],
)
def test_a_damaged_entry_is_an_error_naming_the_key(tmp_path: Path, how: str, message: str) -> None:
    ckpt = _written_at(tmp_path, 4)
    state = torch.load(ckpt, weights_only=True)
    _damage(state, how)
    torch.save(state, ckpt)
    with pytest.raises(ValueError, match=r"The checkpoint's 'lightning_accum' entry is damaged: " + message):
        _resume(ckpt, "accum", 3)


def test_an_open_group_removed_with_its_count_is_told_by_lightnings_loop_state(tmp_path: Path) -> None:
    # The entry's own two records of the open group removed together: the loop state Lightning wrote in the same file
    # resumes the run at micro-batch 3 of a group of 3 under the configuration it was written under. Resumed as at an
    # update boundary before, the group's first 2 micro-batches were silently missing from its update.
    ckpt = _written_at(tmp_path, 4)
    state = torch.load(ckpt, weights_only=True)
    del state["lightning_accum"]["open_group"]
    state["lightning_accum"]["open_group_microbatches"] = 0
    torch.save(state, ckpt)
    with pytest.raises(ValueError, match=r"`open_group` should be the group open at the checkpoint \(Lightning's loop"):
        _resume(ckpt, "accum", 3)
    # Under another A the resumed run's first group is only shorter (announced), as after a boundary checkpoint.
    trainer, _, _ = _resume(ckpt, "accum", 2)
    assert trainer.strategy.ledger.updates_applied == 1 + 1 + 1  # (0-2 before) + the short group (5) + 6, 7


def test_an_entry_of_unknown_meaning_is_refused_with_what_to_do(tmp_path: Path) -> None:
    # Before format 2, an open group written on several replicas held their gradients' sum (DDP) or their average
    # (FSDP2) without saying which: resumed under another engine it was weighted x2 or x1/2, announced as exact.
    ckpt = _written_at(tmp_path, 4)
    state = torch.load(ckpt, weights_only=True)
    _damage(state, "legacy")
    torch.save(state, ckpt)
    with pytest.raises(ValueError, match=r"written inside an accumulation group on 2 replicas by an earlier version"):
        _resume(ckpt, "accum", 3)
    # The way out the message gives: say which it was (DDP's sum) and save it again.
    state["lightning_accum"]["format"] = 2
    group = state["lightning_accum"]["open_group"]
    group.update(replicas=1, total_microbatches=2)
    torch.save(state, ckpt)
    trainer, _, _ = _resume(ckpt, "accum", 3)
    assert trainer.strategy.ledger.microbatches == 3 + 3 + 2


def test_a_checkpoint_without_the_entry_is_announced_once(tmp_path: Path) -> None:
    ckpt = _written_at(tmp_path, 2)  # at an update boundary
    state = torch.load(ckpt, weights_only=True)
    _damage(state, "no entry")
    torch.save(state, ckpt)
    trainer, _, messages = _resume(ckpt, "accum", 3)
    assert sum("holds no 'lightning_accum' entry" in m for m in messages) == 1, messages
    assert trainer.strategy.ledger.updates_applied == 2  # the counters start again at 0, as announced


def test_save_checkpoint_without_a_trainer_writes_as_lightnings_strategies_do(tmp_path: Path) -> None:
    # A module connected to a strategy but not attached to a Trainer: Lightning's strategies write the file (its own
    # checkpointing tests do this); ours raised "... is not attached to a `Trainer`" from `save_checkpoint`.
    model = TinyLM()
    written = {}
    for strategy in (L.pytorch.strategies.SingleDeviceStrategy("cpu"), AccumulationStrategy()):
        strategy.connect(model)
        path = tmp_path / f"{type(strategy).__name__}.ckpt"
        strategy.save_checkpoint({"state_dict": model.state_dict()}, path)
        written[type(strategy).__name__] = torch.load(path, weights_only=True)
    entry = written["AccumulationStrategy"]["lightning_accum"]
    assert entry["ledger"]["updates_applied"] == 0 and entry["open_group_microbatches"] == 0
    assert entry["config"] == {  # no Trainer: no A
        "strategy": "AccumulationStrategy",
        "replicas": 1,
        "normalize": "auto",
        "partial_group": "rescale",
    }
    state = written["AccumulationStrategy"]["state_dict"]
    assert all(torch.equal(state[k], v) for k, v in written["SingleDeviceStrategy"]["state_dict"].items())
    fresh = AccumulationStrategy()
    fresh.load_checkpoint(tmp_path / "AccumulationStrategy.ckpt")
    assert fresh.ledger.updates_applied == 0


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


def test_a_group_that_says_it_carried_its_gradient_but_holds_none_is_an_error(tmp_path: Path) -> None:
    # `carried: True` without `gradients`: read before as a group that could not be carried, its first micro-batches
    # were lost with a warning and the run trained on, off the uninterrupted run.
    ckpt = _written_at(tmp_path, 4)
    state = torch.load(ckpt, weights_only=True)
    assert state["lightning_accum"]["open_group"]["carried"] is True
    del state["lightning_accum"]["open_group"]["gradients"]
    torch.save(state, ckpt)
    with pytest.raises(
        ValueError,
        match=r"`open_group.gradients` should be a dict of parameter name -> tensor: the group's \(`open_group.carried`"
        r" is True\), but it is 'missing'",
    ):
        _resume(ckpt, "accum", 3)


def test_a_total_of_micro_batches_that_contradicts_the_counters_is_an_error(tmp_path: Path) -> None:
    # The total over all replicas is the run's micro-batches on each replica plus those carried in from an earlier
    # checkpoint (recorded). Read before as it was, the ledger counted the extra micro-batches (13 instead of 8).
    ckpt = _written_at(tmp_path, 4)
    state = torch.load(ckpt, weights_only=True)
    group = state["lightning_accum"]["open_group"]
    assert (group["microbatches"], group["replicas"], group["carried_microbatches"]) == (2, 1, 0)
    group["total_microbatches"] = 7
    torch.save(state, ckpt)
    with pytest.raises(
        ValueError,
        match=r"`open_group.total_microbatches` should be 2 \(`open_group.carried_microbatches` 0, carried into the"
        r" group from an earlier checkpoint, \+ 2 micro-batch\(es\) on each of 1 replica\(s\)\), but it is 7",
    ):
        _resume(ckpt, "accum", 3)


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


# ---------------------------------------------------------------------------- every damage to a real entry

_DELETE = object()  # the key is removed
_KINDS = ["delete", "none", "wrong type", "negative", "out of range", "inconsistent"]
#: Relations between fields, each broken by one damage: (key path, the damage, the keys an error may name; none:
#: harmless, the resumed run is the undamaged resume).
_INCONSISTENT: list[tuple[tuple[Any, ...], Callable[[Any], Any], tuple[str, ...]]] = [
    (("open_group", "microbatches"), lambda v: v + 1, ("open_group.microbatches",)),
    (("open_group_microbatches",), lambda v: v + 1, ("open_group.microbatches",)),
    (("open_group_microbatches",), lambda v: 0, ("open_group.microbatches",)),
    (("open_group", "total_microbatches"), lambda v: v + 5, ("open_group.total_microbatches",)),
    (("open_group", "total_microbatches"), lambda v: v - 1, ("open_group.total_microbatches",)),
    (("open_group", "carried_microbatches"), lambda v: v + 1, ("open_group.total_microbatches",)),
    (("open_group", "replicas"), lambda v: 2, ("open_group.total_microbatches",)),
    (("open_group", "sums", "units"), lambda v: v + 1, ("open_group.sums.units",)),
    (("open_group", "sums", "tokens_lo"), lambda v: v + 1, ("open_group.sums.units",)),
    (("open_group", "sums", "tokens_hi"), lambda v: v + 1, ("open_group.sums.units",)),
    (("open_group", "sums", "negative"), lambda v: 1.0, ("open_group.sums.negative",)),
    (("open_group", "sums", "units"), lambda v: 0.0, ("open_group.sums.units",)),
    (("open_group", "carried"), lambda v: False, ("open_group.carried",)),
    (("open_group", "gradients_stored"), lambda v: "distributed", ("open_group.gradient_names",)),
    (("open_group", "gradients"), lambda v: {f"{k}x": t for k, t in v.items()}, ("open_group.gradients",)),
    (("open_group", "no_gradient"), lambda v: ["head.bias"], ()),  # listed, yet carried: the gradient is added
    (("ledger", "updates_applied"), lambda v: v + 1, ("ledger.updates_attempted",)),
    (("ledger", "updates_skipped", "overflow"), lambda v: v + 1, ("ledger.updates_attempted",)),
    (("ledger", "normalization"), lambda v: "samples", ("open_group.sums.units",)),
    (("config", "accumulate"), lambda v: v + 1, ()),  # announced as a change of A: nothing is computed from it
    (("config", "replicas"), lambda v: v + 1, ()),
    (("format",), lambda v: 1, ("format",)),
]


def _leaves(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every value of the entry with its path (dict keys, list indices), the entry itself first."""
    yield path, node
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        yield from _leaves(value, (*path, key))


def _shown(path: tuple[Any, ...]) -> str:
    """The key as the package's errors name it: `open_group.gradients['head.bias']`, `slicing.per_rank[0].size`."""
    text = "lightning_accum" if not path else ""
    for i, part in enumerate(path):
        indexed = isinstance(part, int) or (i and path[i - 1] == "gradients")
        text += f"[{part!r}]" if indexed else (f".{part}" if text else part)
    return text


def _damages(kind: str, path: tuple[Any, ...], value: Any) -> list[Any]:
    """The damaged values of one kind for the value at `path` (`_DELETE` removes the key)."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if kind == "delete":
        return [_DELETE] if path else []  # the whole entry removed is the announced case (tested above)
    if kind == "none":
        return [] if value is None else [None]
    if kind == "wrong type":
        return [1 if isinstance(value, str) else "x"]
    if kind == "negative":  # a loss sum may be below 0 (a loss below 0): not a damage
        return [-1 if isinstance(value, int) else -1.0] if number and path[-1] != "weighted_loss" else []
    if kind != "out of range":
        return []
    if isinstance(value, bool):
        return [2]
    if isinstance(value, int):
        return [2**63, 2.5]
    if isinstance(value, float):
        if path[-1] == "weighted_loss":  # a loss sum is whatever the losses were: NaN and inf are not damage
            return []
        counts = path[:2] == ("open_group", "sums")
        return [float("nan"), float("inf"), *([0.5, 2.0**53] if counts else [])]
    if isinstance(value, Tensor):
        return [torch.zeros(3), value.long()]
    if isinstance(value, list):
        return [[1]]
    if isinstance(value, str):
        return ["no such value"]
    return []


def _damaged(state: dict[str, Any], path: tuple[Any, ...], new: Any) -> dict[str, Any]:
    state = copy.deepcopy(state)
    holder: Any = state
    for part in ("lightning_accum", *path)[:-1]:
        holder = holder[part]
    last = ("lightning_accum", *path)[-1]
    if new is _DELETE:
        del holder[last]
    else:
        holder[last] = new
    return state


def _sliced() -> AccumulationStrategy:
    return AccumulationStrategy(microbatch_size=1)  # the entry then also holds the slicing record


@pytest.fixture(scope="module")
def real_entry(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], torch.Tensor, Any]:
    """A checkpoint written inside a group (micro-batches 3, 4 of 3..5, sliced), and the run resumed from it."""
    folder = tmp_path_factory.mktemp("entry")
    ckpt = _written_at(folder, 4, strategy=_sliced())
    trainer, model, _ = _resume(ckpt, _sliced(), 3)
    state = torch.load(ckpt, weights_only=True)
    slicing = state["lightning_accum"]["slicing"]
    slicing["per_rank"] = copy.deepcopy(slicing["per_rank"])  # shared in the file with the top record: apart
    return state, params_vector(model), (trainer.strategy.ledger, trainer.strategy.slicing.state_dict())


@pytest.mark.parametrize("kind", _KINDS)
def test_every_damage_to_a_real_entry_is_an_error_naming_the_key_or_harmless(
    tmp_path: Path, real_entry: tuple[dict[str, Any], Tensor, Any], kind: str
) -> None:
    state, params, (ledger, record) = real_entry  # the undamaged resume: parameters, ledger, slicing record
    if kind == "inconsistent":
        cases = [(path, damage(_at(state, path)), keys) for path, damage, keys in _INCONSISTENT]
    else:
        cases = [
            (path, new, None)
            for path, value in _leaves(state["lightning_accum"])
            for new in _damages(kind, path, value)
        ]
    ckpt = tmp_path / "damaged.ckpt"
    outcomes: dict[str, list[str]] = {"error": [], "harmless": [], "record only": [], "wrong": []}
    for path, new, keys in cases:
        torch.save(_damaged(state, path, new), ckpt)
        label = f"{_shown(path)} = {'deleted' if new is _DELETE else repr(new)[:40]}"
        try:
            trainer, model, _ = _resume(ckpt, _sliced(), 3)
        except ValueError as error:
            named = re.search(r"entry is damaged: `([^`]+)`", str(error))
            key = named.group(1) if named else str(error)[:80]
            related = _names_the_key(key, _shown(path)) if keys is None else any(_names_the_key(key, k) for k in keys)
            outcomes["error" if related else "wrong"].append(f"{label}: names {key}")
            continue
        trained = trainer.strategy.ledger == ledger and torch.allclose(
            params_vector(model), params, rtol=1e-6, atol=1e-8
        )
        recorded = trainer.strategy.slicing.state_dict() == record
        if trained and not recorded and path[:1] == ("slicing",) and not keys:
            # A checkpoint written without `microbatch_size=` holds no slicing record, and the record's counts are
            # free: the training is the undamaged one, only the record of slice sizes (the report's) starts again.
            outcomes["record only"].append(label)
            continue
        outcomes["harmless" if trained and recorded and not keys else "wrong"].append(
            f"{label}: {'same run' if trained else 'resumed differently'}"
        )
    counts = {name: len(found) for name, found in outcomes.items() if name != "wrong"}
    print(f"\n{kind}: {len(cases)} damages, {counts}; harmless: {outcomes['harmless']}, {outcomes['record only']}")
    assert cases and not outcomes["wrong"], outcomes["wrong"]


def _at(state: dict[str, Any], path: tuple[Any, ...]) -> Any:
    value: Any = state["lightning_accum"]
    for part in path:
        value = value.get(part) if isinstance(value, dict) else value[part]
    return value


def _names_the_key(named: str, damaged: str) -> bool:
    """The error names the damaged key, the dict that holds it, or a key inside it."""
    if named == damaged or damaged == "lightning_accum":
        return True
    return any(a.startswith(b) and a[len(b)] in ".[" for a, b in ((named, damaged), (damaged, named)))


# ---------------------------------------------------------------------------- files that cannot be read


def _names_path_size_and_torchs_error(error: ValueError, path: Path, size: str) -> bool:
    """The package's error for a checkpoint torch cannot read: the path, its size and torch's own error (chained)."""
    cause = error.__cause__
    assert cause is not None  # torch's own error, chained
    said = f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
    return str(error) == f"`ckpt_path={str(path)!r}` ({size}) cannot be read: {said}"


@pytest.mark.parametrize("name", ["empty", "one byte", "text", "half", "pickle start", "legacy start", "a pickle"])
def test_a_checkpoint_file_that_cannot_be_read_is_named_with_its_size_and_torchs_error(
    tmp_path: Path, name: str
) -> None:
    # Before the package's error: torch's bare EOFError (empty), an UnpicklingError (one byte), bare errors of its
    # unpickler (text: IndexError "pop from empty list"), "PytorchStreamReader failed reading zip archive" (half), a
    # bare IndexError or EOFError for the start of a pickle (torch's format before zip archives: b"\x80" is a pickle's
    # first opcode without its protocol, b"\x80\x02}" a protocol-2 pickle's first dict without its end), "Invalid
    # magic number" (a whole pickle that is not torch's), none naming the file. Never a silent reset.
    written = _written_at(tmp_path, 4).read_bytes()
    content = {"empty": b"", "one byte": b"x", "text": b"epoch: 3\nloss: 2.5\nstep: 9\n", "half": written[:2000]}
    content.update({"pickle start": b"\x80", "legacy start": b"\x80\x02}"})
    content["a pickle"] = pickle.dumps({"epoch": 3}, protocol=2)
    ckpt = tmp_path / f"{name.replace(' ', '-')}.ckpt"
    ckpt.write_bytes(content[name])
    with pytest.raises(
        ValueError, match=re.escape(f"`ckpt_path={str(ckpt)!r}` ({len(content[name])} byte(s))")
    ) as caught:
        _resume(ckpt, "accum", 3)
    assert _names_path_size_and_torchs_error(caught.value, ckpt, f"{len(content[name])} byte(s)")


def test_a_missing_file_is_lightnings_error_and_torchs_advice_is_kept(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found"):  # Lightning's own
        _resume(tmp_path / "never-written.ckpt", "accum", 3)
    # A whole checkpoint holding an object `weights_only=True` refuses: torch's error, and its advice, in the message.
    # (Lightning 2.5 reads checkpoints with `weights_only=False`: the object is loaded there, nothing to refuse.)
    state = torch.load(_written_at(tmp_path, 4), weights_only=True)
    state["note"] = contextlib.nullcontext()
    torch.save(state, tmp_path / "with-an-object.ckpt")
    if tuple(int(v) for v in L.__version__.split(".")[:2]) >= (2, 6):
        with pytest.raises(ValueError, match=r"(?s)cannot be read: UnpicklingError: .*weights_only") as caught:
            _resume(tmp_path / "with-an-object.ckpt", "accum", 3)
        assert isinstance(caught.value.__cause__, pickle.UnpicklingError)


class _ShardedTinyLM(TinyLM):
    """TinyLM (AdamW: Lightning's FSDP2 loader needs an optimizer state) that shards itself with FSDP2 in
    `configure_model`; `on_one_device=False` leaves it whole on a mesh of one device, as some user code does."""

    def __init__(self, on_one_device: bool = True) -> None:
        super().__init__(lr=0.3, optimizer="adamw")
        self.on_one_device = on_one_device

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if mesh is None or (mesh["data_parallel"].size() == 1 and not self.on_one_device):
            return
        from torch.distributed.fsdp import fully_shard

        for module in (self.embed, self.head):
            fully_shard(module, mesh=mesh["data_parallel"])


class _SaveAt(L.Callback):
    def __init__(self, path: Path, batch_idx: int) -> None:
        self.path, self.batch_idx = path, batch_idx

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if args[-1] == self.batch_idx:
            trainer.save_checkpoint(self.path)


def _sharded_fit(devices: int, model: L.LightningModule, callbacks: list[L.Callback], ckpt: Path | None) -> L.Trainer:
    from lightning_accum import ModelParallelAccumulationStrategy

    trainer = make_trainer(
        strategy=ModelParallelAccumulationStrategy(tensor_parallel_size=1),  # a sharded folder (Lightning's default)
        devices=devices,
        accumulate_grad_batches=2,
        callbacks=callbacks,
        use_distributed_sampler=False,
    )
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    loader = ResumableLoader(ListDataset(_EXAMPLES[rank::devices]), batch_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's resume notes
        trainer.fit(model, loader, ckpt_path=ckpt)
    return trainer


def _write_sharded_folder(rank: int, folder: str) -> None:
    # Inside the group of micro-batches 2, 3 (after the first update: Lightning's FSDP2 loader needs an optimizer
    # state).
    _sharded_fit(2, _ShardedTinyLM(), [_SaveAt(Path(folder, "inside.ckpt"), 2)], None)


def _read_on_one_device(rank: int, folder: str) -> None:
    said = {}
    for name, model, ckpt in (
        ("unsharded model", _ShardedTinyLM(on_one_device=False), "inside.ckpt"),
        ("shard cut short", _ShardedTinyLM(), "cut.ckpt"),
        ("shard cut to 90 %", _ShardedTinyLM(), "cut90.ckpt"),
        ("sharded model", _ShardedTinyLM(), "inside.ckpt"),
    ):
        try:
            trainer = _sharded_fit(1, model, [], Path(folder, ckpt))
            said[name] = f"resumed: {trainer.strategy.ledger.microbatches} micro-batches"
        except ValueError as error:
            said[name] = f"{error} (from {type(error.__cause__).__name__})"
    Path(folder, "said.json").write_text(json.dumps(said))


_WAY_OUT = re.escape(
    "Resume it with strategy='accum_fsdp' (or ModelParallelAccumulationStrategy) on a model sharded in"
    " `configure_model`, or write single files with save_distributed_checkpoint=False."
)


def test_a_folder_a_strategy_cannot_read_is_refused_before_the_read(tmp_path: Path) -> None:
    # Before: IsADirectoryError from torch's read, for both folders.
    folder = tmp_path / "not-a-checkpoint"
    folder.mkdir()
    (folder / "notes.txt").write_text("epoch 3")
    with pytest.raises(
        ValueError,
        match=re.escape(f"`ckpt_path={str(folder)!r}` is a folder that is not a checkpoint")
        + r".* Give `ckpt_path` the checkpoint file",
    ):
        _resume(folder, "accum", 3)
    # A sharded folder's layout (torch's index of the shards, Lightning's metadata file) under a single-file strategy.
    sharded = tmp_path / "sharded.ckpt"
    sharded.mkdir()
    (sharded / ".metadata").write_bytes(b"")
    (sharded / "meta.pt").write_bytes(b"")
    with pytest.raises(
        ValueError,
        match=re.escape(f"`ckpt_path={str(sharded)!r}` is a sharded (distributed) checkpoint folder;")
        + r" AccumulationStrategy reads single files only\. "
        + _WAY_OUT,
    ):
        _resume(sharded, "accum", 3)


@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_a_sharded_folder_that_cannot_be_read_is_refused_with_the_way_out(tmp_path: Path) -> None:
    run_ddp(_write_sharded_folder, str(tmp_path))  # accum_fsdp on 2 devices: a sharded folder
    folder = tmp_path / "inside.ckpt"
    assert folder.is_dir()
    # A strategy that reads single files (before: IsADirectoryError).
    with pytest.raises(
        ValueError,
        match=re.escape(f"`ckpt_path={str(folder)!r}` is a sharded (distributed) checkpoint folder;")
        + r" AccumulationStrategy reads single files only\. "
        + _WAY_OUT,
    ):
        _resume(folder, "accum", 2)
    # One shard cut in half (before: torch's CheckpointException around "failed reading zip archive"), and cut to 90 %:
    # Lightning's read of the model and the optimizer then succeeds, and the package's own read of the open group's
    # gradient, stored last, fails (before: torch's CheckpointException around the same zip error, not named): both
    # named with the folder's size and torch's error.
    for name, kept in (("cut.ckpt", 0.5), ("cut90.ckpt", 0.9)):
        shutil.copytree(folder, tmp_path / name)
        shard = max((tmp_path / name).glob("*.distcp"), key=lambda p: p.stat().st_size)
        shard.write_bytes(shard.read_bytes()[: int(shard.stat().st_size * kept)])
    run_ddp(_read_on_one_device, str(tmp_path), world_size=1)
    said = json.loads((tmp_path / "said.json").read_text())
    # On one device the folder resumes into a model sharded on its mesh of one ...
    assert said["sharded model"] == "resumed: 11 micro-batches", said  # 2 x 2, then 2 carried + 1, then 2 x 2
    # ... and a model left whole gets what to do (before: Lightning's "Could not find a distributed model").
    assert re.search(
        r"is a sharded \(distributed\) checkpoint folder, and this run's model has no sharded \(DTensor\) parameter on"
        r" its 1 device\(s\) \(Lightning: 'Could not find a distributed model'\)\. " + _WAY_OUT,
        said["unsharded model"],
    ), said
    for name, case in (("cut.ckpt", "shard cut short"), ("cut90.ckpt", "shard cut to 90 %")):
        files = [p for p in (tmp_path / name).rglob("*") if p.is_file()]
        size = f"a folder of {len(files)} file(s), {sum(p.stat().st_size for p in files)} byte(s)"
        # The folder, its size and torch's own error (which names the failed read of the shard).
        assert said[case].startswith(f"`ckpt_path={str(tmp_path / name)!r}` ({size}) cannot be read: "), said
        assert said[case].endswith("(from CheckpointException)"), said


@pytest.mark.parametrize("build", ["float32", "float64", "init_module"])
def test_a_float64_resume_is_exact_only_for_a_module_built_in_float64(tmp_path: Path, build: str) -> None:
    # Plain Lightning's order: the checkpoint's weights are loaded into the module before `precision="64-true"`
    # converts it, so a module built in float32 resumes from weights rounded to float32 (docs/howto.md, "What a
    # checkpoint holds"). Built in float64, or inside `trainer.init_module()`, the resume is exact.
    examples = make_examples(random_lengths(16, seed=7), seed=7)

    def run(ckpt_path: Path | None = None, epochs: int = 2) -> tuple[L.Trainer, TinyLM]:
        trainer = make_trainer(precision="64-true", accumulate_grad_batches=2, max_epochs=epochs)
        if build == "init_module":
            with trainer.init_module():
                model = TinyLM(lr=0.5, optimizer="adamw")
        else:
            model = TinyLM(lr=0.5, optimizer="adamw")
            model = model.double() if build == "float64" else model
        trainer.fit(model, DataLoader(ListDataset(examples), batch_size=2), ckpt_path=ckpt_path)
        return trainer, model

    _, whole = run()
    first, _ = run(epochs=1)  # 4 updates, then a checkpoint at the epoch's end
    first.save_checkpoint(tmp_path / "epoch1.ckpt")
    resumed_trainer, resumed = run(ckpt_path=tmp_path / "epoch1.ckpt")
    assert resumed_trainer.strategy.ledger.updates_applied == 8
    error = relative_error(params_vector(resumed), params_vector(whole))
    if build == "float32":
        assert 1e-9 < error < 1e-6, error  # the weights went through float32 once: 2e-8
    else:
        assert error <= 1e-12, error
