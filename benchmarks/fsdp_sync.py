"""FSDP2's two gradient-synchronisation modes under ``ModelParallelAccumulationStrategy``: collectives per update
and the memory held during a group, 2 processes over gloo on the CPU.

``gradient_sync="every_microbatch"`` reduce-scatters every micro-batch's gradient (FSDP2's default: each rank keeps
only its shard); ``"last_microbatch"`` skips that on non-final micro-batches (``set_requires_gradient_sync(False)``),
so fewer collectives, but each rank holds the unsharded gradient of the whole model until the group's last
backward. Both are exact (tests/strategies/test_model_parallel.py). The model is four 1024 × 1024 linear layers (4.2 M
parameters, 16.8 MB of float32 gradient unsharded, 8.4 MB per rank sharded), A = 4, 4 updates, the first one
left out of the window.

Collectives are counted by wrapping ``torch.distributed``'s functions that FSDP2 and the strategy call
(``reduce_scatter_single``, ``all_gather_single``, ``all_reduce``). Memory is the process's resident set, read
from ``/proc/self/statm`` before and after every backward in the window, less its value when training starts, with
glibc's mmap threshold fixed so that large tensors are returned to the system when freed (the resident set then
follows what is held).

    python benchmarks/fsdp_sync.py            # prints a markdown table (Linux)
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers import run_ddp

from lightning_accum import ModelParallelAccumulationStrategy

WIDTH, LAYERS, ACCUMULATE, UPDATES = 1024, 4, 4, 4
COUNTED = ("reduce_scatter_single", "all_gather_single", "all_reduce")
PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class Wide(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        for layer in self.layers:
            fully_shard(layer, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        (x,) = batch
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return {"loss": x.pow(2).mean(), "num_samples": x.shape[0]}

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class _Window(L.Callback):
    """From the second update on: counts the collectives and samples the resident set around every backward."""

    def __init__(self, counts: dict[str, int]) -> None:
        self.counts = counts
        self.start = 0
        self.peak = 0
        self.active = False

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.start = resident_bytes()

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.fit_loop.epoch_loop.batch_idx == ACCUMULATE:
            self.active = True
            for name in COUNTED:
                self.counts[name] = 0

    def _sample(self) -> None:
        if self.active:
            self.peak = max(self.peak, resident_bytes())

    def on_before_backward(self, *args: Any) -> None:
        self._sample()

    def on_after_backward(self, *args: Any) -> None:
        self._sample()


def _worker(rank: int, mode: str, folder: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    counts: dict[str, int] = dict.fromkeys(COUNTED, 0)
    for name in COUNTED:
        original = getattr(dist, name)

        def counting(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            counts[_name] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counting)
    window = _Window(counts)
    trainer = L.Trainer(
        strategy=ModelParallelAccumulationStrategy(gradient_sync=mode, data_parallel_size=2, tensor_parallel_size=1),
        accelerator="cpu",
        devices=2,
        accumulate_grad_batches=ACCUMULATE,
        max_steps=UPDATES,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[window],
    )
    data = TensorDataset(torch.randn(ACCUMULATE * UPDATES * 8, WIDTH))
    trainer.fit(Wide(), DataLoader(data, batch_size=8))
    result = {
        "per_update": {name: counts[name] / (UPDATES - 1) for name in COUNTED},
        "held_mb": (window.peak - window.start) / 1e6,
    }
    Path(folder, f"{mode}-{rank}.json").write_text(json.dumps(result))


def main() -> None:
    # Large tensors in their own mappings, returned when freed (glibc's dynamic threshold would keep them in the heap
    # after the first frees, and the resident set would no longer follow what is held). Read by the workers at start.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for mode in ("every_microbatch", "last_microbatch"):
            run_ddp(_worker, mode, folder)  # fresh processes per mode
            ranks = [json.loads(Path(folder, f"{mode}-{r}.json").read_text()) for r in range(2)]
            per_update = ranks[0]["per_update"]
            held = max(r["held_mb"] for r in ranks)
            rows.append(
                f"| `{mode}` | {per_update['reduce_scatter_single']:g} | {per_update['all_gather_single']:g} |"
                f" {per_update['all_reduce']:g} | {held:.1f} MB |"
            )
    print(f"A = {ACCUMULATE}, {LAYERS} FSDP2 modules of {WIDTH} x {WIDTH}, dp = 2 (torch {torch.__version__}, gloo)\n")
    print(
        "| gradient_sync | reduce-scatters / update | all-gathers / update | all-reduces / update |"
        " resident memory above the start of training, peak around backwards (max over ranks) |"
    )
    print("|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
