"""Replicas that disagree (unit, data length) under 2-process DDP: an error on every rank, not a hang."""

from __future__ import annotations

import json
import warnings
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

    strategy = DDPAccumulationStrategy(start_method="popen", timeout=datetime.timedelta(seconds=10))
    trainer = ddp_trainer(strategy, accumulate=3)
    result = {"error": "no error", "hint": False}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(TinyLM(), DataLoader(_Shard((5, 4)), batch_size=None))
        except RuntimeError as err:
            result["error"] = str(err)
    result["hint"] = any("collective timed out" in str(w.message) for w in caught)
    Path(folder, f"inside-rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.ddp
@pytest.mark.timeout(120)
def test_data_that_ends_inside_a_group_unevenly_ends_at_the_timeout_with_a_hint(tmp_path: Path) -> None:
    # 5 vs 4 batches with A = 3: the replicas' data ends inside the same group at different micro-batches. That
    # cannot be caught without a collective per micro-batch (their collectives pair up wrongly first); what the
    # package guarantees is that the strategy's `timeout=` bounds the wait and every rank says what to look at.
    run_ddp(_uneven_inside_a_group, str(tmp_path))
    for rank in (0, 1):
        result = json.loads((tmp_path / f"inside-rank{rank}.json").read_text())
        assert result["error"] != "no error" and result["hint"], result


# ---------------------------------------------------------------------------- LightningCLI
