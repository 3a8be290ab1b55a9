"""Host memory of a checkpoint written inside an accumulation group under FSDP2: 2 processes over gloo on the CPU.

A checkpoint written inside a group carries the group's gradient (issue #29). Under FSDP2 each rank holds only its
shard of that gradient; how much memory writing it takes depends on whether it is gathered:

- ``folder``: ``save_distributed_checkpoint=True``; the group's gradient goes into the distributed checkpoint shard
  by shard, next to the model and optimizer (nothing gathered);
- ``file``: one file; the gradient is gathered parameter by parameter and kept by rank zero only (the file is
  written by rank zero, as Lightning's strategy writes the model there).

Before this round every rank gathered the whole gradient into its own CPU copy in both modes. The model is one
embedding of 200,000 x 256 (51.2 M parameters, 204.8 MB of float32 gradient whole, 102.4 MB a rank sharded), A = 2;
the checkpoint is written after the first micro-batch, and for comparison after the group's update (at a boundary:
the model and optimizer alone, as Lightning writes them). Memory is each rank's resident set sampled every 2 ms by a
thread while ``trainer.save_checkpoint`` runs, less its value just before, with glibc's mmap threshold fixed so that
freed tensors leave the resident set (as in ``fsdp_sync.py``).

    python benchmarks/checkpoint_memory.py            # prints a markdown table (Linux)
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fsdp_sync import resident_bytes
from helpers import run_ddp

from lightning_accum import ModelParallelAccumulationStrategy

ROWS, WIDTH, ACCUMULATE = 200_000, 256, 2


class Embedded(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(ROWS, WIDTH)

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(self.embed, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        (ids,) = batch
        return {"loss": self.embed(ids).pow(2).mean(), "num_samples": ids.shape[0]}

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class _SaveInsideTheGroup(L.Callback):
    """After the group's first micro-batch: writes the checkpoint while a thread samples the resident set."""

    def __init__(self, path: str, at: int) -> None:
        self.path, self.at = path, at
        self.before = self.peak = 0

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if args[-1] != self.at:
            return
        done = threading.Event()
        self.before = self.peak = resident_bytes()

        def sample() -> None:
            while not done.is_set():
                self.peak = max(self.peak, resident_bytes())
                time.sleep(0.002)

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            trainer.save_checkpoint(self.path)
        finally:
            done.set()
            sampler.join()
        trainer.should_stop = True


def _worker(rank: int, mode: str, folder: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    kind, where = mode.split("-")
    save = _SaveInsideTheGroup(os.path.join(folder, f"{mode}.ckpt"), 0 if where == "inside" else ACCUMULATE - 1)
    trainer = L.Trainer(
        strategy=ModelParallelAccumulationStrategy(
            data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=kind == "folder"
        ),
        accelerator="cpu",
        devices=2,
        accumulate_grad_batches=ACCUMULATE,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[save],
    )
    data = TensorDataset(torch.randint(0, ROWS, (ACCUMULATE * 4, 64)))
    trainer.fit(Embedded(), DataLoader(data, batch_size=4))
    Path(folder, f"{mode}-{rank}.json").write_text(json.dumps({"save_mb": (save.peak - save.before) / 1e6}))


def main() -> None:
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for kind in ("folder", "file"):
            saves = {}
            for where in ("boundary", "inside"):
                mode = f"{kind}-{where}"
                run_ddp(_worker, mode, folder)  # fresh processes per mode
                saves[where] = [json.loads(Path(folder, f"{mode}-{r}.json").read_text())["save_mb"] for r in range(2)]
            group = [inside - boundary for inside, boundary in zip(saves["inside"], saves["boundary"], strict=True)]
            rows.append(
                f"| {kind} | {saves['boundary'][0]:.1f} / {saves['boundary'][1]:.1f} MB |"
                f" {saves['inside'][0]:.1f} / {saves['inside'][1]:.1f} MB | {group[0]:.1f} / {group[1]:.1f} MB |"
            )
    gradient_mb = ROWS * WIDTH * 4 / 1e6
    print(
        f"FSDP2, dp = 2, one embedding of {ROWS:,} x {WIDTH} ({gradient_mb:.1f} MB of float32 gradient whole), a"
        f" checkpoint written after micro-batch 1 of {ACCUMULATE} (torch {torch.__version__}, gloo)\n"
    )
    print(
        "| checkpoint | peak resident memory above the start of the save, rank 0 / rank 1: at an update boundary |"
        " inside the group | the open group's part (the difference) |"
    )
    print("|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
