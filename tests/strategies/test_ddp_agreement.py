"""Replicas that disagree (unit, data length) under 2-process DDP: an error on every rank, not a hang."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    TinyLM,
    ddp_trainer,
    make_examples,
    run_ddp,
)
from torch.utils.data import DataLoader, IterableDataset

from lightning_accum import DDPAccumulationStrategy


class _Shard(IterableDataset):
    """Rank r yields `counts[r]` batches: an unevenly sharded stream."""

    def __init__(self, counts: tuple[int, int]) -> None:
        self.counts = counts

    def __iter__(self) -> Any:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        examples = make_examples([4] * (2 * self.counts[rank]), seed=rank)
        for i in range(self.counts[rank]):
            chunk = examples[2 * i : 2 * i + 2]
            yield {k: torch.stack([e[k] for e in chunk]) for k in ("input_ids", "labels")}


class _TokensOnRankZero(TinyLM):
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        return out if self.global_rank == 0 else out["loss"]


def _disagreeing_runs(rank: int, folder: str) -> None:
    messages = {}
    for name, model, counts in (("units", _TokensOnRankZero(), (4, 4)), ("uneven", TinyLM(), (6, 4))):
        trainer = ddp_trainer("accum_ddp", accumulate=2)
        try:
            trainer.fit(model, DataLoader(_Shard(counts), batch_size=None))
            messages[name] = "no error"
        except RuntimeError as err:
            messages[name] = str(err)
    Path(folder, f"rank{rank}.json").write_text(json.dumps(messages))


@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_replicas_that_disagree_get_an_error_not_a_hang(tmp_path: Path) -> None:
    run_ddp(_disagreeing_runs, str(tmp_path))
    for rank in (0, 1):
        messages = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "Replicas weight micro-batches by different units" in messages["units"], messages
        assert "The training data of 1 of 2 replicas ended with this accumulation group" in messages["uneven"]


def _uneven_inside_a_group(rank: int, folder: str) -> None:
    import datetime

    # A timeout far above what the run needs: the test shows the error comes from the package, not from it.
    strategy = DDPAccumulationStrategy(start_method="popen", timeout=datetime.timedelta(seconds=60))
    trainer = ddp_trainer(strategy, accumulate=3)
    result = {"error": "no error"}
    try:
        trainer.fit(TinyLM(), DataLoader(_Shard((7, 4)), batch_size=None))
    except RuntimeError as err:
        result["error"] = str(err)
    Path(folder, f"inside-rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.ddp
@pytest.mark.timeout(120)
def test_data_that_ends_inside_a_group_unevenly_is_an_error_on_every_rank(tmp_path: Path) -> None:
    # 7 vs 4 batches with A = 3: rank 1's data ends at batch 3, inside the group 3, 4, 5 of rank 0. Under iterable
    # data every micro-batch that does not end a group carries a "my data ends here" flag (one small all-reduce), so
    # both ranks stop at batch 3 with the same error instead of waiting for the process group's timeout.
    run_ddp(_uneven_inside_a_group, str(tmp_path))
    for rank in (0, 1):
        result = json.loads((tmp_path / f"inside-rank{rank}.json").read_text())
        assert (
            "The training data of 1 of 2 replicas ended at batch 3 of the epoch, inside an accumulation group"
            in (result["error"])
        ), result
        assert f"this replica's data {'goes on' if rank == 0 else 'ended'}" in result["error"]
