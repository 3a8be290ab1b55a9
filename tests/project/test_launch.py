"""Launchers: torchrun as 2 nodes x 1 process on the loopback interface, and Lightning's own `accum_ddp`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import TinyLM, launch_env, make_examples, relative_error, sgd_reference, torchrun_two_nodes

pytestmark = [pytest.mark.ddp, pytest.mark.timeout(600)]

SCRIPT = Path(__file__).resolve().parents[1] / "launch_script.py"
UNEQUAL = [6, 1, 5, 2, 6, 1, 4, 1, 6, 2, 5, 1, 6, 1, 3, 2]


def expected() -> torch.Tensor:
    examples = make_examples(UNEQUAL, seed=21)
    return sgd_reference(TinyLM(lr=0.5, seed=21), [examples[:8], examples[8:]], lr=0.5)


def check(out: Path) -> None:
    result = torch.load(out, weights_only=True)
    assert (result["replicas"], result["world_size"]) == (2, 2)
    assert relative_error(result["params"], expected()) < 1e-5
    ledger = result["ledger"]
    assert (ledger["updates_applied"], ledger["tokens"], ledger["samples"]) == (2, sum(UNEQUAL), 16)


def test_torchrun_two_nodes_one_process_each(tmp_path: Path) -> None:
    out = tmp_path / "torchrun.pt"
    torchrun_two_nodes(SCRIPT, str(out), "torchrun", env=launch_env())
    check(out)


def test_lightning_launcher_from_a_script(tmp_path: Path) -> None:
    out = tmp_path / "launcher.pt"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), "launcher"],
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    check(out)
