"""strategies/checkpoint: the Trainer's checkpoints: resumed at an update boundary, and under DDP inside a group too;
written by the survivors when a peer dies; written without a Trainer; resumed in float64."""

from __future__ import annotations

import contextlib
import os
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


# ---------------------------------------------------------------------------- without a Trainer; float64


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
