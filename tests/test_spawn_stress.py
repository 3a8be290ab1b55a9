"""The end of spawned workers (issue 23): the process group is gone before the interpreter finalizes.

A crash at the end of 2-process spawn runs ("terminate called without an active exception", SIGABRT) comes from
native threads of the gloo process group meeting the interpreter's finalization. The package's launcher closes
the group in each worker before it exits; these tests check that from inside the workers, and run the stress
loop of ``benchmarks/spawn_stress.py`` (slow; its real runs are described in ``benchmarks/SPAWN_STRESS.md``).
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed
from helpers import TinyLM, fit, make_examples, random_lengths

from lightning_accum._worker_exit import close_process_group

ROOT = Path(__file__).resolve().parents[1]


def _threads() -> list[str]:
    """Names of this process's native threads (Linux)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return names


class _ExitProbe(TinyLM):
    """Writes, at the worker's interpreter exit (atexit runs before finalization), what is still alive."""

    def __init__(self, folder: str) -> None:
        super().__init__(report="tokens")
        self.folder = folder

    def on_fit_end(self) -> None:
        path = os.path.join(self.folder, f"exit-rank{self.global_rank}.json")
        during_fit = _threads()

        def write() -> None:
            state = {
                "initialized": torch.distributed.is_initialized(),
                "threads_at_exit": _threads(),
                "threads_during_fit": during_fit,
            }
            Path(path).write_text(json.dumps(state))

        atexit.register(write)


@pytest.mark.ddp
@pytest.mark.skipif(sys.platform != "linux", reason="reads thread names from /proc")
def test_spawned_workers_close_the_process_group_before_interpreter_exit(tmp_path: Path) -> None:
    examples = make_examples(random_lengths(16, seed=3), seed=3)
    fit(_ExitProbe(str(tmp_path)), examples, batch_size=2, accumulate=2, strategy="accum_ddp_spawn", devices=2)
    for rank in range(2):
        state = json.loads((tmp_path / f"exit-rank{rank}.json").read_text())
        gloo_during = [n for n in state["threads_during_fit"] if "gloo" in n]
        assert gloo_during, state  # the probe sees the group's threads while the group lives
        assert not state["initialized"]
        assert not [n for n in state["threads_at_exit"] if "gloo" in n or "tcpstore" in n], state


def test_close_process_group_without_a_group_does_nothing() -> None:
    assert not torch.distributed.is_initialized()
    assert close_process_group(object()) is False


def _stress_module() -> Any:
    spec = importlib.util.spec_from_file_location("spawn_stress", ROOT / "benchmarks" / "spawn_stress.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(900)
def test_stress_loop_counts_runs_and_finds_no_crash(tmp_path: Path) -> None:
    stress = _stress_module()
    summary = stress.stress(2, ["accum_ddp_spawn", "ddp_spawn"], tmp_path, batch=2, updates=2, timeout=400.0)
    for variant in ("accum_ddp_spawn", "ddp_spawn"):
        assert summary["counts"][variant]["runs"] == 2
        assert summary["counts"][variant]["failed"] == 0, summary["failures"]
    assert json.loads((tmp_path / "summary.json").read_text())["counts"] == summary["counts"]
    assert "| `accum_ddp_spawn` | 2 | 0 |" in (tmp_path / "summary.md").read_text()


def test_stress_loop_rejects_an_unknown_variant(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"`variants` must be among .* got 'ddp_fork'"):
        _stress_module().stress(1, ["ddp_fork"], tmp_path)


def _race_module() -> Any:
    spec = importlib.util.spec_from_file_location("spawn_exit_race", ROOT / "benchmarks" / "spawn_exit_race.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(900)
@pytest.mark.skipif(sys.version_info >= (3, 14), reason="Python 3.14 hangs such threads instead of ending them")
def test_forced_exit_race_aborts_unless_the_group_is_closed() -> None:
    race = _race_module()
    crashed = race.run("exit", 1)
    assert crashed["sigabrt"] == 1 and crashed["terminate_message"] == 1, crashed
    closed = race.run("close", 1)
    assert closed == {"mode": "close", "runs": 1, "sigabrt": 0, "terminate_message": 0, "other": 0}
