"""LightningCLI: strategies by string and by class path, the callbacks, the package's errors."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml
from helpers import (
    ListDataset,
    TinyLM,
    make_examples,
    random_lengths,
)
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader

from lightning_accum import BatchSchedule, TokenBatches

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


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
    assert (strategy.engine.options.normalize, strategy.engine.options.partial_group) == ("samples", "drop")
    record = json.loads((tmp_path / "report" / "accumulation_report.json").read_text())
    assert record["normalization"] == "samples" and record["updates"]["applied"] == 2


def test_cli_invalid_values_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bad_strategy = (
        COMMON
        + """  strategy:
    class_path: lightning_accum.AccumulationStrategy
    init_args:
      normalize: mean
"""
    )
    # A `Literal` option: the parser refuses the value before anything is built (jsonargparse 4.41 words it
    # "Cannot take a Union of no types", later releases "Expected a Literal[...]"; `--help` lists the choices).
    with pytest.raises(SystemExit):
        run_cli(tmp_path, bad_strategy, monkeypatch)
    assert 'Parser key "normalize"' in capsys.readouterr().err
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


# ---------------------------------------------------------------------------- batch schedule


def _cli_recipe() -> ModuleType:
    """examples/cli.py, whose `main(args)` is what `python examples/cli.py ...` runs."""
    spec = importlib.util.spec_from_file_location("recipe_cli", EXAMPLES / "cli.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # importable by its name, as jsonargparse resolves the recipe's classes
    spec.loader.exec_module(module)
    return module


SCHEDULE = "0:8 1K:16 1.5K:32"  # on tokens: 256 sequences of examples/_data.py hold about 2,200 supervised tokens
SCHEDULE_FORMS = {
    # Megatron's string, as the how-to writes it, and the class with its arguments (the how-to's second form).
    "string": f'batch_schedule: "{SCHEDULE}"',
    "class": f"""batch_schedule:
        class_path: lightning_accum.BatchSchedule
        init_args: {{stages: "{SCHEDULE}", axis: tokens, lr_scaling: sqrt}}""",
}


def _schedule_config(tmp_path: Path, form: str) -> Path:
    path = tmp_path / f"{form}.yaml"
    path.write_text(f"""seed_everything: 0
trainer:
  accelerator: cpu
  strategy:
    class_path: lightning_accum.AccumulationStrategy
    init_args:
      {SCHEDULE_FORMS[form]}
  max_epochs: 1
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  callbacks:
    - class_path: lightning_accum.AccumulationReport
      init_args:
        path: {tmp_path}/{form}-report.json
data:
  batch_size: 4
  num_examples: 256
""")
    return path


@pytest.mark.parametrize("form", list(SCHEDULE_FORMS))
def test_cli_config_ramps_the_batch_with_a_schedule_in_the_strategy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], form: str
) -> None:
    monkeypatch.chdir(tmp_path)  # the recipe's config callback writes config.yaml there
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / "cli.py")])  # as if run from the command line with `args`
    recipe = _cli_recipe()
    config = _schedule_config(tmp_path, form)

    with pytest.raises(SystemExit) as printed:  # --print_config: the schedule as LightningCLI parsed it
        recipe.main(["fit", "--config", str(config), "--print_config"])
    assert printed.value.code in (0, None)
    parsed = yaml.safe_load(capsys.readouterr().out)["trainer"]["strategy"]["init_args"]["batch_schedule"]
    if form == "string":
        assert parsed == SCHEDULE
    else:
        assert parsed["class_path"] == "lightning_accum.BatchSchedule"
        assert parsed["init_args"] | {"stages": SCHEDULE, "lr_scaling": "sqrt"} == parsed["init_args"]

    cli = recipe.main(["fit", "--config", str(config)])
    strategy = cli.trainer.strategy
    expected = BatchSchedule(SCHEDULE, axis="tokens", lr_scaling="sqrt" if form == "class" else None)
    assert strategy.batch_schedule == expected
    # The stages reached, read back from the run record: all three, each from its threshold, every token counted.
    record = json.loads((tmp_path / f"{form}-report.json").read_text())["batch_schedule"]
    assert record["axis"] == "tokens"
    stages = record["stages"]
    assert [(s["threshold"], s["samples_per_update"]) for s in stages] == [(0, 8), (1000, 16), (1500, 32)]
    assert all(s["updates"] > 0 for s in stages)
    assert sum(s["tokens"] for s in stages) == strategy.ledger.tokens
    assert sum(s["samples"] for s in stages) == 256


def test_cli_help_shows_the_strategys_batch_schedule(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / "cli.py")])
    with pytest.raises(SystemExit) as shown:
        _cli_recipe().main(["fit", "--trainer.strategy.help", "lightning_accum.AccumulationStrategy"])
    assert shown.value.code in (0, None)
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help to the terminal's width
    assert re.search(r"--trainer\.strategy\.batch_schedule BATCH_SCHEDULE .*\(type: Union\[BatchSchedule,", text)


@pytest.mark.parametrize(
    "strategy", ["AccumulationStrategy", "DDPAccumulationStrategy", "ModelParallelAccumulationStrategy"]
)
def test_cli_help_lists_each_options_choices_and_what_count_tokens_accepts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], strategy: str
) -> None:
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / "cli.py")])
    with pytest.raises(SystemExit) as shown:
        _cli_recipe().main(["fit", "--trainer.strategy.help", f"lightning_accum.{strategy}"])
    assert shown.value.code in (0, None)
    text = " ".join(capsys.readouterr().out.split())
    for option, choices in {
        "normalize": "auto,tokens,samples,batches,documents",
        "partial_group": "rescale,drop",
        "schedule_on": "applied,attempted",
        "on_nonfinite": "skip,raise,ignore",
    }.items():
        assert f"--trainer.strategy.{option} {{{choices}}}" in text, option
    count_tokens = text.rsplit("--trainer.strategy.count_tokens COUNT_TOKENS", 1)[1].split("--trainer.strategy.", 1)[0]
    assert "``batch -> int | Tensor``" in count_tokens and "lightning_accum.causal_lm_tokens" in count_tokens
    assert "subclasses" not in count_tokens and "torch.nn.Parameter" not in text, count_tokens  # no Tensor classes


# ---------------------------------------------------------------------------- micro-batches cut by tokens


class TokenCLIModel(TinyLM):
    """TinyLM over a Hugging Face `datasets.Dataset` whose `supervised` column holds each row's supervised tokens."""

    def __init__(self, lr: float = 0.5) -> None:
        super().__init__(lr=lr)

    def train_dataloader(self) -> DataLoader:
        datasets = pytest.importorskip("datasets")
        rows = make_examples(random_lengths(24, seed=40), seed=40)
        columns = {key: [row[key].tolist() for row in rows] for key in ("input_ids", "labels")}
        columns["supervised"] = [[1] * sum(label != -100 for label in labels) for labels in columns["labels"]]
        data = datasets.Dataset.from_dict(columns).with_format("torch", columns=["input_ids", "labels"])
        return DataLoader(data, batch_size=2, shuffle=True)


def test_cli_config_cuts_micro_batches_by_tokens_with_the_lengths_of_a_datasets_column(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("""
trainer:
  max_epochs: 1
  accumulate_grad_batches: 2
  enable_progress_bar: false
  enable_model_summary: false
  strategy:
    class_path: lightning_accum.AccumulationStrategy
    init_args:
      token_batches:
        class_path: lightning_accum.TokenBatches
        init_args: {max_tokens: 8, lengths: supervised}
""")
    monkeypatch.setattr(sys, "argv", ["train.py"])
    cli = LightningCLI(
        TokenCLIModel,
        seed_everything_default=0,
        args=["fit", "--config", str(path)],
        save_config_callback=None,
        trainer_defaults={"accelerator": "cpu", "logger": False, "enable_checkpointing": False},
    )
    strategy = cli.trainer.strategy
    assert strategy.token_batches == TokenBatches(max_tokens=8, lengths="supervised")  # type: ignore[attr-defined]
    sampler = strategy.token_sampler  # type: ignore[attr-defined]
    expected = [sum(1 for x in row["labels"] if x != -100) for row in make_examples(random_lengths(24, seed=40), 40)]
    assert sampler.lengths.tolist() == expected
    ledger = strategy.ledger  # type: ignore[attr-defined]
    assert (ledger.samples, ledger.updates_applied, ledger.microbatches) == (24, 6, len(sampler))
