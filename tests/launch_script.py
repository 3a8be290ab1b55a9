"""A training script started by other launchers in tests/project/test_launch.py (torchrun, Lightning's own).

Usage: python launch_script.py OUT_FILE MODE, with MODE "torchrun" (2 nodes x 1 process, the launcher sets the
environment) or "launcher" (Lightning's `accum_ddp` re-runs this script in 2 processes).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from helpers import TinyLM, fit, make_examples, params_vector

import lightning_accum  # noqa: F401  (registers the strategy strings)
from lightning_accum._worker_exit import close_process_group

UNEQUAL = [6, 1, 5, 2, 6, 1, 4, 1, 6, 2, 5, 1, 6, 1, 3, 2]


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    layout = {"devices": 1, "num_nodes": 2} if mode == "torchrun" else {"devices": 2}
    model = TinyLM(lr=0.5, seed=21)
    trainer = fit(model, make_examples(UNEQUAL, seed=21), batch_size=2, accumulate=2, strategy="accum_ddp", **layout)
    if trainer.is_global_zero:
        torch.save(
            {
                "params": params_vector(model),
                "ledger": trainer.strategy.ledger.state_dict(),
                "replicas": trainer.strategy.data_parallel_replicas,
                "world_size": trainer.world_size,
            },
            out,
        )
    close_process_group(trainer.strategy)  # the group ends before the interpreter's exit (the recipe's reason)


if __name__ == "__main__":
    main()
