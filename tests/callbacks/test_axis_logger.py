"""AxisLogger: real TensorBoard event files and CSV files read back after real `Trainer.fit` runs."""

from __future__ import annotations

import csv
import itertools
import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from helpers import IGNORE, ListDataset, TinyLM, fit, make_examples, make_trainer, random_lengths, run_ddp
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader

from lightning_accum import AccumulationStrategy, AxisLogger, TokenWeightingWarning
from lightning_accum.callbacks.common import format_count


class LoggingLM(TinyLM):
    """Logs a training metric on every micro-batch and a validation loss; optionally inflates token counts."""

    def __init__(self, token_multiplier: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.token_multiplier = token_multiplier

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        self.log("train_loss", out["loss"], on_step=True)
        out["num_tokens"] = out["num_tokens"] * self.token_multiplier
        return out

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.mean_loss(batch))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def run(
    tmp_path: Path,
    examples: list[dict[str, torch.Tensor]],
    m: int,
    accumulate: int,
    name: str,
    axis: str = "tokens",
    model: LoggingLM | None = None,
    val_every: int | None = None,
    epochs: int = 1,
    ckpt_path: Path | None = None,
    extra_loggers: bool = False,
    prefix: str = "accum/",
) -> tuple[L.Trainer, LoggingLM]:
    model = model or LoggingLM(lr=0.5)
    loggers: list[Any] = [TensorBoardLogger(tmp_path, name=name, version=0)]
    if extra_loggers:
        loggers.append(CSVLogger(tmp_path, name=f"{name}-csv", version=0))
    trainer = make_trainer(
        strategy=AccumulationStrategy(),
        accumulate_grad_batches=accumulate,
        max_epochs=epochs,
        logger=loggers,
        callbacks=[AxisLogger(axis=axis, prefix=prefix), LearningRateMonitor(logging_interval="step")],
        log_every_n_steps=1,
        val_check_interval=val_every,
        check_val_every_n_epoch=1 if val_every is None else None,
    )
    loader = DataLoader(ListDataset(examples), batch_size=m)
    trainer.fit(model, loader, DataLoader(ListDataset(examples[:4]), batch_size=2), ckpt_path=ckpt_path)
    return trainer, model


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def cumulative_tokens(examples: list[dict[str, torch.Tensor]], per_update: int, multiplier: int = 1) -> list[int]:
    totals, seen = [], 0
    for i in range(0, len(examples), per_update):
        seen += sum(int((e["labels"] != IGNORE).sum()) for e in examples[i : i + per_update]) * multiplier
        totals.append(seen)
    return totals


def test_accum_loss_steps_are_cumulative_tokens_and_validation_sits_at_its_token_count(tmp_path: Path) -> None:
    examples = make_examples(random_lengths(24, seed=5), seed=5)
    # m = 2, A = 3: 4 updates; validation every 6 micro-batches = after updates 2 and 4.
    trainer, _ = run(tmp_path, examples, m=2, accumulate=3, name="tb", val_every=6)
    expected = cumulative_tokens(examples, 6)
    data = scalars(tmp_path / "tb" / "version_0")
    assert [step for step, _ in data["accum/loss"]] == expected
    assert [step for step, _ in data["accum/tokens_per_update"]] == expected
    assert [int(v) for _, v in data["accum/tokens_per_update"]] == [expected[0]] + [
        b - a for a, b in itertools.pairwise(expected)
    ]
    assert [step for step, _ in data["val_loss"]] == [expected[1], expected[3]]
    ledger = trainer.strategy.ledger
    assert ledger.tokens == expected[-1]
    assert data["accum/loss"][-1][1] == pytest.approx(ledger.last_group.loss, rel=1e-6)
    # LearningRateMonitor logs before every micro-batch; on the axis each update's rate is one point, at the x
    # after the update that used it, where accum/lr is.
    assert [step for step, _ in data["lr-SGD"]] == expected
    assert data["lr-SGD"] == data["accum/lr"]
    # The rate used by update i is 0.5 * 0.9**i (the schedule advances after every applied update).
    assert [v for _, v in data["accum/lr"]] == pytest.approx([0.5 * 0.9**i for i in range(4)])
    # The axis by name: a curve whose value is its x, at every x anything was written at.
    written = {step for tag, points in data.items() if tag != "accum/tokens" for step, _ in points}
    assert {step for step, _ in data["accum/tokens"]} == written >= set(expected)
    assert all(value == step for step, value in data["accum/tokens"])
    train_steps = [step for step, _ in data["train_loss"]]
    assert train_steps == sorted(set(train_steps)) and set(train_steps) <= {0, *expected}
    assert [v for _, v in data["accum/skipped_updates"]] == [0, 0, 0, 0]


def test_token_steps_beyond_int32_are_exact(tmp_path: Path) -> None:
    examples = make_examples([5] * 8, seed=1)
    multiplier = 2**29 + 3  # 10 tokens per micro-batch -> ~5.4e9 per micro-batch, past 2^31 and 2^32
    model = LoggingLM(lr=0.1, token_multiplier=multiplier)
    with pytest.warns(UserWarning, match="than their batch has label positions"):  # the counts are made up
        run(tmp_path, examples, m=2, accumulate=2, name="big", model=model)
    expected = cumulative_tokens(examples, 4, multiplier)
    assert expected[-1] > 2**32
    data = scalars(tmp_path / "big" / "version_0")
    assert [step for step, _ in data["accum/loss"]] == expected
    assert all(isinstance(step, int) for step, _ in data["accum/loss"])


def test_runs_with_different_splits_overlay_on_tokens(tmp_path: Path) -> None:
    examples = make_examples(random_lengths(32, seed=8), seed=8)
    run(tmp_path, examples, m=4, accumulate=2, name="m4a2", model=LoggingLM(lr=0.5))
    run(tmp_path, examples, m=2, accumulate=4, name="m2a4", model=LoggingLM(lr=0.5))
    a = scalars(tmp_path / "m4a2" / "version_0")["accum/loss"]
    b = scalars(tmp_path / "m2a4" / "version_0")["accum/loss"]
    assert {s for s, _ in a} == {s for s, _ in b}
    for (_, va), (_, vb) in zip(a, b, strict=True):
        assert va == pytest.approx(vb, abs=1e-5)


def test_samples_and_updates_axes(tmp_path: Path) -> None:
    examples = make_examples(random_lengths(12, seed=2), seed=2)
    run(tmp_path, examples, m=2, accumulate=2, name="samples", axis="samples")
    run(tmp_path, examples, m=2, accumulate=2, name="updates", axis="updates")
    assert [s for s, _ in scalars(tmp_path / "samples" / "version_0")["accum/loss"]] == [4, 8, 12]
    assert [s for s, _ in scalars(tmp_path / "updates" / "version_0")["accum/loss"]] == [1, 2, 3]


def test_csv_has_the_same_steps_and_resume_continues_the_axis(tmp_path: Path) -> None:
    examples = make_examples(random_lengths(8, seed=3), seed=3)
    trainer, _model = run(tmp_path, examples, m=2, accumulate=2, name="first", extra_loggers=True)
    path = tmp_path / "first.ckpt"
    trainer.save_checkpoint(path)
    tb_steps = [s for s, _ in scalars(tmp_path / "first" / "version_0")["accum/loss"]]
    with open(tmp_path / "first-csv" / "version_0" / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row.get("accum/loss")]
    assert [int(row["step"]) for row in rows] == tb_steps

    run(tmp_path, examples, m=2, accumulate=2, name="second", epochs=2, ckpt_path=path, model=LoggingLM(lr=0.5))
    resumed = [s for s, _ in scalars(tmp_path / "second" / "version_0")["accum/loss"]]
    assert resumed[0] > tb_steps[-1] and resumed == sorted(resumed), (tb_steps, resumed)
    assert resumed[-1] == 2 * tb_steps[-1]  # the same 8 examples twice


def csv_rows(folder: Path) -> list[dict[str, str]]:
    with open(folder / "metrics.csv") as f:
        return list(csv.DictReader(f))


def test_every_csv_row_names_its_x_and_the_monitors_rate_shares_the_row_of_accum_lr(tmp_path: Path) -> None:
    examples = make_examples(random_lengths(24, seed=5), seed=5)
    # m = 2, A = 3: 4 updates; validation after updates 2 and 4.
    trainer, _ = run(tmp_path, examples, m=2, accumulate=3, name="rows", val_every=6, extra_loggers=True)
    expected = cumulative_tokens(examples, 6)
    assert trainer.strategy.ledger.tokens == expected[-1]
    rows = csv_rows(tmp_path / "rows-csv" / "version_0")
    # Every row, whatever it holds (a group point, `self.log` in training or validation, the monitor's rate), names
    # its x: the axis metric, written as the same exact int as the row's step.
    assert len(rows) > len(expected) and all(row["accum/tokens"] == row["step"] for row in rows)

    def steps(key: str) -> list[int]:
        return [int(row["step"]) for row in rows if row[key]]

    assert steps("accum/loss") == expected
    assert steps("val_loss") == [expected[1], expected[3]]
    # LearningRateMonitor's rate of update i is in update i's point row, beside accum/lr: same x, same value.
    assert steps("lr-SGD") == expected
    assert all(row["lr-SGD"] == row["accum/lr"] for row in rows if row["lr-SGD"])


def test_the_axis_metric_follows_the_axis_and_the_prefix(tmp_path: Path) -> None:
    examples = make_examples(random_lengths(12, seed=2), seed=2)  # m = 2, A = 2: 3 updates of 4 samples
    run(tmp_path, examples, m=2, accumulate=2, name="samples", axis="samples", prefix="run/", extra_loggers=True)
    trainer, _ = run(tmp_path, examples, m=2, accumulate=2, name="updates", axis="updates", extra_loggers=True)
    samples = csv_rows(tmp_path / "samples-csv" / "version_0")
    assert all(row["run/samples"] == row["step"] for row in samples)
    assert [int(row["run/samples"]) for row in samples if row["run/loss"]] == [4, 8, 12]
    assert not {"accum/samples", "run/tokens", "accum/tokens"} & set(samples[0])
    updates = csv_rows(tmp_path / "updates-csv" / "version_0")
    assert all(row["accum/updates"] == row["step"] for row in updates)
    assert [int(row["accum/updates"]) for row in updates if row["accum/loss"]] == [1, 2, 3]
    assert trainer.strategy.ledger.updates_applied == 3


class OneCycleLM(LoggingLM):
    """SGD with momentum under OneCycleLR: the rate and the momentum change at every update."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1.0, total_steps=8)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def test_learning_rate_monitor_and_accum_lr_sit_at_the_same_x_for_the_same_update(tmp_path: Path) -> None:
    # 6 updates (m = 2, A = 2) at log_every_n_steps=2: the monitor reads the rates before the micro-batches of
    # updates 2, 4 and 6 (Lightning's cadence), and AxisLogger writes a point after each of those updates.
    examples = make_examples(random_lengths(24, seed=4), seed=4)
    trainer = make_trainer(
        strategy=AccumulationStrategy(),
        accumulate_grad_batches=2,
        logger=TensorBoardLogger(tmp_path, name="lr", version=0),
        callbacks=[AxisLogger(axis="tokens"), LearningRateMonitor(logging_interval="step", log_momentum=True)],
        log_every_n_steps=2,
    )
    # The reference, per update: the count after it, and the rate and momentum it used (the listeners run after the
    # update, before the schedule advances).
    used: list[tuple[int, float, float]] = []
    strategy = trainer.strategy

    def listen(record: Any, _: Any) -> None:
        (group,) = trainer.optimizers[0].param_groups
        used.append((strategy.ledger.tokens, group["lr"], group["momentum"]))

    strategy.add_group_listener(listen)
    val = DataLoader(ListDataset(examples[:2]), batch_size=2)
    trainer.fit(OneCycleLM(lr=0.5), DataLoader(ListDataset(examples), batch_size=2), val)
    assert len(used) == 6 and len({lr for _, lr, _ in used}) == 6  # a rate of its own per update
    logged = scalars(tmp_path / "lr" / "version_0")
    points = used[1::2]  # updates 2, 4 and 6
    for tag, values in (("lr-SGD", [lr for _, lr, _ in points]), ("lr-SGD-momentum", [mom for *_, mom in points])):
        assert [step for step, _ in logged[tag]] == [x for x, _, _ in points], tag
        assert [value for _, value in logged[tag]] == pytest.approx(values, rel=1e-6), tag  # float32 in the file
    assert logged["accum/lr"] == logged["lr-SGD"]


def test_tokens_axis_without_token_counts_is_a_clear_error(tmp_path: Path) -> None:
    trainer = make_trainer(
        callbacks=[AxisLogger()],
    )
    with (
        pytest.raises(RuntimeError, match=r"axis='tokens'\) needs token counts.*axis='samples'"),
        pytest.warns(TokenWeightingWarning, match=r"token weighting is probably intended"),
    ):
        trainer.fit(TinyLM(report="loss"), DataLoader(ListDataset(make_examples([2, 3])), batch_size=1))


def test_bad_axis_lists_the_valid_ones() -> None:
    with pytest.raises(
        ValueError,
        match=r"`axis` must be one of 'tokens', 'samples', 'updates',"
        r" 'documents'; got 'epochs'",
    ):
        AxisLogger(axis="epochs")


class _ReadProgressBar(L.Callback):
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        assert trainer.progress_bar_callback is not None
        self.metrics = trainer.progress_bar_callback.get_metrics(trainer, pl_module)


def test_progress_bar_shows_tokens_and_skipped_updates(tmp_path: Path) -> None:
    reader = _ReadProgressBar()
    examples = make_examples([4] * 8, seed=0)
    trainer = make_trainer(accumulate_grad_batches=2, callbacks=[AxisLogger(), reader], enable_progress_bar=True)
    trainer.fit(TinyLM(), DataLoader(ListDataset(examples), batch_size=2))
    # Text, not a number: Rich's bar formats every number with three decimals ("skipped: 0.000").
    assert reader.metrics["seen"] == "32 tok" and reader.metrics["skipped"] == "0"
    assert format_count(1_234_567, "tok") == "1.2M tok" and format_count(3 * 10**12) == "3.0T"


def _ddp_axis_run(rank: int, folder: str) -> None:
    examples = make_examples(random_lengths(16, seed=6), seed=6)
    fit(
        LoggingLM(lr=0.5),
        examples,
        batch_size=2,
        accumulate=2,
        strategy="accum_ddp",
        devices=2,
        callbacks=[AxisLogger()],
        logger=TensorBoardLogger(folder, name="ddp", version=0),
        log_every_n_steps=1,
    )


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_ddp_rank_zero_writes_global_token_steps(tmp_path: Path) -> None:
    run_ddp(_ddp_axis_run, str(tmp_path))
    examples = make_examples(random_lengths(16, seed=6), seed=6)
    folder = tmp_path / "ddp" / "version_0"
    assert len(list(folder.glob("events.out.tfevents.*"))) == 1  # rank zero only
    # D = 2, m = 2, A = 2: an update consumes 8 examples (rank-strided, so the first 8, then the next 8).
    assert [s for s, _ in scalars(folder)["accum/loss"]] == cumulative_tokens(examples, 8)


def cadence_fit(
    tmp_path: Path, name: str, examples: list[dict[str, torch.Tensor]], batch_size: int, every: int, val_size: int
) -> tuple[L.Trainer, list[Any], dict[str, list[tuple[int, float]]]]:
    """A fit at A = 2 logging every `every` updates on the tokens axis: the Trainer, every group record (from the
    strategy's listener), and the scalars written."""
    records: list[Any] = []
    trainer = make_trainer(
        strategy=AccumulationStrategy(),
        accumulate_grad_batches=2,
        logger=TensorBoardLogger(tmp_path, name=name, version=0),
        callbacks=[AxisLogger(axis="tokens")],
        log_every_n_steps=every,
    )
    trainer.strategy.add_group_listener(lambda record, _: records.append(record))
    val = DataLoader(ListDataset(examples[:val_size]), batch_size=2)
    trainer.fit(LoggingLM(lr=0.5), DataLoader(ListDataset(examples), batch_size=batch_size), val)
    return trainer, records, scalars(tmp_path / name / "version_0")


def test_group_metrics_follow_log_every_n_steps_with_window_values_from_the_ledger(tmp_path: Path) -> None:
    # 7 attempted updates at log_every_n_steps=3: points after updates 3 and 6, and the rest (7) when training ends.
    examples = make_examples(random_lengths(28, seed=8), seed=8)
    _, records, logged = cadence_fit(tmp_path, "cadence", examples, batch_size=2, every=3, val_size=4)
    assert len(records) == 7
    # The reference, from the ledger's group records: the x after each window, its token-weighted loss, mean counts.
    windows = [records[0:3], records[3:6], records[6:7]]
    xs = list(itertools.accumulate(sum(r.tokens for r in w) for w in windows))
    assert [s for s, _ in logged["accum/loss"]] == xs
    for (_, value), window in zip(logged["accum/loss"], windows, strict=True):
        expected = sum(r.tokens * r.loss for r in window) / sum(r.tokens for r in window)
        assert value == pytest.approx(expected, rel=1e-6)  # float32 in the event file
    for (_, value), window in zip(logged["accum/tokens_per_update"], windows, strict=True):
        assert value == pytest.approx(sum(r.tokens for r in window) / len(window), rel=1e-6)
    assert [s for s, _ in logged["accum/samples_per_update"]] == xs
    # Lightning's own `self.log` metrics follow Lightning's cadence, on the same exact axis.
    assert all(s in set(itertools.accumulate(r.tokens for r in records)) for s, _ in logged["train_loss"])


def test_every_group_metric_at_each_point_equals_its_reference_from_the_group_records(tmp_path: Path) -> None:
    # 9 attempted updates (m = 1, A = 2) at log_every_n_steps=4: points after updates 4 and 8, and 9 when training
    # ends. Update 6 holds no supervised token: skipped ("empty", NaN loss), so its window's loss leaves it out while
    # its mean counts and the skipped total count it, and the step schedule does not advance on it.
    lengths = random_lengths(18, seed=11)
    lengths[10] = lengths[11] = 0
    examples = make_examples(lengths, seed=11)
    with pytest.warns(UserWarning, match="update 6 is skipped: its group holds no tokens"):
        trainer, records, logged = cadence_fit(tmp_path, "points", examples, batch_size=1, every=4, val_size=2)
    assert [r.applied for r in records] == [True] * 5 + [False] + [True] * 3

    # The reference: each point's window of group records, and what was true at its last update.
    windows = [records[0:4], records[4:8], records[8:9]]
    ends = [4, 8, 9]
    xs = [sum(r.tokens for r in records[:end]) for end in ends]
    losses = []
    for window in windows:
        counted = [r for r in window if r.tokens > 0 and math.isfinite(r.loss)]
        losses.append(sum(r.tokens * r.loss for r in counted) / sum(r.tokens for r in counted))
    # StepLR(gamma=0.9) after every applied update: the rate an update used is 0.5 · 0.9^(applied before it).
    lrs = [0.5 * 0.9 ** sum(r.applied for r in records[: end - 1]) for end in ends]
    expected = {
        "accum/loss": losses,
        "accum/tokens_per_update": [sum(r.tokens for r in w) / len(w) for w in windows],
        "accum/samples_per_update": [sum(r.samples for r in w) / len(w) for w in windows],
        "accum/skipped_updates": [sum(not r.applied for r in records[:end]) for end in ends],
        "accum/lr": lrs,
    }
    assert trainer.strategy.ledger.tokens == xs[-1] and trainer.strategy.ledger.updates_skipped["empty"] == 1
    for tag, values in expected.items():
        assert [step for step, _ in logged[tag]] == xs, tag
        assert [value for _, value in logged[tag]] == pytest.approx(values, rel=1e-6), tag  # float32 in the file
    assert expected["accum/samples_per_update"] == [2.0, 2.0, 2.0]
    assert expected["accum/skipped_updates"] == [0, 1, 1]
    assert "accum/grad_scale" not in logged  # no GradScaler in this run


def test_two_fits_with_one_axis_logger_continue_the_axis_and_leave_the_logger_clean(tmp_path: Path) -> None:
    examples = make_examples(random_lengths(16, seed=9), seed=9)
    logger = TensorBoardLogger(tmp_path, name="stages", version=0)
    axis = AxisLogger(axis="tokens")
    model = LoggingLM(lr=0.5)
    for _ in range(2):  # two training stages, a new Trainer each, one logger and one callback
        trainer = make_trainer(
            strategy=AccumulationStrategy(),
            accumulate_grad_batches=2,
            logger=logger,
            callbacks=[axis],
            log_every_n_steps=1,
        )
        trainer.fit(model, DataLoader(ListDataset(examples), batch_size=2), DataLoader(ListDataset(examples[:2])))
        assert "log_metrics" not in vars(logger)  # nothing left on the logger instance
    logged = scalars(tmp_path / "stages" / "version_0")
    steps = [s for s, _ in logged["accum/loss"]]
    per_stage = cumulative_tokens(examples, 4)
    assert len(steps) == 8  # 4 updates per stage, none dropped
    assert sorted(steps) == per_stage + [per_stage[-1] + x for x in per_stage]  # one event file per fit
    # The axis metric holds the shifted x of the second stage too.
    assert (
        all(value == step for step, value in logged["accum/tokens"])
        and set(steps) <= dict(logged["accum/tokens"]).keys()
    )


def test_the_missing_token_count_is_reported_before_the_first_update(tmp_path: Path) -> None:
    examples = make_examples(random_lengths(8, seed=3), seed=3)
    model = TinyLM(lr=0.5, report="loss")
    before = [p.detach().clone() for p in model.parameters()]
    with (
        pytest.warns(TokenWeightingWarning),  # the run's own hint: ignored labels weighted by samples
        pytest.raises(RuntimeError, match=r"AxisLogger\(axis='tokens'\) needs token counts"),
    ):
        fit(model, examples, 2, 2, callbacks=[AxisLogger(axis="tokens")])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # nothing applied
