"""How close two splits of the same examples stay after many updates, by model, optimizer and precision.

The update is exact in arithmetic: one batch of 8 and four micro-batches of 2 give the same gradient up to float32
rounding (~1e-7 relative). SGD carries that rounding into the parameters as it is; Adam-type optimizers divide by
``√v`` per element, so an element whose gradient is near zero turns a rounding-sized difference into a visible
one, and the runs drift apart step after step. This measures it on real ``Trainer.fit`` runs (one device) of two
models:

- ``tinylm``: the tests' TinyLM (embedding, tanh, linear head), 40 updates of 8 examples, one batch of 8 against
  four micro-batches of 2;
- ``demo``: the demo's byte-level transformer (``examples/demo.py``, its data and its defaults: 40 updates of 32
  documents, AdamW at 3e-3), its two extreme splits (m, A) = (16, 2) against (2, 16).

    python benchmarks/split_rounding.py [tinylm|demo ...]

prints, per model, optimizer and precision, the parameters' relative difference between the two splits (norms over
all parameters), that difference as a share of how far the parameters moved, and the largest difference of one
element. Figures are in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader

import lightning_accum  # noqa: F401  (registers the strategy strings)

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "examples")]
from demo import EFFECTIVE_BATCH, ByteDocuments, GroupSampler, TinyGPT  # noqa: E402
from helpers import ListDataset, TinyLM, make_examples, params_vector, random_lengths  # noqa: E402

UPDATES = 40
#: Learning rates: the TinyLM's of the tests; the demo's own for AdamW, and one that trains as fast for SGD.
LR = {("tinylm", "sgd"): 0.5, ("tinylm", "adamw"): 1e-2, ("demo", "sgd"): 0.3, ("demo", "adamw"): 3e-3}


class DemoGPT(TinyGPT):
    """The demo's model with a choice of optimizer (the demo itself uses AdamW)."""

    def __init__(self, optimizer: str, lr: float) -> None:
        super().__init__(max_len=64, lr=lr)
        self.optimizer_name = optimizer

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"])
        return super().configure_optimizers()


def tinylm(optimizer: str, split: int) -> tuple[nn.Module, DataLoader, int]:
    examples = make_examples(random_lengths(8 * UPDATES, seed=1), seed=1)
    model = TinyLM(lr=LR["tinylm", optimizer], optimizer=optimizer)
    m, accumulate = (8, 1) if split == 0 else (2, 4)
    return model, DataLoader(ListDataset(examples), batch_size=m), accumulate


def demo(optimizer: str, split: int) -> tuple[nn.Module, DataLoader, int]:
    L.seed_everything(0, verbose=False)
    model = DemoGPT(optimizer, LR["demo", optimizer])
    data = ByteDocuments(EFFECTIVE_BATCH * UPDATES, 64, seed=0)
    m, accumulate = (16, 2) if split == 0 else (2, 16)
    sampler = GroupSampler(len(data), EFFECTIVE_BATCH, seed=0)
    return model, DataLoader(data, batch_size=m, sampler=sampler), accumulate


MODELS: dict[str, Callable[[str, int], tuple[nn.Module, DataLoader, int]]] = {"tinylm": tinylm, "demo": demo}


def run(name: str, optimizer: str, dtype: torch.dtype, split: int) -> tuple[torch.Tensor, torch.Tensor]:
    model, loader, accumulate = MODELS[name](optimizer, split)
    model = model.to(dtype)
    start = params_vector(model)
    options: dict[str, Any] = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}
    trainer = L.Trainer(
        strategy="accum",
        accelerator="cpu",
        accumulate_grad_batches=accumulate,
        max_epochs=1,
        precision="64-true" if dtype == torch.float64 else "32-true",
        enable_model_summary=False,
        use_distributed_sampler=False,
        limit_val_batches=0,
        **options,
    )
    trainer.fit(model, loader)
    return start, params_vector(model)


def main(names: list[str]) -> None:
    print(
        f"{'model':<8}{'optimizer':<10}{'dtype':<10}{'relative difference':>22}{'share of the change':>22}"
        f"{'largest element':>18}"
    )
    for name in names:
        for optimizer in ("sgd", "adamw"):
            for dtype in (torch.float32, torch.float64):
                start, whole = run(name, optimizer, dtype, 0)
                _, split = run(name, optimizer, dtype, 1)
                diff = (whole - split).norm()
                print(
                    f"{name:<8}{optimizer:<10}{str(dtype).split('.')[-1]:<10}{float(diff / whole.norm()):>22.1e}"
                    f"{float(diff / (whole - start).norm()):>22.1e}{float((whole - split).abs().max()):>18.1e}",
                    flush=True,
                )


if __name__ == "__main__":
    main(sys.argv[1:] or list(MODELS))
