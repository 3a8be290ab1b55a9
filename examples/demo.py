"""lightning-accum demo: the same data and effective batch, split differently; plain Lightning against exact.

One small byte-level GPT trains on documents whose lengths vary strongly, mixed within every
accumulation group: about half are very short (random identifiers of 2 to 8 letters and digits,
such as ``k3Xq9``, the IDs, codes and hashes that scraped data is full of: high loss that no model
can lower), the others long (half the maximum length up to the maximum) passages of the help text
that every CPython installation ships (``pydoc_data.topics``; so the exact figures differ a little
between Python versions). Padding
carries ``ignore_index``, so micro-batches hold very different numbers of supervised tokens.

Every configuration reads the same documents in the same order and updates on the same 32
documents (the same groups):

- plain Lightning (``strategy="auto"``, its own ``accumulate_grad_batches``) at (m, A) = (16, 2),
  (4, 8), (2, 16): it back-propagates the mean of the micro-batch means, an objective that changes
  with the split, so the three runs train differently;
- ``strategy="accum"`` at the same three splits, and ``strategy="accum_ddp_spawn"`` with 2 processes
  (m, A, D) = (4, 4, 2) whose replicas together read exactly the single-device groups: every update
  is the gradient of the token-weighted mean over the group, so the four runs draw one curve;
- ``AccumulationStrategy(token_batches=TokenBatches(max_tokens=..., lengths=...))``: the same groups of 32, each
  sorted by length and cut into as many micro-batches as its rows need under ``max_tokens`` padded tokens (rows ×
  the longest row), three quarters of the (16, 2) run's largest micro-batch: 2 or 3 micro-batches per update, less
  padding and less memory than (16, 2), and the same curve. Its order is a ``GlobalOrderSampler`` of the same seed,
  whose order is :class:`GroupSampler`'s (one ``torch.randperm`` seeded by ``seed + epoch``), so its group ``g``
  holds the same 32 documents.

Every micro-batch is padded to its longest row (:func:`trim`), as a collate function does; the results table shows
each run's time, micro-batches per update, padding fraction and largest micro-batch in padded tokens.

The console gets one line per run and the results; everything the runs print (Lightning, the package's callbacks,
the DDP processes) goes to ``demo.log`` under ``--out``, beside each run's ``accumulation_report.json`` and ``.txt``.
The picture (``loss_vs_tokens.png``) has three panels: the training loss each run back-propagates,
the validation loss (the same token-weighted measure for every run), and per update the difference
of the group's token-weighted training loss from the exact (16, 2) run, on a log scale. The picture and the
results table (``results.txt``) are rewritten after every run with the runs done so far, so a demo stopped part-way
leaves what it finished. Each invocation clears the folders of its runs under ``--out`` first, so the picture, the
table and the TensorBoard logs hold only the latest runs.

Run it with ``bash scripts/demo.sh`` (options below); ``--quick`` is the short variant (a smaller model, data and
run length; the tests use it too).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import string
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from pydoc_data.topics import topics
from typing import Any, TextIO

import lightning as L
import torch
import torch.distributed
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, Sampler
from torchmetrics.text import Perplexity

import lightning_accum
from lightning_accum import (
    AccumulationCheck,
    AccumulationReport,
    AccumulationStrategy,
    AxisLogger,
    AxisProgressBar,
    GlobalOrderSampler,
    Horizon,
    TokenBatches,
)

IGNORE_INDEX = -100
EFFECTIVE_BATCH = 32
ID_CHARACTERS = string.ascii_letters + string.digits  # the short documents: random identifiers
PICTURE = "loss_vs_tokens.png"
#: The token run's `max_tokens`: this share of the (16, 2) run's largest micro-batch in padded tokens. At the whole of
#: it every group of this data cuts into 2 micro-batches (its ~16 long rows fit one); at 3/4 the count varies (2 or
#: 3) and the largest micro-batch holds a quarter fewer padded tokens than the (16, 2) run's.
TOKEN_BUDGET = 0.75
FOOTPRINT = "footprint.json"  # per run, beside its TensorBoard logs: micro-batches, padding, the largest micro-batch
TABLE = "results.txt"
LOG = "demo.log"


# ---------------------------------------------------------------------------- data


class ByteDocuments(Dataset):
    """Half very short documents (random identifiers, 2..8 bytes), half long (max_len/2..max_len bytes of help text).

    Each is right-padded to ``max_len``; padding is not supervised (``ignore_index``).
    """

    def __init__(self, count: int, max_len: int, seed: int) -> None:
        text = "\n\n".join(topics[key] for key in sorted(topics)).encode("utf-8")
        rng = random.Random(seed)
        self.max_len = max_len
        self.docs: list[bytes] = []  # plain bytes: cheap to send to spawned processes
        for _ in range(count):
            if rng.random() < 0.5:
                self.docs.append("".join(rng.choices(ID_CHARACTERS, k=rng.randint(2, 8))).encode())
            else:
                length = rng.randint(max_len // 2, max_len)
                start = rng.randrange(0, len(text) - length)
                self.docs.append(text[start : start + length])

    def __len__(self) -> int:
        return len(self.docs)

    def lengths(self) -> list[int]:
        """The supervised tokens (= the unpadded row) of every document, read once from the bytes."""
        return [len(doc) - 1 for doc in self.docs]

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        doc = torch.tensor(list(self.docs[index]), dtype=torch.long)
        ids = torch.zeros(self.max_len, dtype=torch.long)
        labels = torch.full((self.max_len,), IGNORE_INDEX, dtype=torch.long)
        ids[: len(doc) - 1] = doc[:-1]
        labels[: len(doc) - 1] = doc[1:]  # next-byte prediction; padding is ignored
        return {"input_ids": ids, "labels": labels}


def trim(rows: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Collate: the rows stacked and cut to the longest of them (a causal model's outputs on the kept positions are
    the same), so a micro-batch pays rows × its longest row.

    Example:
        >>> trim([ByteDocuments(4, 16, seed=0)[i] for i in range(4)])["labels"].shape
        torch.Size([4, 13])
    """
    batch = torch.utils.data.default_collate(rows)
    width = int((batch["labels"] != IGNORE_INDEX).sum(1).max())
    return {key: value[:, :width] for key, value in batch.items()}


def _rank_and_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class GroupSampler(Sampler[int]):
    """The same accumulation groups on one device and on ``D`` replicas.

    One seeded permutation per epoch, cut into groups of ``group_size`` examples (an incomplete last
    group is left out). On ``D`` replicas, replica ``r`` reads the ``r``-th of ``D`` consecutive
    shares of every group, so the union of what the replicas read in an update is exactly the group
    a single device reads. The rank is read when iterating (inside the spawned process), so use it
    with ``Trainer(use_distributed_sampler=False)``. Without ``seed`` the order is the dataset's.

    Example:
        >>> list(GroupSampler(10, 4, seed=None))
        [0, 1, 2, 3, 4, 5, 6, 7]
    """

    def __init__(self, num_examples: int, group_size: int, seed: int | None) -> None:
        self.num_examples = num_examples
        self.group_size = group_size
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:  # Lightning calls this at the start of every epoch
        self.epoch = epoch

    def _order(self) -> list[int]:
        if self.seed is None:
            return list(range(self.num_examples))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_examples, generator=generator).tolist()

    def indices(self, rank: int, world: int) -> list[int]:
        """What replica ``rank`` of ``world`` reads this epoch, in order."""
        share = self.group_size // world
        order = self._order()
        return [
            index
            for start in range(0, len(order) - self.group_size + 1, self.group_size)
            for index in order[start + rank * share : start + (rank + 1) * share]
        ]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices(*_rank_and_world()))

    def __len__(self) -> int:
        return (self.num_examples // self.group_size) * (self.group_size // _rank_and_world()[1])


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
        self.log_validation = True  # the plain runs write validation on the tokens axis themselves
        self.last_val_loss = math.nan

    def forward(self, input_ids: Tensor) -> Tensor:
        t = input_ids.shape[1]
        x = self.tokens(input_ids) + self.positions(torch.arange(t, device=input_ids.device))
        x = self.blocks(x, mask=self.causal[:t, :t], is_causal=True)
        return self.head(self.norm(x))

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        logits = self(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX)
        return {"loss": loss, "num_tokens": (batch["labels"] != IGNORE_INDEX).sum()}

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        logits = self(batch["input_ids"])
        self.val_perplexity.update(logits, batch["labels"])  # for the plain Lightning runs' `val/loss`
        # The training contract: the exact runs' strategy also logs `accum/val_loss` from it (the same value as
        # `val/loss`: both weight every token of the set once, over every replica).
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX)
        return {"loss": loss, "num_tokens": (batch["labels"] != IGNORE_INDEX).sum()}

    def on_validation_epoch_end(self) -> None:
        loss = self.val_perplexity.compute().log()  # token-weighted over the whole set and all replicas
        self.val_perplexity.reset()
        self.last_val_loss = float(loss)
        if self.log_validation:
            self.log("val/loss", loss, sync_dist=False)  # already reduced over replicas by the metric

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"], weight_decay=0.0)


class PlainTokenAxis(L.Callback):
    """For the plain Lightning runs (one device): their curves on the same tokens axis as the exact runs.

    Lightning back-propagates ``Σ_i loss_i / A`` (a mean of micro-batch means); this writes that value as
    ``plain/objective``, the group's token-weighted loss ``Σ_i n_i·loss_i / Σ_i n_i`` (the exact runs'
    objective, same measure for every run) as ``accum/loss``, and the validation loss as ``val/loss``,
    each at x = supervised tokens seen.
    """

    def __init__(self) -> None:
        self.tokens = 0
        self.objective = 0.0
        self.weighted = 0.0
        self.group_tokens = 0

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        a = trainer.accumulate_grad_batches
        n = int((batch["labels"] != IGNORE_INDEX).sum())
        divided = float(outputs["loss"])  # Lightning's outputs["loss"] is the micro-batch mean divided by A
        self.objective += divided
        self.weighted += divided * a * n
        self.group_tokens += n
        self.tokens += n
        if (batch_idx + 1) % a == 0:  # the sampler yields whole groups only
            logger = trainer.logger
            assert logger is not None
            metrics = {"plain/objective": self.objective, "accum/loss": self.weighted / max(self.group_tokens, 1)}
            logger.log_metrics(metrics, step=self.tokens)
            self.objective, self.weighted, self.group_tokens = 0.0, 0.0, 0

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.logger is not None and self.tokens > 0:
            trainer.logger.log_metrics({"val/loss": pl_module.last_val_loss}, step=self.tokens)  # type: ignore[attr-defined]


class PlainLines(L.Callback):
    """For the plain Lightning runs: a plain progress line every ``interval`` seconds and at the end (Lightning's own
    bar, outside a terminal, prints nothing until the run ends), in the exact runs' words."""

    def __init__(self, name: str, updates: int, interval: float) -> None:
        self.name, self.updates, self.interval = name, updates, interval
        self.start = self.last = 0.0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = self.last = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        now = time.perf_counter()
        if now - self.last >= self.interval or trainer.global_step >= self.updates:
            self.last = now
            print(
                f"epoch {trainer.current_epoch} | updates {trainer.global_step}/{self.updates} | elapsed"
                f" {now - self.start:.0f} s | {self.name} (plain Lightning)",
                flush=True,
            )


class Footprint(L.Callback):
    """What each update costs, from the micro-batches as they run: their number, their padded tokens (rows × width)
    against the supervised ones, and the largest; written to ``footprint.json`` in the run's log folder at the end
    (under DDP, replica 0's share)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.per_update: list[int] = []
        self.running = self.padded = self.supervised = self.peak = 0

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.running += 1
        self.padded += batch["labels"].numel()
        self.peak = max(self.peak, batch["labels"].numel())
        self.supervised += int((batch["labels"] != IGNORE_INDEX).sum())
        if trainer.global_step > len(self.per_update):  # this micro-batch closed an update
            self.per_update.append(self.running)
            self.running = 0

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == 0:
            record = {"microbatches_per_update": self.per_update, "peak_padded_tokens": self.peak}
            record["padding_fraction"] = 1 - self.supervised / max(self.padded, 1)
            (self.folder / FOOTPRINT).write_text(json.dumps(record) + "\n")


# ---------------------------------------------------------------------------- runs


@dataclass
class Config:
    name: str
    m: int
    accumulate: int
    replicas: int = 1
    plain: bool = False
    tokens: bool = False  # micro-batches cut by tokens (`token_batches=`) inside the groups of (m, A, D)

    @property
    def split(self) -> str:
        return "(by tokens)" if self.tokens else f"({self.m}, {self.accumulate}, {self.replicas})"


def configurations(ddp: bool) -> list[Config]:
    """The runs, the reference first: the exact splits (and DDP), micro-batches cut by tokens, then plain Lightning at
    the same splits."""
    configs = [Config("accum_m16_a2", 16, 2), Config("accum_m4_a8", 4, 8), Config("accum_m2_a16", 2, 16)]
    if ddp:
        configs.append(Config("accum_ddp_m4_a4_d2", 4, 4, replicas=2))
    configs += [
        Config("accum_tokens", 16, 2, tokens=True),  # the (16, 2) run's loader and A: B = 32, read by tokens
        Config("lightning_m16_a2", 16, 2, plain=True),
        Config("lightning_m4_a8", 4, 8, plain=True),
        Config("lightning_m2_a16", 2, 16, plain=True),
    ]
    return configs


def log_folder(out: str | os.PathLike[str], config: Config) -> Path:
    return Path(out) / config.name / "version_0"


def clear_previous_runs(out: str) -> None:
    """Remove what an earlier invocation left: every configuration's folder (DDP too), the picture and the table."""
    for config in configurations(ddp=True):
        shutil.rmtree(Path(out) / config.name, ignore_errors=True)
    for name in (PICTURE, TABLE, LOG):
        (Path(out) / name).unlink(missing_ok=True)


@contextlib.contextmanager
def into(log: TextIO) -> Iterator[None]:
    """Everything printed meanwhile goes to ``log``: Python's streams, and file descriptors 1 and 2, which the DDP run's
    spawned processes inherit (the console keeps one line per run)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            yield
    finally:
        log.flush()
        for fd, original in zip((1, 2), saved, strict=True):
            os.dup2(original, fd)
            os.close(original)


def train(config: Config, args: argparse.Namespace, index: int, count: int, log: TextIO) -> float:
    assert config.m * config.accumulate * config.replicas == EFFECTIVE_BATCH
    kind = "plain Lightning, 'auto'" if config.plain else "exact, 'accum'"
    if config.replicas > 1:
        kind = f"exact, 'accum_ddp_spawn', {config.replicas} processes"
    shape = f"m × A × D = {config.m} × {config.accumulate} × {config.replicas}"
    if config.tokens:
        kind, shape = "exact, token_batches=", f"{EFFECTIVE_BATCH} per update, ≤ {token_budget(args):,} padded tokens"
    heading = f"run {index}/{count} {config.name:<18} ({kind}): {shape}"
    print(heading, end="", flush=True)
    print(f"\n== {heading}: {EFFECTIVE_BATCH} documents per update, {args.updates} updates", file=log, flush=True)
    start = time.perf_counter()
    with into(log):
        tokens = _fit(config, args, index)
    seconds = time.perf_counter() - start
    print(f": {args.updates} updates, {tokens:,} tokens, {seconds:.1f} s", flush=True)
    return seconds


def fixed_peak(args: argparse.Namespace, m: int = 16) -> int:
    """The largest micro-batch of the fixed-``m`` run in padded tokens (``m`` × its longest row), from the lengths and
    the groups its updates read: the token run's ``max_tokens``."""
    lengths = ByteDocuments(args.documents, args.max_len, seed=args.seed).lengths()
    sampler, order = GroupSampler(len(lengths), EFFECTIVE_BATCH, seed=args.seed), []
    for epoch in range(math.ceil(args.updates * EFFECTIVE_BATCH / len(sampler))):
        sampler.set_epoch(epoch)
        order += sampler.indices(0, 1)
    order = order[: args.updates * EFFECTIVE_BATCH]
    return max(m * max(lengths[i] for i in order[start : start + m]) for start in range(0, len(order), m))


def token_budget(args: argparse.Namespace) -> int:
    """The token run's ``max_tokens``: :data:`TOKEN_BUDGET` of the (16, 2) run's largest micro-batch."""
    return int(TOKEN_BUDGET * fixed_peak(args))


def _fit(config: Config, args: argparse.Namespace, index: int) -> int:
    """One configuration's fit; the supervised tokens it trained on."""
    L.seed_everything(args.seed, verbose=False)
    model = TinyGPT(args.max_len, width=args.width, layers=args.layers, lr=args.lr)
    train_data = ByteDocuments(args.documents, args.max_len, seed=args.seed)
    val_data = ByteDocuments(args.val_documents, args.max_len, seed=args.seed + 1)
    logger = TensorBoardLogger(args.out, name=config.name, version=0, default_hp_metric=False)
    callbacks: list[L.Callback] = [Footprint(log_folder(args.out, config))]
    # In micro-batches: every `val_every` updates (a token run's updates vary in micro-batches: `Horizon` instead).
    val_check_interval = args.val_every * config.accumulate
    # The exact runs' order: `GroupSampler` (also sharding DDP's groups); the token run's: the same order, read by the
    # strategy's token sampler, which takes a `GlobalOrderSampler` of the loader as its order.
    sampler: Sampler[int] = GroupSampler(len(train_data), EFFECTIVE_BATCH, seed=args.seed)
    if config.plain:
        strategy: Any = "auto"
        model.log_validation = False
        callbacks.append(plain_axis := PlainTokenAxis())
        if not args.quiet:
            callbacks.append(PlainLines(config.name, args.updates, interval=10.0))
    else:
        strategy = "accum_ddp_spawn" if config.replicas > 1 else "accum"
        if config.tokens:
            budget = TokenBatches(max_tokens=token_budget(args), lengths=train_data.lengths())
            strategy = AccumulationStrategy(token_batches=budget)
            sampler = GlobalOrderSampler(train_data, shuffle=True, seed=args.seed)
            callbacks.append(Horizon(axis="updates", validate_every=args.val_every))
            val_check_interval = 10**9  # never: the Horizon validates
        callbacks += [AxisLogger(axis="tokens"), AccumulationReport()]  # the run record: its files and 3 lines
        if not args.quiet:
            # Applied updates out of `--updates`, the rate and the time left; outside a terminal (a log file, CI), one
            # plain line every 10 s instead of a bar that shows nothing until the run ends.
            callbacks.append(AxisProgressBar(axis="updates", interval=10.0))
        if index == 1:  # the pre-flight check once: one group against the same examples in one batch
            callbacks.append(AccumulationCheck())
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=config.replicas,
        accumulate_grad_batches=config.accumulate,
        max_steps=args.updates,
        max_epochs=-1,
        val_check_interval=val_check_interval,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,  # GroupSampler shards the groups itself (the same groups as one device)
        logger=logger,
        callbacks=callbacks,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=not args.quiet and not config.plain,  # plain runs: `PlainLines`
    )
    train_loader = DataLoader(train_data, batch_size=config.m, sampler=sampler, collate_fn=trim)
    # Validation: each replica reads its share of the set; the perplexity metric sums over replicas.
    val_loader = DataLoader(val_data, batch_size=16, sampler=GroupSampler(len(val_data), len(val_data), seed=None))
    trainer.fit(model, train_loader, val_loader)
    return plain_axis.tokens if config.plain else trainer.strategy.ledger.tokens  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------- reading back


def read_curves(folder: str | os.PathLike[str], tag: str) -> list[tuple[int, float]]:
    """(step, value) pairs of ``tag`` from the TensorBoard event files in ``folder``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    if tag not in events.Tags()["scalars"]:
        return []
    return [(int(e.step), float(e.value)) for e in events.Scalars(tag)]


@dataclass
class Curves:
    objective: dict[int, float]  # what the run back-propagates, at x = tokens
    weighted: dict[int, float]  # the group's token-weighted training loss, at x = tokens
    val: dict[int, float]
    footprint: dict[str, Any]  # `Footprint`'s record (empty if the run left none)


def read_run(out: str | os.PathLike[str], config: Config) -> Curves:
    folder = log_folder(out, config)
    weighted = dict(read_curves(folder, "accum/loss"))
    objective = dict(read_curves(folder, "plain/objective")) if config.plain else weighted
    footprint = json.loads((folder / FOOTPRINT).read_text()) if (folder / FOOTPRINT).exists() else {}
    return Curves(objective, weighted, dict(read_curves(folder, "val/loss")), footprint)


def largest_gap(a: dict[int, float], b: dict[int, float]) -> float:
    """The largest |a - b| over the x both curves share (NaN if they share none)."""
    common = a.keys() & b.keys()
    return max((abs(a[x] - b[x]) for x in common), default=math.nan)


def plot(configs: list[Config], curves: dict[str, Curves], out: str) -> str:
    """The three panels, from the event files just written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (obj_ax, val_ax, gap_ax) = plt.subplots(1, 3, figsize=(17, 5))
    reference = curves[configs[0].name].weighted
    exact_styles = [
        {"color": "tab:blue", "linewidth": 5, "alpha": 0.35},
        {"color": "tab:blue", "linewidth": 2},
        {"color": "navy", "linewidth": 1, "linestyle": "--"},
        {"color": "black", "linewidth": 1, "linestyle": ":"},
        {"color": "tab:green", "linewidth": 1.5, "linestyle": (0, (4, 4))},
    ]
    plain_colors = ["tab:orange", "tab:red", "tab:purple"]
    exact_i = plain_i = 0
    for config in configs:
        run = curves[config.name]
        if config.plain:
            style: dict[str, Any] = {"color": plain_colors[plain_i % 3], "linewidth": 1.5}
            plain_i += 1
            label = f"plain Lightning (m, A, D) = {config.split}"
        elif config.tokens:
            style, label = exact_styles[-1], f"accum, micro-batches cut by tokens ({EFFECTIVE_BATCH} per update)"
        else:
            style = exact_styles[exact_i % 4]
            exact_i += 1
            label = f"accum{'_ddp' if config.replicas > 1 else ''} (m, A, D) = {config.split}"
        if run.objective:
            obj_ax.plot(*zip(*sorted(run.objective.items()), strict=True), label=label, **style)
        if run.val:
            val_ax.plot(*zip(*sorted(run.val.items()), strict=True), marker="o", markersize=3, label=label, **style)
        if config.name != configs[0].name:
            common = sorted(run.weighted.keys() & reference.keys())
            updates = [reference_updates(reference, x) for x in common]
            # A difference of exactly zero cannot be drawn on a log scale: drawn at 1e-9.
            gaps = [max(abs(run.weighted[x] - reference[x]), 1e-9) for x in common]
            gap_ax.plot(updates, gaps, label=label, **style)
    obj_ax.set(
        title="training loss each run back-propagates\n(plain Lightning: the mean of micro-batch means)",
        xlabel="supervised tokens seen",
        ylabel="loss (nats/token)",
    )
    val_ax.set(
        title="validation loss (token-weighted, the same for every run)",
        xlabel="supervised tokens seen",
        ylabel="loss (nats/token)",
    )
    gap_ax.set(
        title=f"per update: |token-weighted group loss − {configs[0].name}'s|\n(a difference of 0 is drawn at 1e-9)",
        xlabel="update",
        ylabel="absolute difference (nats/token)",
        yscale="log",
    )
    for ax in (obj_ax, val_ax, gap_ax):
        ax.grid(alpha=0.3)
    obj_ax.legend(fontsize=8)
    if len(configs) > 1:  # the first run alone has no gap to draw
        gap_ax.legend(fontsize=8)
    fig.suptitle(
        f"The same documents, {EFFECTIVE_BATCH} per update, split as (m, A, D) or cut by tokens:"
        " exact accumulation draws one curve, plain Lightning one per split"
    )
    fig.tight_layout()
    path = os.path.join(out, PICTURE)
    partial = os.path.join(out, f".{PICTURE}.partial.png")
    fig.savefig(partial, dpi=100)
    plt.close(fig)
    os.replace(partial, path)  # a demo stopped while drawing keeps the previous picture whole
    return path


def reference_updates(reference: dict[int, float], x: int) -> int:
    """The update number (1-based) at which the reference run reached ``x`` tokens."""
    return sorted(reference).index(x) + 1


def footprint_columns(footprint: dict[str, Any]) -> tuple[str, str, str]:
    """Micro-batches per update (min-max), the padding fraction and the largest micro-batch, as the table shows them."""
    if not footprint:
        return "-", "-", "-"
    counts = footprint["microbatches_per_update"]
    spread = f"{min(counts)}-{max(counts)}" if min(counts) != max(counts) else f"{counts[0]}"
    return spread, f"{footprint['padding_fraction']:.0%}", f"{footprint['peak_padded_tokens']:,}"


def results(configs: list[Config], curves: dict[str, Curves], seconds: dict[str, float] | None = None) -> list[str]:
    """The results table and the gaps it shows, as lines (``seconds``: each run's wall time, where known)."""
    reference = curves[configs[0].name]
    lines = [
        f"{'run':>18}  {'(m, A, D)':>11}  {'updates':>7}  {'tokens':>8}  {'seconds':>7}  {'mb/upd':>6}  {'padding':>7}"
        f"  {'peak':>5}  {'last loss':>9}  {'last val':>8}  {'gap':>8}"
    ]
    for config in configs:
        run = curves[config.name]
        tokens = max(run.weighted, default=0)
        last = run.objective[tokens] if tokens in run.objective else math.nan
        val = run.val[max(run.val)] if run.val else math.nan
        gap = largest_gap(run.weighted, reference.weighted) if config.name != configs[0].name else 0.0
        per_update, padding, peak = footprint_columns(run.footprint)
        wall = (seconds or {}).get(config.name, math.nan)
        lines.append(
            f"{config.name:>18}  {config.split:>11}  {len(run.weighted):>7}  {tokens:>8,}  {wall:>7.1f}"
            f"  {per_update:>6}  {padding:>7}  {peak:>5}  {last:>9.4f}  {val:>8.4f}  {gap:>8.2e}"
        )
    exact = [c for c in configs if not c.plain]
    plain = [c for c in configs if c.plain]

    def spread(runs: list[Config], attribute: str) -> float:
        # the largest difference between two runs of the list at the same x
        values = [getattr(curves[c.name], attribute) for c in runs]
        return max((largest_gap(a, b) for i, a in enumerate(values) for b in values[i + 1 :]), default=0.0)

    lines += [
        "",
        "seconds: wall time of the fit; mb/upd: micro-batches per update (DDP: per replica); padding: the share of the",
        "padded tokens (rows × the longest row) that is padding; peak: the largest micro-batch in padded tokens;",
        "last loss: what the run back-propagates (plain Lightning: the mean of micro-batch means);",
        f"gap: the largest gap to {configs[0].name}'s token-weighted group loss, update by update.",
    ]
    for config in (c for c in configs if c.tokens and curves[c.name].footprint):
        own, fixed = curves[config.name].footprint, reference.footprint
        lines.append(
            f"{config.name}: {configs[0].name}'s groups cut under {TOKEN_BUDGET:.0%} of its peak in padded tokens:"
            f" {footprint_columns(own)[0]} micro-batches per update, padding {own['padding_fraction']:.0%} against"
            f" {fixed.get('padding_fraction', math.nan):.0%}"
        )
    if len(exact) > 1:
        lines.append(
            f"exact splits ({', '.join(c.split for c in exact)}): largest difference between their training"
            f" curves {spread(exact, 'objective'):.1e}, validation {spread(exact, 'val'):.1e}"
        )
    if len(plain) > 1:
        lines.append(
            f"plain Lightning ({', '.join(c.split for c in plain)}): largest difference between their training"
            f" curves {spread(plain, 'objective'):.3f}, validation {spread(plain, 'val'):.3f}"
        )
    return lines


def write_table(lines: list[str], heading: str, out: str) -> str:
    """The results table as a file, replaced whole (a demo stopped while writing keeps the previous table)."""
    path = os.path.join(out, TABLE)
    partial = os.path.join(out, f".{TABLE}.partial")
    Path(partial).write_text("\n".join([heading, *lines]) + "\n")
    os.replace(partial, path)
    return path


# ---------------------------------------------------------------------------- command line


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


#: The short variant: fewer and shorter documents, a smaller model, 6 updates per run instead of 40.
QUICK = {"updates": 6, "documents": 192, "val_documents": 32, "val_every": 3, "max_len": 32, "width": 32, "layers": 1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=_HelpFormatter)
    parser.add_argument("--out", default="runs/demo", help="folder for the logs, records and the picture")
    parser.add_argument("--updates", type=int, default=40, help="optimizer updates per run")
    parser.add_argument("--documents", type=int, default=1280, help="training documents")
    parser.add_argument("--val-documents", type=int, default=64, help="validation documents")
    parser.add_argument("--val-every", type=int, default=10, help="validate every this many updates")
    parser.add_argument("--max-len", type=int, default=64, help="longest document in bytes")
    parser.add_argument("--width", type=int, default=64, help="model width")
    parser.add_argument("--layers", type=int, default=2, help="transformer layers")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data, its order and the model")
    parser.add_argument("--no-ddp", action="store_true", help="leave out the 2-process DDP run")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"the short variant, also what the tests run ({', '.join(f'{k}={v}' for k, v in QUICK.items())})",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    return args


def tensorboard_command(out: str) -> str:
    """A command that opens the logs from any folder: the TensorBoard beside this Python, absolute paths."""
    executable = Path(sys.executable).parent / "tensorboard"
    program = str(executable) if executable.exists() else f"{sys.executable} -m tensorboard.main"
    return f"{program} --logdir {Path(out).resolve()}"


def main(argv: list[str] | None = None) -> list[Config]:
    args = parse_args(argv)
    # A deprecation inside Lightning 2.6's own loaders (torch 2.13's pytree), not the demo's: kept out of its log.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*", category=FutureWarning)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    configs = configurations(ddp=not args.no_ddp)
    print(
        f"lightning_accum {lightning_accum.__version__}: {len(configs)} runs of {args.updates} updates of"
        f" {EFFECTIVE_BATCH} documents (half identifiers of 2..8 bytes, half passages of {args.max_len // 2}.."
        f"{args.max_len} bytes), into {Path(args.out).resolve()} (cleared first)",
        flush=True,
    )
    clear_previous_runs(args.out)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    training = 0.0
    curves: dict[str, Curves] = {}
    seconds: dict[str, float] = {}
    with open(Path(args.out) / LOG, "w") as log:
        for index, config in enumerate(configs, start=1):
            seconds[config.name] = train(config, args, index, len(configs), log)
            training += seconds[config.name]
            # The table and the picture of the runs so far, after each run: a stopped demo leaves what it finished.
            curves[config.name] = read_run(args.out, config)
            done = configs[:index]
            heading = f"== results ({training:.0f} s of training; {index} of {len(configs)} runs done)"
            table = write_table(results(done, curves, seconds), heading, args.out)
            picture = plot(done, curves, args.out)
    print(f"\n== results ({training:.0f} s of training)")
    print("\n".join(results(configs, curves, seconds)))
    print(f"\nlogs, run records, log: {Path(args.out).resolve()} (everything the runs printed: {LOG})")
    print(f"results table:          {Path(table).resolve()}")
    print(f"picture:                {Path(picture).resolve()}")
    print(f"open TensorBoard:       {tensorboard_command(args.out)}")
    return configs


if __name__ == "__main__":
    main()
