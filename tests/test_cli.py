"""LightningCLI: strategies by string and by class path, the callbacks, the package's errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import (
    ListDataset,
    TinyLM,
    make_examples,
    random_lengths,
)
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader


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
        ValueError,
        match=r"`normalize` must be one of 'auto', 'tokens', 'samples', 'batches',"
        r" 'documents'; got 'mean'",
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
    with pytest.raises(
        ValueError,
        match=r"`axis` must be one of 'tokens', 'samples', 'updates',"
        r" 'documents'; got 'steps'",
    ):
        run_cli(tmp_path, bad_callback, monkeypatch)


# ---------------------------------------------------------------------------- resume


@pytest.mark.parametrize("size", ["1", "auto"])
def test_cli_sets_microbatch_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: str) -> None:
    config = (
        COMMON
        + f"""  strategy:
    class_path: lightning_accum.AccumulationStrategy
    init_args:
      microbatch_size: {size}
"""
    )
    cli = run_cli(tmp_path, config, monkeypatch)
    slicing = cli.trainer.strategy.slicing
    assert slicing.configured == (1 if size == "1" else "auto")
    assert slicing.slice_sizes == ({1: 12} if size == "1" else {2: 6})  # 6 batches of 2
