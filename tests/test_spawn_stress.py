"""The end of spawned workers (issue 23): the process group is gone before the interpreter finalizes.

A crash at the end of 2-process spawn runs ("terminate called without an active exception", SIGABRT) comes from
native threads of the gloo process group meeting the interpreter's finalization. The package's launcher closes
the group in each worker before it exits; these tests check that from inside the workers. The stress loop of
``benchmarks/spawn_stress.py`` and the forced race of ``benchmarks/spawn_exit_race.py`` are tested beside those scripts,
in ``benchmarks/test_benchmarks.py`` (their real runs are described in ``benchmarks/SPAWN_STRESS.md``).
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed
from helpers import TinyLM, fit, make_examples, random_lengths

from lightning_accum._worker_exit import close_process_group


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
