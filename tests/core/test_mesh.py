"""core/mesh: the mesh's sizes checked before any process starts, and `timeout=` on every group of the mesh."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import ListDataset, make_examples, make_trainer, run_ddp
from strategies.test_model_parallel import UNEQUAL, DataParallelStridedSampler, ShardedLM
from torch.utils.data import DataLoader

from lightning_accum import ModelParallelAccumulationStrategy


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        (
            {"data_parallel_size": 2, "tensor_parallel_size": 2},
            r"`data_parallel_size=2` × `tensor_parallel_size=2` = 4,",
        ),
        ({"data_parallel_size": 3}, r"not a multiple of data_parallel_size=3, so `tensor_parallel_size` cannot be"),
    ],
)
def test_a_world_size_that_is_not_dp_times_tp_is_named_before_any_process_starts(
    sizes: dict[str, int], message: str
) -> None:
    strategy = ModelParallelAccumulationStrategy(**sizes)  # type: ignore[arg-type]
    make_trainer(strategy=strategy, devices=2)
    with pytest.raises(ValueError, match=message):
        strategy.setup_environment()  # the first thing Lightning runs on every process, before the process group


TIMEOUT = timedelta(seconds=123)  # neither Lightning's nor torch's default (30 minutes)


def group_timeouts() -> list[tuple[list[int], timedelta]]:
    """Every process group this rank belongs to (torch's registry of them, the default group included), by its global
    ranks, with the timeout its gloo backend waits for a collective (private names of torch, read by this test
    only)."""
    from torch.distributed.distributed_c10d import _world

    cpu = torch.device("cpu")
    return [
        (torch.distributed.get_process_group_ranks(g), g._get_backend(cpu).options._timeout)
        for g in list(_world.pg_map)
    ]


class RecordGroups(L.Callback):
    """At the end of a fit: every process group, with its timeout (`group_timeouts`), to `folder/groups-rank{r}.pt`."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        torch.save(group_timeouts(), os.path.join(self.folder, f"groups-rank{trainer.global_rank}.pt"))


def _groups_worker(rank: int, folder: str, door: str) -> None:
    if door == "trainer":
        strategy = ModelParallelAccumulationStrategy(data_parallel_size=2, tensor_parallel_size=2, timeout=TIMEOUT)
        trainer = make_trainer(
            strategy=strategy, devices=4, accumulate_grad_batches=2, callbacks=[RecordGroups(folder)]
        )
        examples = make_examples(UNEQUAL[:8], seed=8)
        sampler = DataParallelStridedSampler(len(examples), tensor_parallel=2)
        trainer.fit(ShardedLM("2d"), DataLoader(ListDataset(examples), batch_size=2, sampler=sampler))
        return
    from lightning_accum.fabric import FabricModelParallelAccumulationStrategy

    fabric_strategy = FabricModelParallelAccumulationStrategy(
        lambda model, mesh: model, data_parallel_size=2, tensor_parallel_size=2, timeout=TIMEOUT
    )
    fabric = L.Fabric(strategy=fabric_strategy, devices=4, accelerator="cpu")
    fabric.launch()  # the processes exist (run_ddp): the process group and the mesh
    evaluation = fabric_strategy.evaluation()  # one reduction over the data-parallel group
    evaluation.add(torch.tensor(1.0), num_tokens=1)
    evaluation.compute()
    torch.save(group_timeouts(), os.path.join(folder, f"groups-rank{rank}.pt"))


@pytest.mark.ddp
@pytest.mark.timeout(600)
@pytest.mark.parametrize("door", ["trainer", "fabric"])
def test_timeout_reaches_every_process_group_of_a_two_by_two_mesh(tmp_path: Path, door: str) -> None:
    # (data, tensor) = (2, 2) on 4 processes: torch's device mesh makes a group per dimension (ranks {0, 2} and {0, 1}
    # for rank 0), with torch's default 30 minutes unless the strategy hands them its `timeout=`.
    run_ddp(_groups_worker, str(tmp_path), door, world_size=4)
    for rank in range(4):
        groups = torch.load(tmp_path / f"groups-rank{rank}.pt", weights_only=False)
        tensor_parallel, data_parallel = [rank - rank % 2, rank - rank % 2 + 1], [rank % 2, rank % 2 + 2]
        assert {tuple(ranks) for ranks, _ in groups} >= {(0, 1, 2, 3), tuple(tensor_parallel), tuple(data_parallel)}
        assert all(timeout == TIMEOUT for _, timeout in groups), (rank, groups)
