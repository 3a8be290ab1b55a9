"""The workers of the package's spawn/fork launchers: each trains a model of its own, and its process group is gone
before the interpreter finalizes (issue 23).

A module sent to workers by the fork server is pickled into shared memory, as under "spawn", but Lightning copies it
out of there only under "spawn": every worker would then update the one storage. The package's launcher copies it.

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

import lightning as L
import pytest
import torch
import torch.distributed
from helpers import (
    SEQ,
    TinyLM,
    assert_group_closed_before_exit,
    fit,
    load_ranks,
    make_examples,
    params_vector,
    random_lengths,
    record_threads_at_exit,
    sgd_reference,
)
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lightning_accum import DDPAccumulationStrategy
from lightning_accum._worker_exit import close_process_group
from lightning_accum.fabric import FabricDDPAccumulationStrategy


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


class _Record(L.Callback):
    """Saves, on each rank, whether the module's parameters were in shared memory when training started, and the
    parameters at the end."""

    def __init__(self, folder: str, name: str) -> None:
        self.folder, self.name, self.shared = folder, name, False

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.shared = any(p.is_shared() for p in pl_module.parameters())

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        state = {"params": params_vector(pl_module), "shared": self.shared}
        torch.save(state, os.path.join(self.folder, f"{self.name}-rank{trainer.global_rank}.pt"))


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_a_float64_module_sent_by_the_fork_server_trains_on_each_rank_as_the_float64_reference(tmp_path: Path) -> None:
    # m = 2, A = 2, D = 2: each group is B = 8 consecutive examples (rank r reads r, r + 2, ...). Before the fix each
    # rank's SGD wrote into the one shared storage: the ranks ended 0.11 and 0.12 from the reference, 0.10 apart.
    runs = {
        "ours": (DDPAccumulationStrategy, random_lengths(16, seed=1), "32-true"),
        "ours-64-true": (DDPAccumulationStrategy, random_lengths(16, seed=1), "64-true"),
        # Every micro-batch of SEQ tokens: Lightning's mean of micro-batch means is the token-weighted gradient too.
        "lightning": (DDPStrategy, [SEQ] * 16, "32-true"),
    }
    errors, shared = {}, {}
    for name, (strategy, lengths, precision) in runs.items():
        examples = make_examples(lengths, seed=1)
        expected = sgd_reference(TinyLM(seed=3), [examples[s : s + 8] for s in range(0, 16, 8)])
        fit(
            TinyLM(seed=3).double(),  # float64 before the fit: no precision plugin converts it into new storage
            examples,
            batch_size=2,
            accumulate=2,
            strategy=strategy(start_method="forkserver"),
            devices=2,
            precision=precision,
            callbacks=[_Record(str(tmp_path), name)],
        )
        ranks = load_ranks(str(tmp_path), name)
        errors[name] = [float((rank["params"] - expected).abs().max()) for rank in ranks]
        shared[name] = [rank["shared"] for rank in ranks]
    print(f"max |params - float64 reference| per rank: {errors}; parameters in shared memory: {shared}")
    assert max(errors["ours"] + errors["ours-64-true"]) < 1e-12
    assert shared == {"ours": [False] * 2, "ours-64-true": [False] * 2, "lightning": [True] * 2}
    assert min(errors["lightning"]) > 1e-3  # Lightning's own strategy: both ranks updated the same parameters


def _shared_in_worker(fabric: L.Fabric, module: nn.Module, modules: dict[str, nn.Module]) -> list[bool]:
    return [p.is_shared() for p in [*module.parameters(), *modules["second"].parameters()]]


@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_modules_given_to_fabric_launch_under_the_fork_server_are_each_workers_own() -> None:
    def shared(strategy: FabricDDPStrategy) -> list[bool]:
        fabric = L.Fabric(strategy=strategy, devices=2, accelerator="cpu")
        module, second = nn.Linear(3, 2, dtype=torch.float64), nn.Linear(3, 2, dtype=torch.float64)
        return fabric.launch(_shared_in_worker, module, modules={"second": second})  # nested in a keyword argument

    assert shared(FabricDDPAccumulationStrategy(start_method="forkserver")) == [False] * 4
    assert shared(FabricDDPStrategy(start_method="forkserver")) == [True] * 4  # Fabric's own, unchanged
