"""A training script that torchrun starts as 2 nodes x 1 process on loopback, with strategy "accum_fsdp" (used by
tests/strategies/test_model_parallel.py).

Usage: python model_parallel_launch_script.py OUT_FILE
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from helpers import ListDataset, RankStridedSampler, make_examples, make_trainer
from strategies.test_model_parallel import UNEQUAL, ShardedLM, full_params
from torch.utils.data import DataLoader

import lightning_accum  # noqa: F401  (registers the strategy strings)
from lightning_accum._worker_exit import close_process_group


def main() -> None:
    torch.set_num_threads(1)
    examples = make_examples(UNEQUAL, seed=8)
    model = ShardedLM("fsdp")
    trainer = make_trainer(strategy="accum_fsdp", num_nodes=2, accumulate_grad_batches=2, gradient_clip_val=0.2)
    loader = DataLoader(ListDataset(examples), batch_size=2, sampler=RankStridedSampler(len(examples)))
    trainer.fit(model, loader)
    params = full_params(model)  # a collective: every rank gathers
    if trainer.is_global_zero:
        torch.save(
            {
                "params": params,
                "ledger": trainer.strategy.ledger.state_dict(),
                "replicas": trainer.strategy.data_parallel_replicas,
                "world_size": trainer.world_size,
            },
            sys.argv[1],
        )
    close_process_group(trainer.strategy)  # the group ends before the interpreter's exit (the recipe's reason)


if __name__ == "__main__":
    main()
