"""Reliability: changing A mid-run, runaway skips, replicas that disagree, LightningCLI configuration."""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from helpers import (
    ListDataset,
    TinyLM,
    fit,
    make_examples,
    params_vector,
    random_lengths,
    relative_error,
    run_ddp,
    sgd_reference,
)
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, IterableDataset

from lightning_accum import AccumulationStrategy, DDPAccumulationStrategy


def test_gradient_accumulation_scheduler_keeps_groups_exact_on_both_sides() -> None:
    # Epoch 0 with A = 2, epoch 1 with A = 3 (Lightning's GradientAccumulationScheduler): 6 micro-batches of 2.
    examples = make_examples(random_lengths(12, seed=30), seed=30)
    model = TinyLM(lr=0.5)
    groups = [examples[0:4], examples[4:8], examples[8:12], examples[0:6], examples[6:12]]
    expected = sgd_reference(model, groups, lr=0.5)
    scheduler = GradientAccumulationScheduler({0: 2, 1: 3})
    trainer = fit(model, examples, batch_size=2, accumulate=1, callbacks=[scheduler], max_epochs=2)
    assert relative_error(params_vector(model), expected) < 1e-5
    ledger = trainer.strategy.ledger
    assert (ledger.updates_applied, ledger.partial_groups, ledger.microbatches) == (5, 0, 12)


class _AlwaysNaN(TinyLM):
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        out["loss"] = out["loss"] * float("nan")
        return out


def test_nan_in_every_group_stops_after_max_consecutive_skips() -> None:
    strategy = AccumulationStrategy(max_consecutive_skips=3)
    with (
        pytest.warns(UserWarning, match=r"skipped update \d"),
        pytest.raises(RuntimeError, match=r"3 consecutive updates were skipped \(the last for 'nonfinite'"),
    ):
        fit(_AlwaysNaN(), make_examples([4] * 20), batch_size=2, accumulate=2, strategy=strategy)
    ledger = strategy.ledger
    assert (ledger.updates_attempted, ledger.updates_applied, ledger.updates_skipped["nonfinite"]) == (3, 0, 3)
    with pytest.raises(ValueError, match=r"`max_consecutive_skips` must be a positive int or None, got 0"):
        AccumulationStrategy(max_consecutive_skips=0)


def test_an_applied_update_resets_the_consecutive_count() -> None:
    class _NaNEveryOther(TinyLM):
        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
            out = super().training_step(batch, batch_idx)
            if (batch_idx // 2) % 2 == 0:
                out["loss"] = out["loss"] * float("nan")
            return out

    strategy = AccumulationStrategy(max_consecutive_skips=2)
    with pytest.warns(UserWarning, match=r"skipped update"):
        fit(_NaNEveryOther(), make_examples([4] * 16), batch_size=2, accumulate=2, strategy=strategy)
    assert (strategy.ledger.updates_applied, strategy.ledger.updates_skipped["nonfinite"]) == (2, 2)


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (2.5, TypeError, r"`num_tokens` must be an int or a 0-d integer tensor, got float"),
        (True, TypeError, r"`num_tokens` must be an integer count, got a boolean"),
        (-1, ValueError, r"`num_tokens` must be >= 0, got -1"),
        (torch.tensor(float("nan")), TypeError, r"got a tensor of dtype torch.float32"),
        (torch.tensor(-3), ValueError, r"A negative `num_tokens` or `num_samples` was reported in this group"),
        (torch.tensor(3, device="meta"), ValueError, r"`num_tokens` is a tensor on the meta device"),
    ],
)
def test_hostile_token_counts_in_a_real_run(value: object, error: type[Exception], match: str) -> None:
    class _Reports(TinyLM):
        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
            return {"loss": self.mean_loss(batch), "num_tokens": value}

    model = _Reports()
    before = params_vector(model)
    with pytest.raises(error, match=match):
        fit(model, make_examples([3, 4, 5, 6]), batch_size=1, accumulate=2)
    assert torch.equal(params_vector(model), before)  # nothing was applied


def test_samples_that_cannot_be_inferred_under_normalize_samples_in_a_real_run() -> None:
    def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        batch = {key: torch.stack([item[key] for item in items]) for key in items[0]}
        batch["boundaries"] = torch.arange(len(items) + 1)  # another leading size: the sample count is ambiguous
        return batch

    model = TinyLM(report="loss")
    before = params_vector(model)
    trainer = L.Trainer(
        strategy=AccumulationStrategy(normalize="samples"),
        accelerator="cpu",
        accumulate_grad_batches=2,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = DataLoader(ListDataset(make_examples([3, 4, 5, 6])), batch_size=2, collate_fn=collate)
    with pytest.raises(ValueError, match=r"number of samples of this micro-batch cannot be inferred .* 'num_samples'"):
        trainer.fit(model, loader)
    assert torch.equal(params_vector(model), before)


# ---------------------------------------------------------------------------- replicas that disagree


class _Shard(IterableDataset):
    """Rank r yields `counts[r]` batches: an unevenly sharded stream."""

    def __init__(self, counts: tuple[int, int]) -> None:
        self.counts = counts

    def __iter__(self) -> Any:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        examples = make_examples([4] * (2 * self.counts[rank]), seed=rank)
        for i in range(self.counts[rank]):
            chunk = examples[2 * i : 2 * i + 2]
            yield {k: torch.stack([e[k] for e in chunk]) for k in ("input_ids", "labels")}


class _TokensOnRankZero(TinyLM):
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        return out if self.global_rank == 0 else out["loss"]


def _ddp_trainer(
    strategy: Any, accumulate: int, max_epochs: int = 1, callbacks: list[L.Callback] | None = None
) -> L.Trainer:
    """A 2-process CPU Trainer for run_ddp workers; each rank reads its own data (no distributed sampler)."""
    return L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        accumulate_grad_batches=accumulate,
        max_epochs=max_epochs,
        logger=False,
        callbacks=callbacks or [],
        enable_checkpointing=bool(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )


def _disagreeing_runs(rank: int, folder: str) -> None:
    messages = {}
    for name, model, counts in (("units", _TokensOnRankZero(), (4, 4)), ("uneven", TinyLM(), (6, 4))):
        trainer = _ddp_trainer("accum_ddp", accumulate=2)
        try:
            trainer.fit(model, DataLoader(_Shard(counts), batch_size=None))
            messages[name] = "no error"
        except RuntimeError as err:
            messages[name] = str(err)
    Path(folder, f"rank{rank}.json").write_text(json.dumps(messages))


@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_replicas_that_disagree_get_an_error_not_a_hang(tmp_path: Path) -> None:
    run_ddp(_disagreeing_runs, str(tmp_path))
    for rank in (0, 1):
        messages = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "Replicas weight micro-batches by different units" in messages["units"], messages
        assert "The training data of 1 of 2 replicas ended with this accumulation group" in messages["uneven"]


def _uneven_inside_a_group(rank: int, folder: str) -> None:
    import datetime

    strategy = DDPAccumulationStrategy(start_method="popen", timeout=datetime.timedelta(seconds=10))
    trainer = _ddp_trainer(strategy, accumulate=3)
    result = {"error": "no error", "hint": False}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(TinyLM(), DataLoader(_Shard((5, 4)), batch_size=None))
        except RuntimeError as err:
            result["error"] = str(err)
    result["hint"] = any("collective timed out" in str(w.message) for w in caught)
    Path(folder, f"inside-rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.ddp
@pytest.mark.timeout(120)
def test_data_that_ends_inside_a_group_unevenly_ends_at_the_timeout_with_a_hint(tmp_path: Path) -> None:
    # 5 vs 4 batches with A = 3: the replicas' data ends inside the same group at different micro-batches. That
    # cannot be caught without a collective per micro-batch (their collectives pair up wrongly first); what the
    # package guarantees is that the strategy's `timeout=` bounds the wait and every rank says what to look at.
    run_ddp(_uneven_inside_a_group, str(tmp_path))
    for rank in (0, 1):
        result = json.loads((tmp_path / f"inside-rank{rank}.json").read_text())
        assert result["error"] != "no error" and result["hint"], result


# ---------------------------------------------------------------------------- LightningCLI


class CLIModel(TinyLM):
    """TinyLM with its own data, for LightningCLI."""

    def __init__(self, lr: float = 0.5) -> None:
        super().__init__(lr=lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(ListDataset(make_examples(random_lengths(12, seed=40), seed=40)), batch_size=2)


def run_cli(tmp_path: Path, config: str, monkeypatch: pytest.MonkeyPatch) -> LightningCLI:
    path = tmp_path / "config.yaml"
    path.write_text(config)
    monkeypatch.setattr(sys, "argv", ["train.py"])  # the CLI reads its arguments from `args` alone
    return LightningCLI(
        CLIModel,
        seed_everything_default=0,
        args=["fit", "--config", str(path)],
        save_config_callback=None,
        trainer_defaults={"accelerator": "cpu", "logger": False, "enable_checkpointing": False},
    )


COMMON = """
trainer:
  max_epochs: 1
  accumulate_grad_batches: 3
  enable_progress_bar: false
  enable_model_summary: false
"""


def test_cli_selects_the_strategy_by_string(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cli = run_cli(tmp_path, COMMON + "  strategy: accum\n", monkeypatch)
    assert type(cli.trainer.strategy).__name__ == "AccumulationStrategy"
    assert cli.trainer.strategy.ledger.updates_applied == 2


def test_cli_selects_the_strategy_by_class_path_with_arguments_and_the_callbacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = (
        COMMON
        + f"""  default_root_dir: {tmp_path}
  strategy:
    class_path: lightning_accum.AccumulationStrategy
    init_args:
      normalize: samples
      partial_group: drop
  callbacks:
    - class_path: lightning_accum.AccumulationReport
      init_args:
        path: {tmp_path}/report
    - class_path: lightning_accum.AccumulationCheck
      init_args:
        strict: false
"""
    )
    with pytest.warns(
        UserWarning, match=r"AccumulationCheck failed"
    ):  # samples on padded data: token weighting missing
        cli = run_cli(tmp_path, config, monkeypatch)
    strategy = cli.trainer.strategy
    assert (strategy.engine.normalize, strategy.engine.partial_group) == ("samples", "drop")
    record = json.loads((tmp_path / "report" / "accumulation_report.json").read_text())
    assert record["normalization"] == "samples" and record["updates"]["applied"] == 2


def test_cli_invalid_values_give_the_packages_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad_strategy = (
        COMMON
        + """  strategy:
    class_path: lightning_accum.AccumulationStrategy
    init_args:
      normalize: mean
"""
    )
    with pytest.raises(
        ValueError, match=r"`normalize` must be one of 'auto', 'tokens', 'samples', 'batches'; got 'mean'"
    ):
        run_cli(tmp_path, bad_strategy, monkeypatch)
    bad_callback = (
        COMMON
        + """  strategy: accum
  callbacks:
    - class_path: lightning_accum.AxisLogger
      init_args:
        axis: steps
"""
    )
    with pytest.raises(ValueError, match=r"`axis` must be one of 'tokens', 'samples', 'updates'; got 'steps'"):
        run_cli(tmp_path, bad_callback, monkeypatch)


# ---------------------------------------------------------------------------- resume


class ResumableLoader(DataLoader):
    """A DataLoader that Lightning can checkpoint mid-epoch (it has `state_dict`/`load_state_dict`): on restore it
    skips the batches the interrupted epoch already consumed. Plain DataLoaders restart the epoch's data from its
    start on a mid-epoch resume (Lightning's behaviour), so exact mid-epoch resumption needs one like this (or
    torchdata's StatefulDataLoader)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.consumed = 0
        self.skip = 0

    def __iter__(self) -> Any:
        skip, self.skip = self.skip, 0
        self.consumed = 0
        for i, batch in enumerate(super().__iter__()):
            if i < skip:
                continue
            self.consumed = i + 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skip = int(state["consumed"])


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
        return L.Trainer(
            strategy=AccumulationStrategy(partial_group=policy),
            accelerator="cpu",
            accumulate_grad_batches=3,
            max_epochs=max_epochs,
            logger=False,
            callbacks=callbacks,
            enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
            enable_progress_bar=False,
            enable_model_summary=False,
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
            os.kill(os.getpid(), signal.SIGTERM)
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

    return L.Trainer(
        strategy=AccumulationStrategy(partial_group=policy),
        accelerator="cpu",
        accumulate_grad_batches=3,
        max_epochs=2,
        logger=False,
        callbacks=[OnExceptionCheckpoint(dirpath=folder, filename="interrupted")] if folder else [],
        enable_checkpointing=folder is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
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
    lost = [m for m in messages if "resumed at micro-batch 2 of an accumulation group" in m]
    assert len(lost) == 1 and "carries 2 micro-batch(es) of that group without a consistent gradient" in lost[0]
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

    trainer = _ddp_trainer(strategy, accumulate=2, max_epochs=max_epochs, callbacks=callbacks)
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


def _ddp_mid_group_runs(rank: int, folder: str) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    examples = make_examples(random_lengths(20, seed=61), seed=61)  # 5 micro-batches of 2 per rank: groups 2, 2, 1

    def run(callbacks: list[L.Callback], ckpt: str | None, interrupt: Any = None) -> tuple[L.Trainer, _Interrupted]:
        model = _Interrupted(interrupt, folder)
        strategy = DDPAccumulationStrategy(partial_group="drop", start_method="popen")
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
        }
    results["lr"] = whole.optimizers[0].param_groups[0]["lr"]
    torch.save(results, f"{folder}/mid-group-rank{rank}.pt")


@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_ddp_resume_with_drop_at_a_boundary_and_inside_a_group(tmp_path: Path) -> None:
    run_ddp(_ddp_mid_group_runs, str(tmp_path))
    for rank in (0, 1):
        result = torch.load(tmp_path / f"mid-group-rank{rank}.pt", weights_only=True)
        ledger = result["ledger"]
        # 2 epochs x (2 full groups + 1 dropped partial group of 1 micro-batch on each of the 2 replicas)
        assert (ledger["updates_applied"], ledger["dropped_microbatches"], ledger["microbatches"]) == (4, 4, 16)
        for name, open_microbatches in (("boundary", 0), ("mid_group", 1)):
            resumed = result[name]
            assert resumed["open"] == open_microbatches
            assert resumed["same_ledger"], (name, ledger)
            assert resumed["lr"] == result["lr"]
            torch.testing.assert_close(resumed["params"], result["whole"], rtol=1e-6, atol=1e-7)
