"""lightning-accum demo: one small byte-level GPT, the same data and effective batch, several splits.

The corpus is the help-topic text every CPython installation ships (``pydoc_data.topics``), cut into
documents of varying length and right-padded; padding carries ``ignore_index``, so the number of
supervised tokens differs from micro-batch to micro-batch and token weighting matters.

Every configuration sees the same examples in the same order with an effective batch of 32
documents per update:

- ``accum_m16_a2``, ``accum_m4_a8``, ``accum_m2_a16``: ``strategy="accum"`` with ``AxisLogger(axis="tokens")``,
  ``AccumulationReport`` and ``AccumulationCheck``. Their updates are the same, so their curves on the tokens
  axis lie on top of each other;
- ``lightning_m4_a8``: plain Lightning ``accumulate_grad_batches=8`` (a mean of micro-batch means), logged on
  the same tokens axis by a small callback of this file, for contrast;
- with ``--ddp``: ``accum_ddp_m4_a4_d2``, 2 processes on CPU (gloo), 4 x 4 x 2 = 32.

It writes TensorBoard logs (one run per configuration), the run records and a PNG plot of training and
validation loss against tokens, drawn from the event files, under ``--out`` (default ``runs/demo``).

Run it with ``bash scripts/demo.sh`` (``--help`` lists the options).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
from dataclasses import dataclass
from pydoc_data.topics import topics
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset
from torchmetrics.text import Perplexity

import lightning_accum
from lightning_accum import AccumulationCheck, AccumulationReport, AxisLogger

IGNORE_INDEX = -100
EFFECTIVE_BATCH = 32


# ---------------------------------------------------------------------------- data


class ByteDocuments(Dataset):
    """Documents of ``min_len``..``max_len`` bytes cut from the pydoc topics, right-padded to ``max_len``."""

    def __init__(self, count: int, max_len: int, seed: int, min_len: int = 8) -> None:
        text = "\n\n".join(topics[key] for key in sorted(topics)).encode("utf-8")
        rng = random.Random(seed)
        self.max_len = max_len
        self.docs: list[bytes] = []  # plain bytes: cheap to send to spawned processes (no shared memory)
        for _ in range(count):
            length = rng.randint(min_len, max_len + 1)
            start = rng.randrange(0, len(text) - length)
            self.docs.append(text[start : start + length])

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        doc = torch.tensor(list(self.docs[index]), dtype=torch.long)
        ids = torch.zeros(self.max_len, dtype=torch.long)
        labels = torch.full((self.max_len,), IGNORE_INDEX, dtype=torch.long)
        ids[: len(doc) - 1] = doc[:-1]
        labels[: len(doc) - 1] = doc[1:]  # next-byte prediction; padding is ignored
        return {"input_ids": ids, "labels": labels}


# ---------------------------------------------------------------------------- model


class TinyGPT(L.LightningModule):
    """A small causal transformer over bytes (vocabulary 256)."""

    def __init__(self, max_len: int, width: int = 64, layers: int = 2, heads: int = 4, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tokens = nn.Embedding(256, width)
        self.positions = nn.Embedding(max_len, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(max_len), persistent=False)
        self.val_perplexity = Perplexity(ignore_index=IGNORE_INDEX)  # sums over tokens: exact under DDP

    def forward(self, input_ids: Tensor) -> Tensor:
        t = input_ids.shape[1]
        x = self.tokens(input_ids) + self.positions(torch.arange(t, device=input_ids.device))
        x = self.blocks(x, mask=self.causal[:t, :t], is_causal=True)
        return self.head(self.norm(x))

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        logits = self(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX)
        return {"loss": loss, "num_tokens": (batch["labels"] != IGNORE_INDEX).sum()}

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.val_perplexity.update(self(batch["input_ids"]), batch["labels"])

    def on_validation_epoch_end(self) -> None:
        perplexity = self.val_perplexity.compute()
        self.log("val/loss", perplexity.log(), sync_dist=False)  # already reduced over replicas by the metric
        self.val_perplexity.reset()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"], weight_decay=0.0)


class PlainTokenAxis(L.Callback):
    """For the plain Lightning contrast run only: its group loss and validation loss at x = tokens seen.

    Lightning back-propagates Σ_i loss_i / A (a mean of micro-batch means); this writes that value as
    ``accum/loss`` so the plot can show both objectives on one axis. One device only.
    """

    def __init__(self) -> None:
        self.tokens = 0
        self.group_loss = 0.0

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.tokens += int((batch["labels"] != IGNORE_INDEX).sum())
        self.group_loss += float(outputs["loss"])  # Lightning's outputs["loss"] is already divided by A
        if not trainer.fit_loop._should_accumulate():
            trainer.logger.log_metrics({"accum/loss": self.group_loss}, step=self.tokens)  # type: ignore[union-attr]
            self.group_loss = 0.0

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if "val/loss" in trainer.callback_metrics and self.tokens > 0:
            value = float(trainer.callback_metrics["val/loss"])
            trainer.logger.log_metrics({"val/loss_on_tokens": value}, step=self.tokens)  # type: ignore[union-attr]


# ---------------------------------------------------------------------------- runs


@dataclass
class Config:
    name: str
    m: int
    accumulate: int
    replicas: int = 1
    plain: bool = False


def configurations(ddp: bool) -> list[Config]:
    configs = [
        Config("accum_m16_a2", 16, 2),
        Config("accum_m4_a8", 4, 8),
        Config("accum_m2_a16", 2, 16),
        Config("lightning_m4_a8", 4, 8, plain=True),
    ]
    if ddp:
        configs.append(Config("accum_ddp_m4_a4_d2", 4, 4, replicas=2))
    return configs


def train(config: Config, args: argparse.Namespace) -> None:
    assert config.m * config.accumulate * config.replicas == EFFECTIVE_BATCH
    print(
        f"\n== {config.name}: m = {config.m}, A = {config.accumulate}, D = {config.replicas}:"
        f" {config.m} x {config.accumulate} x {config.replicas} = {EFFECTIVE_BATCH} documents per update"
    )
    L.seed_everything(args.seed, verbose=False)
    model = TinyGPT(args.max_len, width=args.width, layers=args.layers, lr=args.lr)
    train_data = ByteDocuments(args.documents, args.max_len, seed=args.seed)
    val_data = ByteDocuments(args.val_documents, args.max_len, seed=args.seed + 1)
    logger = TensorBoardLogger(args.out, name=config.name, version=0, default_hp_metric=False)
    if config.plain:
        strategy: Any = "auto"
        callbacks: list[L.Callback] = [PlainTokenAxis()]
    else:
        strategy = "accum_ddp_spawn" if config.replicas > 1 else "accum"
        callbacks = [AxisLogger(axis="tokens"), AccumulationReport(), AccumulationCheck()]
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=config.replicas,
        accumulate_grad_batches=config.accumulate,
        max_steps=args.updates,
        max_epochs=-1,
        val_check_interval=args.val_every * config.accumulate,  # in micro-batches: every `val_every` updates
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        logger=logger,
        callbacks=callbacks,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=not args.quiet,
    )
    # One device: a generator with the same seed, so every configuration reads the same document order.
    # Several: Lightning's DistributedSampler shuffles (seeded) and shards; a torch.Generator cannot be
    # sent to spawned processes, so none is given there.
    generator = torch.Generator().manual_seed(args.seed) if config.replicas == 1 else None
    per_replica = DataLoader(train_data, batch_size=config.m, shuffle=True, generator=generator)
    trainer.fit(model, per_replica, DataLoader(val_data, batch_size=16))


def read_curves(folder: str, tag: str) -> list[tuple[int, float]]:
    """(step, value) pairs of ``tag`` from the TensorBoard event files in ``folder``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(folder, size_guidance={"scalars": 0})
    events.Reload()
    if tag not in events.Tags()["scalars"]:
        return []
    return [(int(e.step), float(e.value)) for e in events.Scalars(tag)]


def plot(configs: list[Config], out: str) -> str:
    """Training and validation loss against tokens for every configuration, from the event files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (train_ax, val_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for config in configs:
        folder = os.path.join(out, config.name, "version_0")
        style = {"linestyle": "--", "color": "black"} if config.plain else {}
        train_curve = read_curves(folder, "accum/loss")
        val_curve = read_curves(folder, "val/loss_on_tokens" if config.plain else "val/loss")
        if train_curve:
            train_ax.plot(*zip(*train_curve, strict=True), label=config.name, **style)
        if val_curve:
            val_ax.plot(*zip(*val_curve, strict=True), marker="o", label=config.name, **style)
    train_ax.set(title="training loss per update", xlabel="supervised tokens seen", ylabel="loss (nats/token)")
    val_ax.set(title="validation loss (log perplexity)", xlabel="supervised tokens seen", ylabel="loss (nats/token)")
    for ax in (train_ax, val_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = os.path.join(out, "loss_vs_tokens.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/demo", help="folder for the logs, records and the plot")
    parser.add_argument("--updates", type=int, default=60, help="optimizer updates per configuration")
    parser.add_argument("--documents", type=int, default=1024, help="training documents")
    parser.add_argument("--val-documents", type=int, default=64)
    parser.add_argument("--val-every", type=int, default=10, help="validate every this many updates")
    parser.add_argument("--max-len", type=int, default=96, help="longest document in bytes")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ddp", action="store_true", help="also run a 2-process DDP configuration (gloo, CPU)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[Config]:
    args = parse_args(argv)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    print(f"lightning_accum {lightning_accum.__version__}: effective batch {EFFECTIVE_BATCH} documents per update")
    configs = configurations(args.ddp)
    for config in configs:
        train(config, args)
    picture = plot(configs, args.out)
    print("\n== results")
    for config in configs:
        report = os.path.join(args.out, config.name, "version_0", "accumulation_report.json")
        if os.path.exists(report):
            with open(report) as f:
                record = json.load(f)
            loss = record["ledger"]["last_group"]["loss"]
            print(
                f"{config.name:>20}: {record['effective_batch']['arithmetic']}, {record['updates']['applied']} updates,"
                f" {record['tokens']['total']:,} tokens, last loss {loss:.4f}"
                + ("" if loss is None or math.isfinite(loss) else " (not finite)")
            )
    print(f"\nlogs and run records: {os.path.abspath(args.out)}")
    print(f"picture:              {os.path.abspath(picture)}")
    print(f"open TensorBoard:     tensorboard --logdir {args.out}")
    return configs


if __name__ == "__main__":
    main()
