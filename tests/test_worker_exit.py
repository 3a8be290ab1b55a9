"""The end of spawned workers (issue 23): the process group is gone before the interpreter finalizes.

A crash at the end of 2-process spawn runs ("terminate called without an active exception", SIGABRT) comes from
native threads of the gloo process group meeting the interpreter's finalization. The package's launcher closes
the group in each worker before it exits; these tests check that from inside the workers. The stress loop of
``benchmarks/spawn_stress.py`` and the forced race of ``benchmarks/spawn_exit_race.py`` are tested beside those scripts,
in ``benchmarks/test_benchmarks.py`` (their real runs are described in ``benchmarks/SPAWN_STRESS.md``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed
from helpers import TinyLM, assert_group_closed_before_exit, fit, make_examples, random_lengths, record_threads_at_exit

from lightning_accum._worker_exit import close_process_group


class _ExitProbe(TinyLM):
    """Writes, at the worker's interpreter exit (atexit runs before finalization), what is still alive."""

    def __init__(self, folder: str) -> None:
        super().__init__(report="tokens")
        self.folder = folder

    def on_fit_end(self) -> None:
        record_threads_at_exit(os.path.join(self.folder, f"exit-rank{self.global_rank}.json"))


@pytest.mark.ddp
@pytest.mark.skipif(sys.platform != "linux", reason="reads thread names from /proc")
def test_spawned_workers_close_the_process_group_before_interpreter_exit(tmp_path: Path) -> None:
    examples = make_examples(random_lengths(16, seed=3), seed=3)
    fit(_ExitProbe(str(tmp_path)), examples, batch_size=2, accumulate=2, strategy="accum_ddp_spawn", devices=2)
    for rank in range(2):
        assert_group_closed_before_exit(tmp_path / f"exit-rank{rank}.json")


def test_close_process_group_without_a_group_does_nothing() -> None:
    assert not torch.distributed.is_initialized()
    assert close_process_group(object()) is False
