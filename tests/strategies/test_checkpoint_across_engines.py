"""A checkpoint resumed under another engine: one device, DDP and FSDP2 (one file and a sharded folder), at an update
boundary and inside a group, under another D and A. Every resumed run is compared with a float64 reference of the
groups it actually formed (the micro-batches before the checkpoint and after the resume, by update), so a carried
gradient weighted x2 or x1/2 by a change of engine shows as a parameter error of about 1e-2 (issue #29)."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from helpers import (
    IGNORE,
    ResumableLoader,
    TinyLM,
    make_examples,
    make_trainer,
    params_vector,
    random_lengths,
    relative_error,
    run_ddp,
    sgd_reference,
)
from torch import Tensor
from torch.utils.data import Dataset, Sampler

from lightning_accum import AccumulationStrategy, DDPAccumulationStrategy, ModelParallelAccumulationStrategy

N = 24  # examples, micro-batches of 2
LR = 0.5
MOMENTUM = 0.5  # the optimizer has a state to carry (Lightning's FSDP2 loader fails on an empty one)
EXAMPLES = make_examples(random_lengths(N, seed=81), seed=81)
# Where each writer saves (micro-batch index of the epoch after which it writes; its data consumed per replica).
# Two replicas with A = 2: a group is micro-batches 2g, 2g + 1 on each. One replica (one device, or two processes
# under tensor parallelism) with A = 4.
WRITERS = {
    "one": {"replicas": 1, "accumulate": 4, "boundary": 3, "inside": 5},
    "tp-folder": {"replicas": 1, "accumulate": 4, "boundary": 3, "inside": 5},  # 2 processes, 1 replica
    "ddp": {"replicas": 2, "accumulate": 2, "boundary": 1, "inside": 2},
    "fsdp-file": {"replicas": 2, "accumulate": 2, "boundary": 1, "inside": 2},
    "fsdp-folder": {"replicas": 2, "accumulate": 2, "boundary": 1, "inside": 2},
}
# Readers: DDP and FSDP2 on 2 processes with A = 2, one device and tensor parallelism (2 processes, one replica)
# with A = 3 (another D and another A).
READERS = {"one": 3, "ddp": 2, "fsdp": 2, "tp": 3}
# Lightning's own loaders read files only: a sharded folder is resumed by the model-parallel strategy (any layout).
READS = {writer: (["fsdp", "tp"] if writer.endswith("folder") else list(READERS)) for writer in WRITERS}


class Indexed(Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {**EXAMPLES[index], "idx": torch.tensor(index)}


class PerRankBatches(Sampler[list[int]]):
    """Rank r's batches (of example indices), read when iterating (the sampler is built before processes start)."""

    def __init__(self, by_rank: list[list[list[int]]], tensor_parallel: int = 1) -> None:
        self.by_rank, self.tensor_parallel = by_rank, tensor_parallel

    def _mine(self) -> list[list[int]]:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        return self.by_rank[rank // self.tensor_parallel]  # the ranks of one replica read the same data

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._mine())

    def __len__(self) -> int:
        return len(self._mine())


def _layout(examples: list[int], replicas: int, skipped: int) -> list[list[list[int]]]:
    """`skipped` batches already consumed by the run that wrote the checkpoint (the loader skips them on resume),
    then `examples` in micro-batches of 2 dealt to the ranks in turn."""
    pairs = [examples[i : i + 2] for i in range(0, len(examples), 2)]
    return [[[0, 1]] * skipped + pairs[rank::replicas] for rank in range(replicas)]


class ShardableLM(TinyLM):
    """TinyLM with SGD; under the model-parallel strategy `configure_model` shards it with FSDP2. Records, for each
    micro-batch, Lightning's step count (the update it belongs to) and the examples in it."""

    def __init__(self) -> None:
        super().__init__(lr=LR)
        self.records: list[tuple[int, int, list[int]]] = []

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if mesh is None:
            return
        if mesh["tensor_parallel"].size() > 1:
            from torch.distributed.tensor import Replicate
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            plan = {
                "embed": RowwiseParallel(input_layouts=Replicate()),
                "head": ColwiseParallel(output_layouts=Replicate()),
            }
            parallelize_module(self, mesh["tensor_parallel"], plan)  # type: ignore[arg-type]
            return
        from torch.distributed.fsdp import fully_shard

        for module in (self.embed, self.head):
            fully_shard(module, mesh=mesh["data_parallel"])

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Any:
        self.records.append((batch_idx, self.trainer.global_step, batch["idx"].tolist()))
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)


class SaveAt(L.Callback):
    def __init__(self, at: dict[int, str]) -> None:
        self.at = at

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if args[-1] in self.at:
            trainer.save_checkpoint(self.at[args[-1]])


class Finish(L.Callback):
    """Writes rank r's records, and on rank 0 the whole parameters and the ledger, to `folder/name-rank{r}.json`."""

    def __init__(self, folder: str, name: str) -> None:
        self.folder, self.name = folder, name

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        parts = [(p.full_tensor() if hasattr(p, "full_tensor") else p) for p in pl_module.parameters()]
        result = {
            "records": pl_module.records,  # type: ignore[attr-defined]
            "params": torch.cat([p.detach().reshape(-1).double() for p in parts]).tolist(),
            "ledger": {k: v for k, v in trainer.strategy.ledger.state_dict().items() if k != "last_group"},  # type: ignore[attr-defined]
        }
        Path(self.folder, f"{self.name}-rank{trainer.global_rank}.json").write_text(json.dumps(result))


def _strategy(kind: str) -> Any:
    if kind == "one":
        return AccumulationStrategy()
    if kind == "ddp":
        return DDPAccumulationStrategy(start_method="popen")
    return ModelParallelAccumulationStrategy(
        tensor_parallel_size=2 if kind.startswith("tp") else 1, save_distributed_checkpoint=kind.endswith("folder")
    )


def _fit(kind: str, accumulate: int, batches: list[list[list[int]]], callbacks: list[L.Callback], ckpt: Any) -> None:
    trainer = make_trainer(
        strategy=_strategy(kind),
        devices=1 if kind == "one" else 2,
        accumulate_grad_batches=accumulate,
        callbacks=callbacks,
    )
    loader = ResumableLoader(Indexed(), batch_sampler=PerRankBatches(batches, 2 if kind.startswith("tp") else 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's resume notes; the package's notes are checked elsewhere
        trainer.fit(ShardableLM(), loader, ckpt_path=ckpt)


def _write(kind: str, folder: str) -> None:
    config = WRITERS[kind]
    replicas = int(config["replicas"])
    at = {int(config[where]): os.path.join(folder, f"{kind}-{where}.ckpt") for where in ("boundary", "inside")}
    _fit(
        kind, int(config["accumulate"]), _layout(list(range(N)), replicas, 0), [SaveAt(at), Finish(folder, kind)], None
    )


def _consumed(folder: str, writer: str, where: str) -> tuple[list[tuple[int, list[int]]], list[int]]:
    """The writer's micro-batches before its checkpoint (update, examples) and the examples not yet consumed."""
    config = WRITERS[writer]
    last = int(config[where])
    records = [
        (step, ids)
        for rank in range(int(config["replicas"]))  # replicas (tensor parallelism: rank 0 records the replica)
        for batch_idx, step, ids in json.loads(Path(folder, f"{writer}-rank{rank}.json").read_text())["records"]
        if batch_idx <= last
    ]
    seen = {i for _, ids in records for i in ids}
    return records, [i for i in range(N) if i not in seen]


def _read(reader: str, writer: str, where: str, folder: str) -> None:
    config = WRITERS[writer]
    _, remaining = _consumed(folder, writer, where)
    batches = _layout(remaining, _replicas(reader), int(config[where]) + 1)
    ckpt = os.path.join(folder, f"{writer}-{where}.ckpt")
    _fit(reader, READERS[reader], batches, [Finish(folder, f"{writer}-{where}-to-{reader}")], ckpt)


def _replicas(kind: str) -> int:
    return 1 if kind == "one" or kind.startswith("tp") else 2


def _distributed_runs(rank: int, folder: str) -> None:
    for writer in ("ddp", "fsdp-file", "fsdp-folder", "tp-folder"):
        _write(writer, folder)
    for writer, readers in READS.items():
        for reader in readers:
            if reader != "one":
                for where in ("boundary", "inside"):
                    _read(reader, writer, where, folder)
    # A carried gradient of the wrong shape, resumed under FSDP2: the package's error naming the key (it reached
    # torch's own error before, the check being skipped under FSDP2).
    damaged = os.path.join(folder, f"damaged-rank{rank}.ckpt")
    state = torch.load(os.path.join(folder, "ddp-inside.ckpt"), weights_only=True)
    state["lightning_accum"]["open_group"]["gradients"]["head.bias"] = torch.zeros(3)
    torch.save(state, damaged)
    try:
        _fit("fsdp", 2, _layout(list(range(N)), 2, 3), [], damaged)
        said = "no error"
    except ValueError as error:
        said = str(error)
    Path(folder, f"damaged-said-rank{rank}.txt").write_text(said)


def _reference(folder: str, writer: str, where: str, reader: str) -> tuple[Tensor, dict[str, int]]:
    """float64 SGD over the groups the two runs formed, and the ledger those groups give."""
    before, _ = _consumed(folder, writer, where)
    name = f"{writer}-{where}-to-{reader}"
    after = [
        (step, ids)
        for rank in range(_replicas(reader))  # under tensor parallelism both ranks record the one replica's data
        for _, step, ids in json.loads(Path(folder, f"{name}-rank{rank}.json").read_text())["records"]
    ]
    groups: dict[int, list[int]] = {}
    for step, ids in before + after:
        groups.setdefault(step, []).extend(ids)
    assert sorted(i for ids in groups.values() for i in ids) == list(range(N))  # every example exactly once
    params = sgd_reference(ShardableLM(), [[EXAMPLES[i] for i in groups[s]] for s in sorted(groups)], LR, MOMENTUM)
    tokens = sum(int((EXAMPLES[i]["labels"] != IGNORE).sum()) for i in range(N))
    ledger = {"updates_applied": len(groups), "microbatches": len(before) + len(after), "tokens": tokens, "samples": N}
    return params, ledger


@pytest.mark.ddp
@pytest.mark.timeout(900)
def test_a_checkpoint_resumes_exactly_under_every_engine_d_and_a(tmp_path: Path) -> None:
    folder = str(tmp_path)
    _write("one", folder)
    run_ddp(_distributed_runs, folder)
    for where in ("boundary", "inside"):
        for writer in ("one", "ddp", "fsdp-file"):
            _read("one", writer, where, folder)

    assert (tmp_path / "fsdp-folder-inside.ckpt").is_dir() and (tmp_path / "fsdp-file-inside.ckpt").is_file()
    assert (tmp_path / "tp-folder-inside.ckpt").is_dir()
    errors = {}
    for writer, readers in READS.items():
        for reader in readers:
            for where in ("boundary", "inside"):
                expected, ledger = _reference(folder, writer, where, reader)
                result = json.loads(Path(folder, f"{writer}-{where}-to-{reader}-rank0.json").read_text())
                errors[(writer, where, reader)] = relative_error(torch.tensor(result["params"]), expected)
                assert {k: result["ledger"][k] for k in ledger} == ledger, (writer, where, reader)
    assert max(errors.values()) < 1e-5, "; ".join(f"{'/'.join(k)} {v:.1e}" for k, v in errors.items())
    # The uninterrupted writers themselves against the same reference (the measure is not loose).
    for writer in WRITERS:
        whole = json.loads(Path(folder, f"{writer}-rank0.json").read_text())
        assert whole["ledger"]["tokens"] == ledger["tokens"]
    for rank in (0, 1):
        said = Path(folder, f"damaged-said-rank{rank}.txt").read_text()
        assert "`open_group.gradients['head.bias']` should be a tensor of shape (11,)" in said, said
    one = json.loads(Path(folder, "one-rank0.json").read_text())
    assert relative_error(torch.tensor(one["params"]), params_vector(ShardableLM())) > 1e-2  # it trained
