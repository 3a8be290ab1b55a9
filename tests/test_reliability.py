"""Reliability: changing A mid-run, runaway skips, replicas that disagree, LightningCLI configuration."""

from __future__ import annotations

import json
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

from lightning_accum import AccumulationStrategy


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


def _disagreeing_runs(rank: int, folder: str) -> None:
    messages = {}
    for name, model, counts in (("units", _TokensOnRankZero(), (4, 4)), ("uneven", TinyLM(), (6, 4))):
        trainer = L.Trainer(
            strategy="accum_ddp",
            accelerator="cpu",
            devices=2,
            accumulate_grad_batches=2,
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,
        )
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


class _StopMidGroup(TinyLM):
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        if batch_idx == 4:  # the 2nd micro-batch of the 2nd group (A = 3)
            raise RuntimeError("killed mid-group")
        return super().training_step(batch, batch_idx)


def test_a_checkpoint_written_inside_a_group_says_so(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    examples = make_examples(random_lengths(12, seed=51), seed=51)
    on_exception = OnExceptionCheckpoint(dirpath=tmp_path, filename="interrupted")
    with warnings.catch_warnings(record=True) as caught, pytest.raises(RuntimeError, match="killed mid-group"):
        warnings.simplefilter("always")
        first = L.Trainer(
            strategy="accum",
            accelerator="cpu",
            accumulate_grad_batches=3,
            max_epochs=1,
            logger=False,
            callbacks=[on_exception],
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        first.fit(_StopMidGroup(), ResumableLoader(ListDataset(examples), batch_size=2))
    assert any("written inside an accumulation group, after 1 micro-batch" in str(w.message) for w in caught)
    state = torch.load(tmp_path / "interrupted.ckpt", weights_only=True)["lightning_accum"]
    assert state["open_group_microbatches"] == 1 and state["ledger"]["updates_applied"] == 1
    resumed = L.Trainer(
        strategy="accum",
        accelerator="cpu",
        accumulate_grad_batches=3,
        max_epochs=1,
        logger=False,
        callbacks=[OnExceptionCheckpoint(dirpath=tmp_path)],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.warns(UserWarning, match=r"resuming from a checkpoint written inside an accumulation group"):
        resumed.fit(
            TinyLM(), ResumableLoader(ListDataset(examples), batch_size=2), ckpt_path=tmp_path / "interrupted.ckpt"
        )
    assert resumed.strategy.ledger.updates_applied >= 1


def _ddp_resume_runs(rank: int, folder: str) -> None:
    from helpers import RankStridedSampler
    from lightning.pytorch.callbacks import ModelCheckpoint

    examples = make_examples(random_lengths(20, seed=60), seed=60)  # 5 micro-batches of 2 per rank, A = 2

    def run(max_epochs: int, callbacks: list[L.Callback], ckpt: str | None) -> tuple[L.Trainer, TinyLM]:
        model = _PoisonOnce(bad=2)
        trainer = L.Trainer(
            strategy="accum_ddp",
            accelerator="cpu",
            devices=2,
            accumulate_grad_batches=2,
            max_epochs=max_epochs,
            logger=False,
            callbacks=callbacks,
            enable_checkpointing=bool(callbacks),
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,
        )
        loader = ResumableLoader(ListDataset(examples), batch_size=2, sampler=RankStridedSampler(len(examples)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the skipped-update warning, Lightning's resume notes
            trainer.fit(model, loader, ckpt_path=ckpt)
        return trainer, model

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
