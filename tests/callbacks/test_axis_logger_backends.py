"""AxisLogger with MLflow (a local file store) and W&B (an offline run): real `Trainer.fit` runs, read back from the
files each logger writes.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import wandb
from helpers import ListDataset, TinyLM, make_examples, make_trainer, random_lengths
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import Logger, MLFlowLogger, WandbLogger
from mlflow.tracking import MlflowClient
from torch.utils.data import DataLoader
from typing_extensions import override
from wandb.proto import wandb_internal_pb2

from lightning_accum import AccumulationStrategy, AxisLogger


class ScheduledLM(TinyLM):
    """Logs a training loss and a validation loss; StepLR(gamma=0.5) after every update: a rate of its own each."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        self.log("train_loss", out["loss"], on_step=True)
        return out

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.mean_loss(batch))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def fit_with(logger: Logger) -> list[tuple[int, float]]:
    """4 updates (m = 2, A = 2, 16 examples) on the tokens axis, validating after updates 2 and 4, logging every update.

    Returns, per update, the ledger's token count after it and the rate it used (the group listeners run after the
    update, before the schedule advances).
    """
    examples = make_examples(random_lengths(16, seed=7), seed=7)
    trainer = make_trainer(
        strategy=AccumulationStrategy(),
        accumulate_grad_batches=2,
        logger=logger,
        callbacks=[AxisLogger(axis="tokens"), LearningRateMonitor(logging_interval="step")],
        log_every_n_steps=1,
        val_check_interval=4,
    )
    used: list[tuple[int, float]] = []
    strategy = trainer.strategy
    strategy.add_group_listener(
        lambda record, _: used.append((strategy.ledger.tokens, trainer.optimizers[0].param_groups[0]["lr"]))
    )
    val = DataLoader(ListDataset(examples[:2]), batch_size=2)
    trainer.fit(ScheduledLM(lr=0.5), DataLoader(ListDataset(examples), batch_size=2), val)
    assert len(used) == 4 and strategy.ledger.tokens == used[-1][0]
    return used


def test_mlflow_steps_and_the_axis_metric_are_the_token_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # mlflow 3.13 and later refuse the file store unless asked (it prefers a database, which needs SQLAlchemy).
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = "file:" + str(tmp_path / "mlruns")
    logger = MLFlowLogger(experiment_name="axis", tracking_uri=uri)
    used = fit_with(logger)
    xs = [x for x, _ in used]
    client = MlflowClient(tracking_uri=uri)

    def history(key: str) -> list[tuple[int, float]]:
        return sorted((m.step, m.value) for m in client.get_metric_history(logger.run_id, key))

    assert [step for step, _ in history("accum/loss")] == xs
    assert [step for step, _ in history("val_loss")] == [xs[1], xs[3]]
    # The axis metric: its value is its step, at every step anything was written at (one point per record).
    axis = history("accum/tokens")
    assert all(value == step for step, value in axis)
    written = {
        step for key in ("accum/loss", "accum/lr", "lr-SGD", "train_loss", "val_loss") for step, _ in history(key)
    }
    assert {step for step, _ in axis} == written
    # The monitor's rate of each update and accum/lr: the same step, the value the update used.
    assert history("lr-SGD") == history("accum/lr") == [(x, pytest.approx(lr)) for x, lr in used]


def wandb_records(run_dir: Path) -> list[Any]:
    """The records of an offline W&B run, read from its `.wandb` file with wandb's own protobuf messages.

    The file is a 7-byte header (``:W&B``, a magic number, a version) and then LevelDB's log format: 32 KiB blocks of
    chunks, each a 7-byte header (CRC-32 of the type byte and the data, length, type: 1 full, 2 first, 3 middle,
    4 last) and its data; a block's tail shorter than a header is padding. wandb 0.31 ships no Python reader.
    """
    (path,) = run_dir.glob("*.wandb")
    raw = path.read_bytes()
    assert raw[:4] == b":W&B", raw[:7]
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(raw):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        data = raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0:  # zero padding at the end of the file
            break
        assert crc == zlib.crc32(data, zlib.crc32(bytes([kind]))), f"corrupt chunk at byte {pos}"
        pending += data
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


class GlobalStepWandbLogger(WandbLogger):
    """Lightning's ``WandbLogger`` as Lightning 2.7 changes it (Lightning-AI/pytorch-lightning#21782, PR #21785): its
    step key is ``global_step`` (``log_key_prefix`` left at its default), the charts' x it defines when it creates the
    run and the key it adds to a row when given a step. The rest is Lightning 2.6's class."""

    @property
    @override
    def experiment(self) -> Any:
        # The run made as Lightning 2.6's property makes it (from the logger's `_wandb_init`, kept in `_experiment`),
        # with 2.7's definitions of the charts' x.
        if self._experiment is None:
            self._experiment = wandb.init(**self._wandb_init)
            self._experiment.define_metric("global_step")
            self._experiment.define_metric("*", step_metric="global_step", step_sync=True)
        return self._experiment

    @override
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        self.experiment.log(dict(metrics, **({"global_step": step} if step is not None else {})))


#: The key each logger puts its step under (and defines as its charts' x): Lightning 2.6's and 2.7's.
STEP_KEYS: dict[type[WandbLogger], str] = {WandbLogger: "trainer/global_step", GlobalStepWandbLogger: "global_step"}


@pytest.mark.parametrize("logger_type", list(STEP_KEYS), ids=list(STEP_KEYS.values()))
def test_wandb_charts_use_the_axis_metric_as_x_and_rows_carry_no_global_step(
    logger_type: type[WandbLogger], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    step_key = STEP_KEYS[logger_type]
    monkeypatch.setenv("WANDB_MODE", "offline")
    for variable in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(variable, str(tmp_path))  # nothing written outside the test's folder
    logger = logger_type(project="axis", save_dir=str(tmp_path))
    try:
        used = fit_with(logger)
        # A row logged straight to the run, without the axis metric: W&B itself adds the latest x to it when "*" is
        # defined against the axis metric with step_sync (the definition is in force, not only recorded).
        logger.experiment.log({"direct": 1.0})
        # After the fit the logger is its own again (AxisLogger gave its `log_metrics` back): given a step, it puts it
        # in the row under its step key, which is what the callback keeps out of the fit's rows.
        logger.log_metrics({"after_fit": 1.0}, step=7)
        run_dir = Path(logger.experiment.dir).parent  # <save_dir>/wandb/offline-run-<time>-<id>/files
    finally:
        logger.experiment.finish()  # ends the run (Lightning's finalize does not)
        # `finish` can return before W&B's service process has written the run's file (seen with wandb 0.31: a file
        # of its header only); `teardown` stops that process, so the file is complete after it.
        wandb.teardown()
    xs = [x for x, _ in used]
    records = wandb_records(run_dir)

    # The x of every chart: the last definition of the glob "*" (the logger's own, against its step key, comes
    # first), and the axis metric itself defined.
    metrics = [r.metric for r in records if r.WhichOneof("record_type") == "metric"]
    globs = [m for m in metrics if m.glob_name == "*"]
    assert globs[0].step_metric == step_key and globs[-1].step_metric == "accum/tokens"
    assert any(m.name == "accum/tokens" for m in metrics)

    # A history item names its key in `key` or as a path in `nested_key` (one element for a flat key like ours).
    rows = [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    *rows, after_fit = rows
    assert after_fit["after_fit"] == 1 and after_fit[step_key] == 7
    assert rows and not any(key in row for row in rows for key in STEP_KEYS.values())
    assert rows[-1]["direct"] == 1 and rows[-1]["accum/tokens"] == xs[-1]
    assert all(isinstance(row.get("accum/tokens"), int) for row in rows), rows  # every row holds its x, an exact int

    def xs_of(key: str) -> list[int]:
        return [row["accum/tokens"] for row in rows if key in row]

    assert xs_of("accum/loss") == xs and xs_of("val_loss") == [xs[1], xs[3]]
    # The monitor's rate of each update is in that update's point row, beside accum/lr, with the same value.
    assert [(row["accum/tokens"], row["lr-SGD"]) for row in rows if "lr-SGD" in row] == used
    assert all(row["lr-SGD"] == row["accum/lr"] for row in rows if "lr-SGD" in row)
