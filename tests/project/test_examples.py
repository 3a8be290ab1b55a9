"""The recipes in examples/ run as documented, in a reduced size: LightningCLI with its YAML, torchrun with DDP, LitGPT
in a Fabric loop, the token budget at two splits."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from lightning_accum.callbacks.report import REPORT_FILENAME

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # importable by its name, as jsonargparse resolves the recipe's classes
    spec.loader.exec_module(module)
    return module


def test_lightning_cli_recipe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the YAML's logger writes to ./runs
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / "cli.py")])  # as if run from the command line with `args`
    args = ["fit", "--config", str(EXAMPLES / "cli.yaml"), "--data.num_examples", "36", "--trainer.max_epochs", "1"]
    cli = load("cli").main([*args, "--trainer.enable_progress_bar", "false"])
    from _data import RandomSequences  # the recipe put examples/ on sys.path

    ledger = cli.trainer.strategy.ledger
    # 9 micro-batches of 4 with A = 4 (from the YAML): two full groups and a partial one of 4 sequences.
    assert (ledger.updates_applied, ledger.partial_groups, ledger.samples) == (3, 1, 36)
    assert ledger.tokens == RandomSequences(36).supervised_tokens() and ledger.normalization == "tokens"
    record = json.loads((tmp_path / "runs" / "cli" / "version_0" / REPORT_FILENAME).read_text())
    assert record["effective_batch"]["arithmetic"] == "4 × 4 × 1 = 16"
    assert record["partial_group"]["policy"] == "rescale"


@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_torchrun_recipe_on_two_processes(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += [str(EXAMPLES / "ddp_torchrun.py"), "--quick", "--out", str(tmp_path)]
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "m = 4, A = 4, D = 2: 4 × 4 × 2 = 32 sequences per update" in done.stdout

    sys.path.insert(0, str(EXAMPLES))
    try:
        from _data import RandomSequences
    finally:
        sys.path.remove(str(EXAMPLES))
    record = json.loads((tmp_path / "ddp_torchrun" / "version_0" / REPORT_FILENAME).read_text())
    assert record["data_parallel_replicas"] == 2 and record["effective_batch"]["arithmetic"] == "4 × 4 × 2 = 32"
    # Every sequence counted once over both replicas: 64 sequences, two updates of 32.
    assert record["samples"]["total"] == 64 and record["updates"]["applied"] == 2
    assert record["tokens"]["total"] == RandomSequences(64).supervised_tokens()


def _litgpt(args: list[str], out: Path) -> dict[str, Any]:
    """The recipe as a user runs it: `main(argv)`, in this process on one device (importing litgpt once, 5 of the 6
    seconds of a run in a process of its own), and as a script on two (spawned workers import it as a script)."""
    pytest.importorskip("litgpt")
    argv = [*args, "--updates", "4", "--length", "16", "--dtype", "float64", "--out", str(out)]
    if "--devices" in args:
        command = [sys.executable, str(EXAMPLES / "litgpt_fabric.py"), *argv]
        done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=out.parent)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        printed = done.stdout
    else:
        with contextlib.redirect_stdout(io.StringIO()) as stdout:
            load("litgpt_fabric").main(argv)
        printed = stdout.getvalue()
    assert "sequences per update, 4 updates" in printed  # m, A, D and the effective batch, printed first
    return json.loads((out / "result.json").read_text())  # type: ignore[no-any-return]


@pytest.mark.slow  # LitGPT's own commands are the default suite's LitGPT check (tests/project/test_litgpt_cli.py:
# the same GPT, exact across splits and on 2 processes, plain LitGPT's split dependence beside it); this loop runs
# with `-m slow`.
@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_litgpt_recipe_is_exact_across_splits_and_processes_where_litgpts_own_lines_are_not(tmp_path: Path) -> None:
    # The same 16 sequences per update as (m, A, D) = (4, 4, 1), (1, 16, 1) and (2, 4, 2): LitGPT's GPT, its own
    # chunked_cross_entropy, AdamW, float64.
    splits = {
        "4x4": ["--micro-batch-size", "4", "--accumulate", "4"],
        "1x16": ["--micro-batch-size", "1", "--accumulate", "16"],
    }
    exact = {name: _litgpt(args, tmp_path / name) for name, args in splits.items()}
    exact["2x4x2"] = _litgpt(["--micro-batch-size", "2", "--accumulate", "4", "--devices", "2"], tmp_path / "ddp")
    plain = {name: _litgpt([*args, "--plain"], tmp_path / f"plain-{name}") for name, args in splits.items()}
    reference = torch.tensor(exact["4x4"]["parameters"], dtype=torch.float64)
    for name in ("1x16", "2x4x2"):
        other = torch.tensor(exact[name]["parameters"], dtype=torch.float64)
        assert (other - reference).abs().max() < 1e-10, name  # AdamW on float64: rounding, amplified, stays below
        assert exact[name]["val_loss"] == pytest.approx(exact["4x4"]["val_loss"], rel=1e-12)
        assert exact[name]["losses"] == pytest.approx(exact["4x4"]["losses"], rel=1e-12)
        assert exact[name]["tokens"] == exact["4x4"]["tokens"]
    gap = torch.tensor(plain["1x16"]["parameters"]) - torch.tensor(plain["4x4"]["parameters"])
    assert gap.abs().max() > 1e-3  # LitGPT's loss / A: another objective at every split


def test_token_budget_recipe_runs_the_same_budget_for_two_splits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = load("token_budget")
    common = ["--budget", "3000", "--validate-every", "700", "--checkpoint-every", "1500", "--documents", "64"]
    common += ["--out", str(tmp_path), "--quiet"]
    first = recipe.main([*common, "--m", "4", "--accumulate", "2"])
    second = recipe.main([*common, "--m", "2", "--accumulate", "4"])
    printed = capsys.readouterr().out
    assert "m = 4, A = 2, D = 1: 8 sequences per update" in printed

    assert 3000 <= first["stopped_at_tokens"] == second["stopped_at_tokens"]
    assert first["validated_at_tokens"] == second["validated_at_tokens"] and len(first["validated_at_tokens"]) == 4
    assert first["checkpoints"] == second["checkpoints"] and len(first["checkpoints"]) == 2
    assert [n for n, _ in first["rates"]] == [n for n, _ in second["rates"]]
    assert [lr for _, lr in first["rates"]] == pytest.approx([lr for _, lr in second["rates"]], rel=1e-12)
    for name in first["checkpoints"]:
        assert (tmp_path / "m2_a4" / "checkpoints" / name).is_file()


@pytest.mark.timeout(300)
def test_batch_ramp_recipe_ramps_on_the_tokens_axis_and_each_run_agrees_across_its_splits(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lightning_accum import BatchSchedule

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    # The user's command, at half the default data (128 sequences, 2 epochs): the ramp still reaches its 3 stages.
    command = [sys.executable, str(EXAMPLES / "batch_ramp.py"), "--out", str(tmp_path), "--examples", "128"]
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "both runs: the two splits agree within 1e-10" in done.stdout
    assert "ramp, m = 4: A = 2 → 4 → 8" in done.stdout and "ramp, m = 2: A = 4 → 8 → 16" in done.stdout

    sys.path.insert(0, str(EXAMPLES))
    try:
        from _data import CountingSequences
    finally:
        sys.path.remove(str(EXAMPLES))
    tokens = 2 * CountingSequences(128).supervised_tokens()  # two epochs, every sequence once per epoch
    summary = json.loads((tmp_path / "summary.json").read_text())
    ramp, fixed = summary["runs"]["ramp"], summary["runs"]["fixed"]
    assert [s["samples_per_update"] for s in ramp["stages"]] == [8, 16, 32]
    assert [s["samples_per_update"] for s in fixed["stages"]] == [32]
    for record in (ramp, fixed):
        assert record["tokens"] == tokens == sum(s["tokens"] for s in record["stages"])
        assert record["updates"] == sum(s["updates"] for s in record["stages"])
        # float64: the splits m = 4 and m = 2 end on the same parameters up to rounding (1e-15 to 1e-13).
        assert record["max_parameter_difference"] < 1e-10
        assert record["held_out_loss"]["m2"] == pytest.approx(record["held_out_loss"]["m4"], rel=1e-12, abs=0)
    assert ramp["updates"] > fixed["updates"]  # the small early batches: more updates for the same tokens
    # The table: per run the stages reached with their updates, the tokens and the updates.
    u = [s["updates"] for s in ramp["stages"]]
    row = rf"^ramp +8 \({u[0]} updates\) → 16 \({u[1]}\) → 32 \({u[2]}\) +{tokens:,} +{ramp['updates']} "
    assert re.search(row, done.stdout, re.MULTILINE), done.stdout[-1500:]
    assert re.search(rf"^fixed +32 \({fixed['updates']} updates\) +{tokens:,} ", done.stdout, re.MULTILINE)

    # The logged global batch, read back from TensorBoard: on the tokens axis, one point per update at the tokens
    # seen after it, holding the batch of the stage where the update's group started (the ramp's thresholds).
    schedule = BatchSchedule("0:8 500:16 1.5K:32", axis="tokens")
    for run, expected_values in (("ramp", {8.0, 16.0, 32.0}), ("fixed", {32.0})):
        for m in (4, 2):
            events = EventAccumulator(str(tmp_path / run / f"m{m}"), size_guidance={"scalars": 0})
            events.Reload()
            points = [(int(e.step), e.value) for e in events.Scalars("accum/global_batch")]
            x = [step for step, _ in points]
            assert x == sorted(set(x)) and x[-1] == tokens, (run, m)
            assert len(points) == summary["runs"][run]["updates"], (run, m)
            assert {value for _, value in points} == expected_values, (run, m)
            if run == "ramp":
                starts = [0, *x[:-1]]
                assert [value for _, value in points] == [schedule.stage_at(s).samples for s in starts], m
            assert len(events.Scalars("accum/loss")) == len(points)
    assert (tmp_path / "loss_vs_tokens.png").stat().st_size > 0
