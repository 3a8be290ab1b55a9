"""Train a tiny byte-level language model with exact, token-weighted gradient accumulation.

The corpus is the help-topic text every CPython installation ships (``pydoc_data.topics``), cut into
documents of varying length and padded; padding carries ``ignore_index`` so the number of supervised
tokens differs from micro-batch to micro-batch, which is where token weighting matters.

Run it with ``bash scripts/demo.sh`` (or ``python examples/train_tiny_lm.py --help``).
"""

from __future__ import annotations

import argparse
import random
from pydoc_data.topics import topics

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

import lightning_accum

IGNORE_INDEX = -100


class Documents(Dataset):
    """Byte sequences of the pydoc topics, cut to random lengths and right-padded to ``max_len + 1``."""

    def __init__(self, max_len: int, count: int, seed: int) -> None:
        text = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
        rng = random.Random(seed)
        self.items = []
        for _ in range(count):
            length = rng.randint(8, max_len + 1)
            start = rng.randrange(0, len(text) - length)
            self.items.append(torch.tensor(list(text[start : start + length]), dtype=torch.long))
        self.max_len = max_len

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        seq = self.items[index]
        ids = torch.zeros(self.max_len, dtype=torch.long)
        labels = torch.full((self.max_len,), IGNORE_INDEX, dtype=torch.long)
        ids[: len(seq) - 1] = seq[:-1]
        labels[: len(seq) - 1] = seq[1:]
        return {"input_ids": ids, "labels": labels}


class TinyByteLM(L.LightningModule):
    """A one-layer GRU over byte embeddings; returns the mean loss and the supervised token count."""

    def __init__(self, width: int = 64, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(256, width)
        self.rnn = nn.GRU(width, width, batch_first=True)
        self.head = nn.Linear(width, 256)

    def forward(self, input_ids: Tensor) -> Tensor:
        hidden, _ = self.rnn(self.embed(input_ids))
        return self.head(hidden)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        logits = self(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX)
        return {"loss": loss, "num_tokens": (batch["labels"] != IGNORE_INDEX).sum()}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro-batch", type=int, default=8, help="m: examples per micro-batch per replica")
    parser.add_argument("--accumulate", type=int, default=4, help="A: micro-batches per update")
    parser.add_argument("--documents", type=int, default=400)
    parser.add_argument("--max-len", type=int, default=96)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--partial-group", choices=("rescale", "drop"), default="rescale")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    L.seed_everything(args.seed, verbose=False)
    data = Documents(args.max_len, args.documents, args.seed)
    replicas = 1
    effective = args.micro_batch * args.accumulate * replicas
    print(f"m = {args.micro_batch}, A = {args.accumulate}, D = {replicas}: effective batch m x A x D = {effective}")
    strategy = lightning_accum.AccumulationStrategy(partial_group=args.partial_group)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        accumulate_grad_batches=args.accumulate,
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyByteLM(), DataLoader(data, batch_size=args.micro_batch, shuffle=True))

    ledger = strategy.ledger
    last = ledger.last_group
    print(f"normalized by: {ledger.normalization}")
    print(f"updates attempted / applied: {ledger.updates_attempted} / {ledger.updates_applied}")
    print(f"micro-batches: {ledger.microbatches}, samples: {ledger.samples}, supervised tokens: {ledger.tokens}")
    print(f"partial groups: {ledger.partial_groups} ({args.partial_group}), dropped tokens: {ledger.dropped_tokens}")
    if last is not None:
        print(
            f"last group: token-weighted loss {last.loss:.4f}, {last.tokens} tokens, {last.microbatches} micro-batches"
        )


if __name__ == "__main__":
    main()
