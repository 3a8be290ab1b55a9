"""How close two splits of the same examples stay after many updates, by optimizer and precision.

The update is exact in arithmetic: one batch of 8 and four micro-batches of 2 give the same gradient up to float32
rounding (~1e-7 relative). SGD carries that rounding into the parameters as it is; Adam-type optimizers divide by
``√v`` per element, so an element whose gradient is near zero turns a rounding-sized difference into a visible
one, and the runs drift apart step after step. This measures it on real ``Trainer.fit`` runs (one device):

    python benchmarks/split_rounding.py

and prints, per optimizer and precision, the parameters' relative difference between the two splits and that
difference as a share of how far the parameters moved. Figures are in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

import lightning_accum  # noqa: F401  (registers the strategy strings)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import ListDataset, TinyLM, make_examples, params_vector, random_lengths

UPDATES = 40


def run(optimizer: str, dtype: torch.dtype, batch_size: int, accumulate: int) -> tuple[torch.Tensor, torch.Tensor]:
    examples = make_examples(random_lengths(8 * UPDATES, seed=1), seed=1)
    model = TinyLM(lr=1e-2 if optimizer == "adamw" else 0.5, optimizer=optimizer).to(dtype)
    start = params_vector(model)
    trainer = L.Trainer(
        strategy="accum",
        accelerator="cpu",
        accumulate_grad_batches=accumulate,
        max_epochs=1,
        precision="64-true" if dtype == torch.float64 else "32-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(ListDataset(examples), batch_size=batch_size))
    return start, params_vector(model)


def main() -> None:
    print(f"{UPDATES} updates of 8 examples: one batch of 8 vs four micro-batches of 2 (same examples, same order)")
    print(f"{'optimizer':<10}{'dtype':<10}{'relative difference':>22}{'share of the change':>22}")
    for optimizer in ("sgd", "adamw"):
        for dtype in (torch.float32, torch.float64):
            start, whole = run(optimizer, dtype, 8, 1)
            _, split = run(optimizer, dtype, 2, 4)
            diff = (whole - split).norm()
            print(
                f"{optimizer:<10}{str(dtype).split('.')[-1]:<10}{float(diff / whole.norm()):>22.1e}"
                f"{float(diff / (whole - start).norm()):>22.1e}"
            )


if __name__ == "__main__":
    main()
