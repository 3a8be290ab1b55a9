"""FSDP2 and tensor parallelism on Lightning's ModelParallelStrategy, 2 processes over gloo on CPU: the sharded runs
equal the single-process run of the same groups (D = data-parallel replicas, tokens counted once per replica), and
plain ModelParallelStrategy on the same data does not."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import IGNORE, ListDataset, RankStridedSampler, free_port, make_examples, relative_error, run_ddp
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch import Tensor, nn
from torch.utils.data import DataLoader

import lightning_accum
from lightning_accum import AccumulationLedger, AccumulationReport, AxisLogger, ModelParallelAccumulationStrategy

WIDTH = 12  # vocabulary rows and logits (the data's ids and labels stay below helpers.VOCAB = 11)
# Even positions go to data-parallel rank 0, odd ones to rank 1: rank 0 holds the long sequences.
UNEQUAL = [6, 1, 5, 2, 6, 1, 4, 1, 6, 2, 5, 1, 6, 1, 3, 2, 6, 1, 5, 1]
CLIP = 0.2  # below the first update's gradient norm (0.48): clipping acts on the sharded gradient
# AdamW (with clipping) as users run it; SGD (without) as well, since AdamW hides a wrong overall gradient scale.
OPTIMIZERS = {"adamw": (0.05, CLIP), "sgd": (0.5, None)}


class ShardedLM(L.LightningModule):
    """Embedding, a residual MLP and a head; `configure_model` shards it with FSDP2 (`layout="fsdp"`), tensor
    parallelism (`"tp"`) or not at all (`None`, and always on one device)."""

    def __init__(self, layout: str | None = None, seed: int = 5, optimizer: str = "adamw") -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layout = layout
        self.optimizer = optimizer
        self.embed = nn.Embedding(WIDTH, 8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.head = nn.Linear(8, WIDTH)

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if mesh is None or self.layout is None:
            return
        if self.layout == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for module in (self.embed, self.up, self.down, self.head):
                fully_shard(module, mesh=mesh["data_parallel"])
        else:
            from torch.distributed.tensor import Replicate
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            plan = {
                "embed": RowwiseParallel(input_layouts=Replicate()),
                "up": ColwiseParallel(),
                "down": RowwiseParallel(),
                "head": ColwiseParallel(output_layouts=Replicate()),
            }
            parallelize_module(self, mesh["tensor_parallel"], plan)  # type: ignore[arg-type]

    def forward(self, input_ids: Tensor) -> Tensor:
        h = torch.tanh(self.embed(input_ids))
        return self.head(h + self.down(torch.tanh(self.up(h))))

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Any:
        logits = self(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE)
        return {"loss": loss, "num_tokens": (batch["labels"] != IGNORE).sum()}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        lr = OPTIMIZERS[self.optimizer][0]
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=lr)
        return torch.optim.AdamW(self.parameters(), lr=lr)


def full_params(module: nn.Module) -> Tensor:
    """Every parameter, gathered from its shards (a collective under FSDP2 / tensor parallelism), in float64."""
    parts = []
    for p in module.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        parts.append(full.detach().reshape(-1).to(torch.float64))
    return torch.cat(parts)


class Record(L.Callback):
    """Saves rank `r`'s gathered parameters and ledger to `folder/name-rank{r}.pt`."""

    def __init__(self, folder: str, name: str) -> None:
        self.folder, self.name = folder, name

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        params = full_params(pl_module)
        ledger = getattr(trainer.strategy, "ledger", None)
        state = {"params": params, "ledger": ledger.state_dict() if ledger is not None else None}
        torch.save(state, os.path.join(self.folder, f"{self.name}-rank{trainer.global_rank}.pt"))


def _fit(
    model: ShardedLM,
    examples: list[dict[str, Tensor]],
    strategy: Any,
    batch_size: int,
    accumulate: int,
    devices: int,
    callbacks: list[L.Callback],
    split: bool,
) -> L.Trainer:
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=OPTIMIZERS[model.optimizer][1],
        max_epochs=1,
        logger=False,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    sampler = RankStridedSampler(len(examples)) if split else None
    trainer.fit(model, DataLoader(ListDataset(examples), batch_size=batch_size, sampler=sampler))
    return trainer


def _load(folder: str, name: str) -> list[dict[str, Any]]:
    return [torch.load(os.path.join(folder, f"{name}-rank{r}.pt"), weights_only=True) for r in range(2)]


def _counts(ledger: dict[str, Any]) -> dict[str, Any]:
    """The ledger's exact counters (the group loss is a float, compared with a tolerance elsewhere)."""
    state = AccumulationLedger()
    state.load_state_dict(ledger)
    out = state.state_dict()
    last = out.pop("last_group")
    out["last_group_counts"] = {k: v for k, v in last.items() if k != "loss"}
    return out


def _single(folder: str, examples: list[dict[str, Tensor]], accumulate: int, optimizer: str) -> dict[str, Any]:
    """The single-process run of the same groups (batch 2, `accumulate` micro-batches)."""
    name = f"single-{optimizer}"
    _fit(ShardedLM(optimizer=optimizer), examples, "accum", 2, accumulate, 1, [Record(folder, name)], split=False)
    return torch.load(os.path.join(folder, f"{name}-rank0.pt"), weights_only=True)


# (gradient_sync, optimizer) of the FSDP2 runs
FSDP_RUNS = [("every_microbatch", "adamw"), ("last_microbatch", "adamw"), ("every_microbatch", "sgd")]


def _fsdp_runs(rank: int, folder: str) -> None:
    examples = make_examples(UNEQUAL, seed=8)
    for mode, optimizer in FSDP_RUNS:
        name = f"{mode}-{optimizer}"
        strategy = ModelParallelAccumulationStrategy(tensor_parallel_size=1, gradient_sync=mode)
        callbacks: list[L.Callback] = [Record(folder, name), AccumulationReport(path=os.path.join(folder, name))]
        _fit(ShardedLM("fsdp", optimizer=optimizer), examples, strategy, 2, 2, 2, callbacks, split=True)
    plain = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    _fit(ShardedLM("fsdp"), examples, plain, 2, 2, 2, [Record(folder, "plain")], split=True)


def _tp_runs(rank: int, folder: str) -> None:
    examples = make_examples(UNEQUAL[:18], seed=9)
    for optimizer in OPTIMIZERS:
        name = f"tp-{optimizer}"
        callbacks: list[L.Callback] = [Record(folder, name), AccumulationReport(path=os.path.join(folder, name))]
        _fit(ShardedLM("tp", optimizer=optimizer), examples, "accum_model_parallel", 2, 2, 2, callbacks, split=False)


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_fsdp2_matches_the_single_process_run_in_both_sync_modes_and_plain_lightning_does_not(tmp_path: Path) -> None:
    # m = 2, A = 2, D = 2 over 20 examples: per replica 5 micro-batches, groups of 2, 2 and a partial 1; on one
    # process m = 2, A = 4: groups 0-7, 8-15 and the partial 16-19, the same examples. AdamW, clipping at 0.5.
    run_ddp(_fsdp_runs, str(tmp_path))
    examples = make_examples(UNEQUAL, seed=8)
    singles = {name: _single(str(tmp_path), examples, 4, name) for name in OPTIMIZERS}
    assert singles["adamw"]["ledger"]["partial_groups"] == 1 and singles["adamw"]["ledger"]["updates_applied"] == 3

    for mode, optimizer in FSDP_RUNS:
        name, single = f"{mode}-{optimizer}", singles[optimizer]
        for rank in _load(str(tmp_path), name):
            assert relative_error(rank["params"], single["params"]) < 1e-5, name
            assert _counts(rank["ledger"]) == _counts(single["ledger"]), name
            assert rank["ledger"]["last_group"]["loss"] == pytest.approx(single["ledger"]["last_group"]["loss"])
        report = json.loads((tmp_path / name / "accumulation_report.json").read_text())
        assert report["data_parallel_replicas"] == 2 and report["tensor_parallel_size"] == 1
        assert report["effective_batch"]["arithmetic"] == "2 × 2 × 2 = 8"
        assert report["tokens"]["total"] == sum(UNEQUAL)

    plain = _load(str(tmp_path), "plain")[0]
    error = relative_error(plain["params"], singles["adamw"]["params"])
    assert error > 1e-3, error  # mean of micro-batch means, the partial group at k/A: a different update


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_tensor_parallel_counts_tokens_once_with_d_equal_one(tmp_path: Path) -> None:
    # dp = 1, tp = 2: both ranks read every batch. 18 examples, m = 2, A = 2: 4 groups and a partial one.
    run_ddp(_tp_runs, str(tmp_path))
    examples = make_examples(UNEQUAL[:18], seed=9)
    for optimizer in OPTIMIZERS:
        single = _single(str(tmp_path), examples, 2, optimizer)
        ranks = _load(str(tmp_path), f"tp-{optimizer}")
        for rank in ranks:
            assert relative_error(rank["params"], single["params"]) < 1e-5, optimizer
            assert _counts(rank["ledger"]) == _counts(single["ledger"]), optimizer
        assert ranks[0]["ledger"]["tokens"] == sum(UNEQUAL[:18])  # not twice: the two devices share one replica
        assert ranks[0]["ledger"]["partial_groups"] == 1
    report = json.loads((tmp_path / "tp-adamw" / "accumulation_report.json").read_text())
    assert report["data_parallel_replicas"] == 1 and report["tensor_parallel_size"] == 2
    assert report["effective_batch"]["arithmetic"] == "2 × 2 × 1 = 4; tensor parallel 2 (devices sharing one replica)"
