"""Train on a token budget: stop, validate, checkpoint and schedule the learning rate by supervised tokens.

A tiny next-token model on synthetic sequences of varying length (padding carries ``ignore_index``, so every
micro-batch holds a different number of supervised tokens). The run is planned the way language models are:

- a budget of ``--budget`` supervised tokens (``Horizon(stop_at=...)``; the epochs run until it is spent);
- a validation run every ``--validate-every`` tokens and a checkpoint every ``--checkpoint-every`` tokens;
- a learning rate that warms up over the first 20 % of the budget and follows a cosine to 10 % of its base
  (``AxisLR`` with ``warmup_cosine``), as a function of tokens.

Change ``--m`` and ``--accumulate`` (same effective batch ``m × A``): the run stops at the same token count,
validates and checkpoints at the same counts and uses the same rate at every update, because all of them are
defined on tokens. Runs on the CPU in seconds::

    python examples/token_budget.py --m 4 --accumulate 2
    python examples/token_budget.py --m 2 --accumulate 4
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

# Importing lightning_accum registers the strategy strings ("accum", "accum_ddp", ...).
from lightning_accum import AxisLR, Horizon, warmup_cosine

IGNORE_INDEX = -100
VOCAB = 32


class Sequences(Dataset):
    """``count`` sequences of 4..``max_len`` tokens (a noisy counting pattern), right-padded to ``max_len``."""

    def __init__(self, count: int, max_len: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.items: list[dict[str, Tensor]] = []
        for _ in range(count):
            length = int(torch.randint(4, max_len + 1, (1,), generator=gen))
            start = int(torch.randint(0, VOCAB, (1,), generator=gen))
            tokens = (start + torch.arange(max_len + 1)) % VOCAB
            noise = torch.rand(max_len + 1, generator=gen) < 0.1
            tokens[noise] = torch.randint(0, VOCAB, (int(noise.sum()),), generator=gen)
            labels = tokens[1:].clone()
            labels[length:] = IGNORE_INDEX  # padding is not supervised
            self.items.append({"input_ids": tokens[:-1], "labels": labels})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return self.items[index]


class TinyLM(L.LightningModule):
    def __init__(self, budget: int, lr: float = 0.05) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 32)
        self.mix = nn.Linear(32, 32)
        self.head = nn.Linear(32, VOCAB)
        self.budget, self.lr = budget, lr
        self.validated_at: list[int] = []

    def loss(self, batch: dict[str, Tensor]) -> Tensor:
        logits = self.head(torch.tanh(self.mix(self.embed(batch["input_ids"]))))
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        # The mean over the micro-batch's supervised tokens, and how many there are: the strategy weights by them.
        return {"loss": self.loss(batch), "num_tokens": (batch["labels"] != IGNORE_INDEX).sum()}

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.loss(batch), prog_bar=True)

    def on_validation_start(self) -> None:
        if not self.trainer.sanity_checking:
            self.validated_at.append(self.trainer.strategy.ledger.tokens)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        # Warm up over the first 20 % of the budget, then a cosine down to 10 %: all in supervised tokens.
        schedule = warmup_cosine(warmup=self.budget // 5, total=self.budget, min_ratio=0.1)
        scheduler = AxisLR(optimizer, axis="tokens", lr_lambda=schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class RateTrace(L.Callback):
    """Keeps (tokens before the update, rate it used) for every update, from the strategy's group listener."""

    def __init__(self) -> None:
        self.rates: list[tuple[int, float]] = []

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.trainer = trainer
        trainer.strategy.add_group_listener(self.on_group)

    def on_group(self, record: Any, batch_samples: Sequence[int]) -> None:
        # Called after each update, before the schedule advances: the rate this update used.
        before = self.trainer.strategy.ledger.tokens - record.tokens
        self.rates.append((before, self.trainer.optimizers[0].param_groups[0]["lr"]))


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=4, help="examples per micro-batch")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per update (A)")
    parser.add_argument("--budget", type=int, default=20_000, help="supervised tokens to train on")
    parser.add_argument("--validate-every", type=int, default=4_000, help="tokens between validation runs")
    parser.add_argument("--checkpoint-every", type=int, default=8_000, help="tokens between checkpoints")
    parser.add_argument("--documents", type=int, default=256, help="training sequences (one epoch)")
    parser.add_argument("--max-len", type=int, default=48, help="longest sequence")
    parser.add_argument("--out", default="runs/token_budget", help="folder for checkpoints and the summary")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    out = Path(args.out) / f"m{args.m}_a{args.accumulate}"
    print(
        f"m = {args.m}, A = {args.accumulate}, D = 1: {args.m * args.accumulate} sequences per update;"
        f" budget {args.budget} tokens, validation every {args.validate_every}, checkpoint every"
        f" {args.checkpoint_every}"
    )
    horizon = Horizon(
        axis="tokens",
        stop_at=args.budget,
        validate_every=args.validate_every,
        checkpoint_every=args.checkpoint_every,
    )
    trace = RateTrace()
    trainer = L.Trainer(
        strategy="accum",
        accelerator="cpu",
        accumulate_grad_batches=args.accumulate,
        max_epochs=-1,  # the budget decides
        check_val_every_n_epoch=None,  # validate on the tokens axis only (and at the stop)
        val_check_interval=10**12,
        num_sanity_val_steps=0,
        callbacks=[horizon, trace, ModelCheckpoint(dirpath=out / "checkpoints", save_top_k=0)],
        logger=False,
        enable_progress_bar=not args.quiet,
        enable_model_summary=False,
    )
    model = TinyLM(budget=args.budget)
    train = DataLoader(Sequences(args.documents, args.max_len, seed=1), batch_size=args.m)
    val = DataLoader(Sequences(32, args.max_len, seed=2), batch_size=16)
    trainer.fit(model, train, val)

    ledger = trainer.strategy.ledger
    summary = {
        "stopped_at_tokens": ledger.tokens,
        "updates": ledger.updates_applied,
        "validated_at_tokens": model.validated_at,
        "checkpoints": [Path(p).name for p in horizon.checkpoints],
        "rates": trace.rates,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"stopped at {ledger.tokens} tokens after {ledger.updates_applied} updates (budget {args.budget})")
    print(f"validated at tokens {model.validated_at}")
    print(f"checkpoints {summary['checkpoints']} in {out / 'checkpoints'}")
    print(f"learning rate: {trace.rates[0][1]:.3g} at 0 tokens ... {trace.rates[-1][1]:.3g} at {trace.rates[-1][0]}")
    return summary


if __name__ == "__main__":
    main()
