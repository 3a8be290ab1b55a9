"""Recipe: exact accumulation under DDP, launched by ``torchrun``.

Each process reads its share of the data (Lightning's distributed sampler), accumulates ``A``
micro-batches of ``m`` sequences, and every update is the gradient of the token-weighted mean over
all ``m × A × D`` sequences of the group on all replicas. Lightning sees the torchrun environment
and starts no processes of its own::

    torchrun --nproc-per-node 2 examples/ddp_torchrun.py            # 2 processes on CPU (gloo)
    torchrun --nproc-per-node 2 examples/ddp_torchrun.py --quick    # a few seconds

Rank zero prints m, A, D and the effective batch at the start, the run record and the ledger at the end.
"""

from __future__ import annotations

import argparse
import os
import sys

import lightning as L
import torch.distributed
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the recipes' shared model and data

from _data import RandomSequences, TinyLM

from lightning_accum import AccumulationReport, AxisLogger  # importing registers the strategy strings


def main(argv: list[str] | None = None) -> L.Trainer:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, default=4, help="micro-batch size per process")
    parser.add_argument("--accumulate", type=int, default=4, help="A: micro-batches per update")
    parser.add_argument("--examples", type=int, default=1024, help="training sequences")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--out", default="runs", help="folder for the logs and the run record")
    parser.add_argument("--quick", action="store_true", help="64 sequences, one epoch")
    args = parser.parse_args(argv)
    if args.quick:
        args.examples, args.epochs = 64, 1

    world = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun
    data = RandomSequences(args.examples)
    trainer = L.Trainer(
        strategy="accum_ddp" if world > 1 else "accum",
        accelerator="cpu",
        devices=world,
        accumulate_grad_batches=args.accumulate,
        max_epochs=args.epochs,
        logger=L.pytorch.loggers.TensorBoardLogger(args.out, name="ddp_torchrun"),
        callbacks=[AxisLogger(axis="tokens"), AccumulationReport()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if trainer.is_global_zero:
        print(
            f"m = {args.m}, A = {args.accumulate}, D = {world}: {args.m} × {args.accumulate} × {world}"
            f" = {args.m * args.accumulate * world} sequences per update;"
            f" {len(data)} sequences, {data.supervised_tokens():,} supervised tokens per epoch"
        )
    trainer.fit(TinyLM(), DataLoader(data, batch_size=args.m))
    if trainer.is_global_zero:
        print(trainer.strategy.ledger)  # type: ignore[attr-defined]
    # End the process group while the interpreter is fully alive. With gloo, Lightning leaves it to the exit, where
    # its native threads can abort a process whose run had finished ("terminate called without an active
    # exception", SIGABRT; docs/troubleshooting.md, "A crash after a finished run"). The barrier first: no rank
    # destroys the group while another is still in a collective.
    if torch.distributed.is_initialized():
        trainer.strategy.barrier("end of the recipe")
        torch.distributed.destroy_process_group()
    return trainer


if __name__ == "__main__":
    main()
