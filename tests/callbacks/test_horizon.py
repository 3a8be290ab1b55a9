"""Horizon: a token budget, validation and checkpoints every N tokens, the same for every split of the data."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from helpers import ListDataset, ResumableLoader, make_examples, params_vector, random_lengths
from horizon_helpers import HorizonLM, Trace, load_json, loaders, reference_points, trainer_for
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

import lightning_accum
from lightning_accum import AccumulationStrategy, AxisLR, Horizon, TokenBatches, warmup_cosine

LENGTHS = random_lengths(48, seed=7)
EXAMPLES = make_examples(LENGTHS, seed=7)
BASE_LR = 0.5
STOP, VALIDATE, CHECKPOINT = 300, 70, 100
SCHEDULE = warmup_cosine(warmup=60, total=STOP, min_ratio=0.1)


def group_tokens(per_update: int) -> list[int]:
    """Supervised tokens of each update of one epoch (consecutive examples; padding is not supervised)."""
    return [sum(LENGTHS[i : i + per_update]) for i in range(0, len(LENGTHS), per_update)]


def expected_run(per_update: int, validate: int = VALIDATE, checkpoint: int = CHECKPOINT) -> dict[str, Any]:
    counts, validations = reference_points(group_tokens(per_update), STOP, validate)
    _, checkpoints = reference_points(group_tokens(per_update), STOP, checkpoint)
    before = [0, *counts[:-1]]
    return {
        "stop": counts[-1],
        # Lightning also validates when training is asked to stop (as after EarlyStopping): one run at the stop.
        "validations": sorted({*validations, counts[-1]}),
        "checkpoints": checkpoints,
        "lrs": [BASE_LR * SCHEDULE(n) for n in before],
        "tokens_before": before,
    }


def checkpoint_counts(folder: Path) -> list[int]:
    return sorted(int(path.stem.split("=")[1]) for path in folder.glob("tokens=*.ckpt"))


def horizon() -> Horizon:
    return Horizon(axis="tokens", stop_at=STOP, validate_every=VALIDATE, checkpoint_every=CHECKPOINT)


def run_single(m: int, accumulate: int, folder: Path) -> tuple[L.Trainer, Trace, Horizon]:
    trace, budget = Trace(), horizon()
    # Checkpoints go to the ModelCheckpoint's folder (it writes none of its own here).
    callbacks = [trace, budget, ModelCheckpoint(dirpath=folder, save_top_k=0)]
    trainer = trainer_for(accumulate, callbacks, enable_checkpointing=True)
    trainer.fit(HorizonLM(lr_lambda=SCHEDULE, lr=BASE_LR, seed=3), *loaders(EXAMPLES, m))
    return trainer, trace, budget


def test_splits_stop_validate_checkpoint_and_schedule_at_the_same_token_counts(tmp_path: Path) -> None:
    expected = expected_run(per_update=8)
    assert len(expected["validations"]) >= 4 and len(expected["checkpoints"]) >= 2  # the test has points to check
    for m, accumulate in ((4, 2), (2, 4)):
        folder = tmp_path / f"m{m}a{accumulate}"
        trainer, trace, budget = run_single(m, accumulate, folder)
        ledger = trainer.strategy.ledger
        assert ledger.tokens == expected["stop"] >= STOP, (m, accumulate)
        assert ledger.tokens - ledger.last_group.tokens < STOP  # the first update boundary at the budget
        assert ledger.microbatches == len(trace.updates) * m * accumulate // m  # no group started past it
        assert trace.validations == expected["validations"], (m, accumulate)
        assert checkpoint_counts(folder) == expected["checkpoints"], (m, accumulate)
        assert [Path(p).name for p in budget.checkpoints] == [f"tokens={c}.ckpt" for c in expected["checkpoints"]]
        assert [u["tokens_before"] for u in trace.updates] == expected["tokens_before"]
        torch.testing.assert_close([u["lr"] for u in trace.updates], expected["lrs"], rtol=1e-12, atol=0.0)
        state = torch.load(folder / f"tokens={expected['checkpoints'][0]}.ckpt", weights_only=True)
        assert state["lightning_accum"]["ledger"]["tokens"] == expected["checkpoints"][0]
        assert state["callbacks"][budget.state_key]["next_checkpoint"] == 2 * CHECKPOINT


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_ddp_split_gives_the_same_stop_schedule_validations_and_checkpoints(tmp_path: Path) -> None:
    expected = expected_run(per_update=8)
    folder = tmp_path / "ckpt"
    trace = Trace(str(tmp_path / "trace-{rank}.json"))
    callbacks = [trace, horizon(), ModelCheckpoint(dirpath=folder, save_top_k=0)]
    # m = 2, A = 2, D = 2: rank r reads examples r, r + 2, ...; each update holds the same 8 examples as above.
    trainer = trainer_for(2, callbacks, devices=2, strategy="accum_ddp_spawn", enable_checkpointing=True)
    model = HorizonLM(lr_lambda=SCHEDULE, lr=BASE_LR, seed=3)
    trainer.fit(model, *loaders(EXAMPLES, 2, distributed=True))

    result, other = (load_json(tmp_path / f"trace-{rank}.json") for rank in (0, 1))
    assert other["updates"] == result["updates"] and other["validations"] == result["validations"]  # every rank
    assert result["ledger"]["tokens"] == expected["stop"]
    assert trainer.strategy.ledger.tokens == expected["stop"]  # brought back to the main process
    assert result["validations"] == expected["validations"]
    assert checkpoint_counts(folder) == expected["checkpoints"]
    assert [u["tokens_before"] for u in result["updates"]] == expected["tokens_before"]
    torch.testing.assert_close([u["lr"] for u in result["updates"]], expected["lrs"], rtol=1e-12, atol=0.0)
    # And the parameters agree with the one-process split (same updates, another order of summation).
    single, _, _ = run_single(4, 2, tmp_path / "single")
    torch.testing.assert_close(
        torch.tensor(result["params"], dtype=torch.float64),
        params_vector(single.lightning_module),
        rtol=1e-5,
        atol=1e-6,
    )


def test_resume_from_a_checkpoint_every_file_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    # checkpoint_every = 2 × validate_every: every checkpoint falls on a validation's update and is written after it.
    validate, checkpoint = 50, 100
    expected = expected_run(per_update=8, validate=validate, checkpoint=checkpoint)

    def run(folder: Path, ckpt_path: Path | None = None) -> tuple[L.Trainer, Trace, HorizonLM]:
        trace = Trace()
        budget = Horizon(stop_at=STOP, validate_every=validate, checkpoint_every=checkpoint, dirpath=folder)
        model = HorizonLM(lr_lambda=SCHEDULE, lr=0.05, seed=5, optimizer="adamw")
        trainer = trainer_for(2, [trace, budget])
        trainer.fit(model, *loaders(EXAMPLES, 4, loader_class=ResumableLoader), ckpt_path=ckpt_path)
        return trainer, trace, model

    whole, whole_trace, whole_model = run(tmp_path / "whole")
    assert checkpoint_counts(tmp_path / "whole") == expected["checkpoints"]
    assert whole_trace.validations == expected["validations"]
    mid = expected["checkpoints"][1]  # mid-budget and mid-epoch (an epoch holds 176 tokens)
    assert mid % sum(LENGTHS) != 0 and mid < STOP
    # Written after the validation of its own update: what follows validation (EarlyStopping, best scores) is in it.
    assert mid in whole_trace.validations
    saved = torch.load(tmp_path / "whole" / f"tokens={mid}.ckpt", weights_only=True)
    assert saved["validation_runs"] == len([v for v in whole_trace.validations if v <= mid])

    resumed, resumed_trace, resumed_model = run(
        tmp_path / "resumed", ckpt_path=tmp_path / "whole" / f"tokens={mid}.ckpt"
    )
    assert resumed.strategy.ledger == whole.strategy.ledger
    torch.testing.assert_close(params_vector(resumed_model), params_vector(whole_model), rtol=1e-6, atol=1e-7)
    whole_lr, resumed_lr = (t.optimizers[0].param_groups[0]["lr"] for t in (whole, resumed))
    assert resumed_lr == whole_lr
    assert (
        resumed.lr_scheduler_configs[0].scheduler.state_dict() == whole.lr_scheduler_configs[0].scheduler.state_dict()
    )
    # The remaining points: validations and checkpoints after `mid`, at the same counts; none repeated at `mid`.
    assert resumed_trace.validations == [v for v in whole_trace.validations if v > mid]
    assert checkpoint_counts(tmp_path / "resumed") == [c for c in expected["checkpoints"] if c > mid]
    assert [u["lr"] for u in resumed_trace.updates] == [
        u["lr"] for u in whole_trace.updates if u["tokens_before"] >= mid
    ]


def test_progress_bar_shows_the_budget(tmp_path: Path) -> None:
    seen: list[str] = []

    class Peek(L.Callback):
        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            assert trainer.progress_bar_callback is not None
            metrics = trainer.progress_bar_callback.get_metrics(trainer, pl_module)
            seen.extend([metrics["budget"], metrics["seen"]])

    budget = Horizon(stop_at=STOP)
    # Beside AxisLogger, which adds its own fields to the bar.
    callbacks = [lightning_accum.AxisLogger(), budget, Peek()]
    trainer = trainer_for(2, callbacks, enable_progress_bar=True, default_root_dir=tmp_path)
    trainer.fit(HorizonLM(), *loaders(EXAMPLES, 4))
    tokens = trainer.strategy.ledger.tokens
    assert seen == [f"{tokens}/{STOP} tok", f"{tokens} tok"]
    assert "budget" not in trainer.progress_bar_callback.get_metrics(trainer, trainer.lightning_module)  # teardown


def test_samples_and_updates_axes_and_checkpoints_beside_the_root_dir(tmp_path: Path) -> None:
    budget = Horizon(axis="samples", stop_at=20, checkpoint_every=16)
    trainer = trainer_for(2, [budget], default_root_dir=tmp_path)
    trainer.fit(HorizonLM(report="samples"), *loaders(EXAMPLES, 4))
    assert trainer.strategy.ledger.samples == 24  # 8 samples per update: the first boundary at or past 20
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["samples=16.ckpt"]

    updates = Horizon(axis="updates", stop_at=3)
    trainer = trainer_for(2, [updates])
    trainer.fit(HorizonLM(), *loaders(EXAMPLES, 4))
    assert trainer.strategy.ledger.updates_applied == 3 and trainer.strategy.ledger.microbatches == 6


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stop_at": 0}, r"`stop_at` must be a positive int .* got 0"),
        ({"validate_every": -5}, r"`validate_every` must be a positive int .* got -5"),
        ({"checkpoint_every": 1.5}, r"`checkpoint_every` must be a positive int .* got 1.5"),
        ({"stop_at": True}, r"`stop_at` must be a positive int .* got True"),
        ({"axis": "steps"}, r"`axis` must be one of 'tokens', 'samples', 'updates', 'documents'; got 'steps'"),
    ],
)
def test_invalid_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Horizon(**kwargs)


def test_without_an_accumulation_strategy_or_without_token_counts() -> None:
    trainer = trainer_for(2, [Horizon(stop_at=10)], strategy="auto")
    with pytest.raises(RuntimeError, match=r"Horizon needs an accumulation strategy, but the Trainer uses"):
        trainer.fit(HorizonLM(), *loaders(EXAMPLES, 4))
    trainer = trainer_for(2, [Horizon(axis="tokens", stop_at=10)])
    with pytest.raises(RuntimeError, match=r"Horizon\(axis='tokens'\) needs token counts, but the run reports none"):
        trainer.fit(HorizonLM(report="samples"), *loaders(EXAMPLES, 4))


def test_a_budget_the_data_does_not_reach_is_reported() -> None:
    trainer = trainer_for(2, [Horizon(stop_at=10**6)], max_epochs=1)
    with pytest.warns(UserWarning, match=r"Horizon: training ended at \d+ tokens, before stop_at=1000000"):
        trainer.fit(HorizonLM(), *loaders(EXAMPLES, 4))


# ---------------------------------------------------------------------------- LightningCLI


class CLITokenLM(L.LightningModule):
    """A tiny token model with its own data and no `configure_optimizers`: LightningCLI builds the optimizer and
    the scheduler from the config."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 8)
        self.head = nn.Linear(8, 11)

    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        logits = self.head(torch.tanh(self.embed(batch["input_ids"])))
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        return {"loss": self.loss(batch), "num_tokens": (batch["labels"] != -100).sum()}

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.loss(batch)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(ListDataset(EXAMPLES), batch_size=4)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(ListDataset(EXAMPLES[:4]), batch_size=4)


CLI_CONFIG = """
trainer:
  strategy: accum
  accumulate_grad_batches: 2
  max_epochs: -1
  check_val_every_n_epoch: null
  val_check_interval: 1000000000
  num_sanity_val_steps: 0
  enable_progress_bar: false
  enable_model_summary: false
  default_root_dir: {root}
  callbacks:
    - class_path: lightning_accum.Horizon
      init_args:
        axis: tokens
        stop_at: 300
        validate_every: 70
        checkpoint_every: 100
optimizer:
  class_path: torch.optim.SGD
  init_args:
    lr: 0.5
lr_scheduler:
  class_path: lightning_accum.AxisLR
  init_args:
    axis: tokens
    lr_lambda:
      class_path: lightning_accum.warmup_cosine
      init_args:
        warmup: 60
        total: 300
        min_ratio: 0.1
"""


def test_horizon_and_axis_lr_from_lightning_cli_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(CLI_CONFIG.format(root=tmp_path))
    monkeypatch.setattr(sys, "argv", ["train.py"])
    cli = LightningCLI(
        CLITokenLM,
        seed_everything_default=0,
        args=["fit", "--config", str(path)],
        save_config_callback=None,
        trainer_defaults={"accelerator": "cpu", "logger": False, "enable_checkpointing": False},
    )
    expected = expected_run(per_update=8)
    trainer = cli.trainer
    assert trainer.strategy.ledger.tokens == expected["stop"]
    assert checkpoint_counts(tmp_path / "checkpoints") == expected["checkpoints"]
    config = trainer.lr_scheduler_configs[0]
    assert isinstance(config.scheduler, AxisLR) and (config.interval, config.frequency) == ("step", 1)
    # The last rate set is the one for the next update: base × lr_lambda(every token consumed).
    assert config.scheduler.consumed == expected["stop"]
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(BASE_LR * SCHEDULE(expected["stop"]))
    assert isinstance(next(c for c in trainer.callbacks if isinstance(c, lightning_accum.Horizon)), Horizon)


def test_a_resumed_run_can_extend_the_budget_and_change_the_interval(tmp_path: Path) -> None:
    def run(budget: Horizon, ckpt_path: Path | None = None) -> tuple[L.Trainer, Trace]:
        trace = Trace()
        trainer = trainer_for(2, [trace, budget])
        trainer.fit(
            HorizonLM(lr_lambda=SCHEDULE, seed=5),
            *loaders(EXAMPLES, 4, loader_class=ResumableLoader),
            ckpt_path=ckpt_path,
        )
        return trainer, trace

    first, _ = run(Horizon(stop_at=STOP, checkpoint_every=CHECKPOINT, dirpath=tmp_path))
    final = first.strategy.ledger.tokens
    last = tmp_path / f"tokens={final}.ckpt"  # the stopping update crossed a multiple of 100: a checkpoint there
    assert last.is_file()

    # The same budget: already spent, so no update runs.
    again, trace = run(Horizon(stop_at=STOP, checkpoint_every=CHECKPOINT, dirpath=tmp_path / "again"), last)
    assert again.strategy.ledger == first.strategy.ledger and trace.updates == []

    # A larger budget and a new validation interval: the validation points are computed from the restored count.
    longer, trace = run(
        Horizon(stop_at=450, validate_every=60, checkpoint_every=CHECKPOINT, dirpath=tmp_path / "x"), last
    )
    counts = [final + sum(u["tokens"] for u in trace.updates[: i + 1]) for i in range(len(trace.updates))]
    assert counts[-1] == longer.strategy.ledger.tokens >= 450 > counts[-2]
    expected = []
    next_point = (final // 60 + 1) * 60
    for count in counts:
        if count >= next_point:
            expected.append(count)
            next_point = (count // 60 + 1) * 60
    assert trace.validations == sorted({*expected, counts[-1]})


def test_under_token_batches_stop_validation_checkpoints_and_rate_follow_tokens_as_at_fixed_m(tmp_path: Path) -> None:
    # The loader in order: group g holds examples 8g to 8g + 7 in both runs, cut by tokens in one (rows × the longest
    # row ≤ 8: 5 or 6 micro-batches, a count per group) and into A = 2 micro-batches of 4 in the other.
    expected = expected_run(per_update=8)
    runs = {}
    for name, strategy in (
        ("tokens", AccumulationStrategy(token_batches=TokenBatches(max_tokens=8, lengths=LENGTHS))),
        ("fixed", AccumulationStrategy(global_order=True)),
    ):
        folder, trace, budget = tmp_path / name, Trace(), horizon()
        callbacks = [trace, budget, ModelCheckpoint(dirpath=folder, save_top_k=0)]
        trainer = trainer_for(2, callbacks, strategy=strategy, enable_checkpointing=True)  # type: ignore[arg-type]
        trainer.fit(HorizonLM(lr_lambda=SCHEDULE, lr=BASE_LR, seed=3), *loaders(EXAMPLES, 4))
        ledger = trainer.strategy.ledger
        assert ledger.tokens == expected["stop"] and trace.validations == expected["validations"], name
        assert checkpoint_counts(folder) == expected["checkpoints"], name
        assert [u["tokens_before"] for u in trace.updates] == expected["tokens_before"], name
        torch.testing.assert_close([u["lr"] for u in trace.updates], expected["lrs"], rtol=1e-12, atol=0.0)
        runs[name] = (trainer, params_vector(trainer.lightning_module))
    sizes = runs["tokens"][0].strategy.token_sampler.group_sizes()  # the last epoch's plan
    print(f"micro-batches per group under token_batches: {sizes}, at fixed m: 2")
    assert (
        len(set(sizes)) > 1
        and runs["tokens"][0].strategy.ledger.microbatches != runs["fixed"][0].strategy.ledger.microbatches
    )
    torch.testing.assert_close(runs["tokens"][1], runs["fixed"][1], rtol=1e-5, atol=1e-6)  # the same updates
