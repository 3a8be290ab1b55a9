"""Micro-batches cut by tokens: what sorting inside the group buys, the planning time per epoch, and real fits.

``python benchmarks/token_batches.py`` writes ``benchmarks/token_batches.json`` (``--smoke``: a small run with a tiny
fit, printed, and written under ``--out`` when given; ``--no-fits``: the planner only).

Data: the docstrings of this Python's standard library (every module, class and function docstring of the ``.py``
files under ``sysconfig.get_paths()["stdlib"]``, ``test``/``tests``/``idle_test`` folders and ``site-packages`` left
out, read with ``ast``, cleaned by ``ast.get_docstring``), each row's tokens its UTF-8 bytes (a byte-level model, as
the demo's), truncated at a context of ``--context`` bytes. Nothing is downloaded; the same Python gives the same rows.

Padding: one epoch (seed 0) with ``B = m·A·D`` samples per update, compared four ways on the same groups (the
examples of each update are the same in all four):

- fixed ``m``, drawn order: what ``global_order=True`` runs (replica ``r`` takes every ``D``-th position of the group,
  ``m`` at a time), each micro-batch padded to its longest row;
- fixed ``m``, sorted in the group: the group's rows sorted by length, then cut ``m`` at a time;
- token budget, drawn order: the group's rows in drawn order, cut greedily under ``max_tokens`` (no sort);
- token budget, sorted in the group: ``TokenBatchSampler`` itself.

``max_tokens`` is the largest padded micro-batch the fixed-``m`` run meets in the epoch (its peak memory), so the
token budget never needs more memory than the fixed run. Planning time: ``N = 10^6`` lengths drawn from the
docstrings' (seed 0), the whole epoch planned by ``len()``, median of ``--reps``.

Fits: ``Trainer.fit`` of a byte-level causal LM (:class:`ByteLM`: embedding and positions, ``--layers`` pre-norm
transformer layers of width 64 and 4 heads, a 256-way head; a row's byte ``t + 1`` is the label of position ``t``) on
the docstrings' bytes, one device, ``B = m·A`` rows per update, a fixed ``m`` in ``global_order=True``'s order
against ``TokenBatches(max_tokens=T)`` with ``T`` the fixed run's epoch peak (the planner's ``max_tokens``): the same
examples in every update (checked). After a warm-up fit (2 micro-batches, not kept), each fit runs a few updates
(``max_steps``), timed from its first micro-batch to its last update, in wall and process (CPU) seconds: supervised
tokens per second, fixed and token fits alternating ``reps`` times (the ratio per pair, its median). One torch thread
by default (``--threads``): on the shared 2-core machine two threads contend with the other processes' load.
Forward passes per update from the run record; the peak memory of the largest micro-batch counted as the bytes of the
tensors autograd saves for backward during its forward and loss (``torch.autograd.graph.saved_tensors_hooks``, each
storage once, the parameters left out), the maximum over the fit.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import statistics
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from lightning_accum import AccumulationStrategy, GlobalOrderSampler, TokenBatches, TokenBatchSampler  # noqa: E402

SKIPPED = {"test", "tests", "idle_test", "site-packages"}


def docstring_texts(context: int, limit: int | None = None) -> list[bytes]:
    """The UTF-8 bytes of every docstring of the standard library's sources, truncated at ``context`` (the first
    ``limit`` of them in the sources' sorted order: the smoke run parses only as many files as it needs)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts: list[bytes] = []
    for path in sorted(root.rglob("*.py")):
        if SKIPPED & set(path.relative_to(root).parts):
            continue
        if limit is not None and len(texts) >= limit:
            break
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):  # a few sources are deliberately broken
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                text = ast.get_docstring(node, clean=True)
                if text:
                    texts.append(text.encode()[:context])
    return texts[:limit]


def docstring_lengths(context: int, limit: int | None = None) -> np.ndarray:
    """The rows' lengths in bytes (tokens): those of :func:`docstring_texts`."""
    return np.array([len(text) for text in docstring_texts(context, limit)], dtype=np.int64)


def _groups(lengths: np.ndarray, samples: int, replicas: int) -> list[np.ndarray]:
    """Each group's dataset indices in drawn order (global_order's positions [g·B, (g+1)·B), its tail)."""
    order = np.asarray(GlobalOrderSampler(range(len(lengths)), seed=0).order(0))
    end = replicas * (len(order) // replicas)
    return [order[start : min(start + samples, end)] for start in range(0, end, samples)]


def _summary(batches: list[np.ndarray], lengths: np.ndarray, updates: int) -> dict[str, Any]:
    padded = [len(b) * int(lengths[b].max()) for b in batches]
    tokens = int(sum(int(lengths[b].sum()) for b in batches))
    return {
        "padding_fraction": 1 - tokens / sum(padded),
        "microbatches_per_update": len(batches) / updates,
        "largest_microbatch_padded_tokens": max(padded),
        "mean_microbatch_padded_tokens": statistics.fmean(padded),
    }


def _greedy_in_order(rows: np.ndarray, lengths: np.ndarray, budget: int) -> list[np.ndarray]:
    """Rows in the given order, a micro-batch closed when the next row would pass ``budget`` padded tokens."""
    batches, start, longest = [], 0, 0
    for k, length in enumerate(lengths[rows].tolist()):
        if k > start and (k - start + 1) * max(longest, length) > budget:
            batches.append(rows[start:k])
            start, longest = k, 0
        longest = max(longest, length)
    return [*batches, rows[start:]]


def _planned(lengths: np.ndarray, budget: int, samples: int, replicas: int) -> dict[str, Any]:
    """TokenBatchSampler's plan of the epoch, summed from its per-group record."""
    sampler = TokenBatchSampler(range(len(lengths)), lengths, budget, samples, num_replicas=replicas, seed=0)
    stats = sampler.group_stats()
    return {
        "max_tokens": budget,
        "padding_fraction": 1 - sum(s["tokens"] for s in stats) / sum(s["padded_tokens"] for s in stats),
        "microbatches_per_update": statistics.fmean(s["microbatches"] * replicas for s in stats),
        "largest_microbatch_padded_tokens": max(max(s["microbatch_padded_tokens"]) for s in stats),
        "mean_microbatch_padded_tokens": statistics.fmean(p for s in stats for p in s["microbatch_padded_tokens"]),
        "replica_imbalance_mean": statistics.fmean(s["imbalance"] for s in stats),
        "replica_imbalance_max": max(s["imbalance"] for s in stats),
    }


def padding(lengths: np.ndarray, m: int, accumulate: int, replicas: int) -> dict[str, Any]:
    samples = m * accumulate * replicas
    groups = _groups(lengths, samples, replicas)
    shares = [group[r::replicas] for group in groups for r in range(replicas)]  # replica r: every D-th position
    drawn = [share[k : k + m] for share in shares for k in range(0, len(share), m)]
    ordered = [group[np.argsort(-lengths[group], kind="stable")] for group in groups]
    budget = max(len(b) * int(lengths[b].max()) for b in drawn)  # the fixed-m run's peak
    planned = {
        f"tokens_sorted{suffix}": _planned(lengths, budget // part, samples, replicas)
        for part, suffix in ((1, ""), (2, "_half_budget"), (4, "_quarter_budget"))
        if budget // part >= lengths.max()
    }
    return {
        "m": m,
        "accumulate": accumulate,
        "replicas": replicas,
        "samples_per_update": samples,
        "max_tokens": budget,
        "updates": len(groups),
        "fixed_m_drawn": _summary(drawn, lengths, len(groups)),
        "fixed_m_sorted": _summary([g[k : k + m] for g in ordered for k in range(0, len(g), m)], lengths, len(groups)),
        "tokens_drawn": _summary(
            [b for g in groups for b in _greedy_in_order(g, lengths, budget)], lengths, len(groups)
        ),
        **planned,
    }


def planning_time(pool: np.ndarray, n: int, samples: int, replicas: int, budget: int, reps: int) -> dict[str, Any]:
    lengths = np.random.default_rng(0).choice(pool, size=n)
    times, made = [], []
    for rep in range(reps):
        start = time.perf_counter()
        sampler = TokenBatchSampler(range(n), lengths, budget, samples, num_replicas=replicas, seed=0)
        made.append(time.perf_counter() - start)
        sampler.set_epoch(rep)
        start = time.perf_counter()
        count = len(sampler)  # plans the whole epoch
        times.append(time.perf_counter() - start)
    return {
        "n": n,
        "samples_per_update": samples,
        "replicas": replicas,
        "max_tokens": budget,
        "microbatches_per_replica": count,
        "plan_seconds_median": statistics.median(times),
        "plan_seconds": times,
        "construct_seconds_median": statistics.median(made),
    }


IGNORE_INDEX = -100


class ByteRows(Dataset):
    """Row ``i``: its index and the bytes of docstring ``i`` as tokens (unpadded; :func:`pad_rows` pads)."""

    def __init__(self, texts: list[bytes]) -> None:
        self.rows = [torch.frombuffer(bytearray(text), dtype=torch.uint8).long() for text in texts]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor]:
        return index, self.rows[index]


def pad_rows(rows: list[tuple[int, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A micro-batch padded to its longest row: byte ``t + 1`` is the label of position ``t`` (a row's last
    position and the padding carry ``ignore_index``)."""
    width = max(len(row) for _, row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for k, (_, row) in enumerate(rows):
        ids[k, : len(row)] = row
        labels[k, : len(row) - 1] = row[1:]
    lengths = torch.tensor([len(row) for _, row in rows])
    return {"input_ids": ids, "labels": labels, "index": torch.tensor([i for i, _ in rows]), "lengths": lengths}


class ByteLM(L.LightningModule):
    """A tiny causal transformer over bytes (as the demo's): width 64, 4 heads, ``layers`` pre-norm layers.

    It keeps what the benchmark measures: per micro-batch its rows, tokens and padded tokens, the examples of the
    open group, and the bytes of the tensors autograd saves for backward during its forward and loss (each storage
    once, the parameters left out: the activations the micro-batch holds until its backward)."""

    def __init__(self, context: int, layers: int, width: int = 64, heads: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tokens = nn.Embedding(256, width)
        self.positions = nn.Embedding(context, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)
        self.microbatches: list[tuple[int, int, int, int]] = []  # rows, tokens, padded tokens, saved bytes
        self.group: list[int] = []
        self._saved: dict[int, int] = {}
        self._parameters_at: set[int] = set()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        x = self.tokens(input_ids) + self.positions(torch.arange(t, device=input_ids.device))
        return self.head(self.norm(self.blocks(x, mask=self.causal[:t, :t], is_causal=True)))

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._parameters_at:
            self._saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    def on_train_start(self) -> None:
        self._parameters_at = {p.untyped_storage().data_ptr() for p in self.parameters()}

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        self._saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor):
            logits = self(batch["input_ids"])
            loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX)
        rows, width = batch["input_ids"].shape
        self.microbatches.append((rows, int(batch["lengths"].sum()), rows * width, sum(self._saved.values())))
        self.group.extend(batch["index"].tolist())
        return {"loss": loss, "num_tokens": (batch["labels"] != IGNORE_INDEX).sum()}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.0)


class UpdateClock(L.Callback):
    """Before the first micro-batch and after every update (the strategy's group listener): the wall and process
    (CPU, all threads) times; after every update its record and its examples."""

    def __init__(self) -> None:
        self.times: list[tuple[float, float]] = []
        self.records: list[Any] = []
        self.groups: list[list[int]] = []

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.model = pl_module
        trainer.strategy.add_group_listener(self.on_group)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, index: int) -> None:
        if not self.times:
            self.times.append((time.perf_counter(), time.process_time()))

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        trainer.strategy.remove_group_listener(self.on_group)

    def on_group(self, record: Any, batch_samples: Any) -> None:
        self.times.append((time.perf_counter(), time.process_time()))
        self.records.append(record)
        self.groups.append(sorted(self.model.group))
        self.model.group = []


def fit(
    texts: list[bytes], kind: str, m: int, accumulate: int, max_tokens: int, updates: int, layers: int, context: int
) -> dict[str, Any]:
    """One fit of ``updates`` updates of ``B = m·A`` rows on one device: a fixed ``m`` in ``global_order=True``'s order
    (``kind="fixed"``) or the same groups cut by ``TokenBatches(max_tokens)`` (``kind="tokens"``)."""
    if kind == "fixed":
        strategy = AccumulationStrategy(global_order=True)
    else:
        lengths = [len(text) for text in texts]
        strategy = AccumulationStrategy(token_batches=TokenBatches(max_tokens=max_tokens, lengths=lengths))
    L.seed_everything(0, verbose=False)  # the order's seed (PL_GLOBAL_SEED): the planner's groups
    model, clock = ByteLM(context, layers), UpdateClock()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        accumulate_grad_batches=accumulate,
        max_steps=updates,
        max_epochs=1,
        callbacks=[clock],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, DataLoader(ByteRows(texts), batch_size=m, shuffle=True, collate_fn=pad_rows))
    records, batches = clock.records, model.microbatches
    (wall, cpu), supervised = np.diff(np.array(clock.times), axis=0).T, sum(r.tokens for r in records)
    peak = max(batches, key=lambda batch: batch[3])
    return {
        "kind": kind,
        "updates": len(records),
        "seconds": float(wall.sum()),
        "supervised_tokens_per_second": supervised / float(wall.sum()),
        "supervised_tokens_per_cpu_second": supervised / float(cpu.sum()),
        "seconds_per_update": wall.tolist(),
        "cpu_seconds_per_update": cpu.tolist(),
        "supervised_tokens_per_update": [r.tokens for r in records],
        "samples_per_update": [r.samples for r in records],
        "forward_passes_per_update": statistics.fmean(r.microbatches for r in records),
        "forward_passes": len(batches),
        "padded_tokens": sum(b[2] for b in batches),
        "padding_fraction": 1 - sum(b[1] for b in batches) / sum(b[2] for b in batches),
        "largest_microbatch_padded_tokens": max(b[2] for b in batches),
        "peak_saved_activation_bytes": peak[3],
        "peak_microbatch": {"rows": peak[0], "tokens": peak[1], "padded_tokens": peak[2]},
        "losses": [r.loss for r in records],
        "groups": clock.groups,
    }


def fits(
    texts: list[bytes], m: int, accumulate: int, updates: int, reps: int, layers: int, context: int
) -> dict[str, Any]:
    """Fixed ``m`` against ``TokenBatches`` at the fixed run's epoch peak ``T``, alternating, ``reps`` times."""
    lengths = np.array([len(text) for text in texts], dtype=np.int64)
    planned = padding(lengths, m, accumulate, 1)
    budget = planned["max_tokens"]
    runs: dict[str, list[dict[str, Any]]] = {"fixed": [], "tokens": []}
    fit(texts, "fixed", m, 2, budget, 1, layers, context)  # the warm-up: 2 micro-batches, not kept
    for _ in range(reps):
        for kind in runs:
            runs[kind].append(fit(texts, kind, m, accumulate, budget, updates, layers, context))
    fixed, tokens = runs["fixed"], runs["tokens"]
    pairs = list(zip(fixed, tokens, strict=True))
    ratios = {
        unit: [t[f"supervised_tokens_per_{unit}"] / f[f"supervised_tokens_per_{unit}"] for f, t in pairs]
        for unit in ("second", "cpu_second")
    }
    same = all(f["groups"] == t["groups"] for f, t in zip(fixed, tokens, strict=True))
    gap = max(
        abs(a - b) for f, t in zip(fixed, tokens, strict=True) for a, b in zip(f["losses"], t["losses"], strict=True)
    )
    for run in fixed + tokens:
        del run["groups"]
    return {
        "m": m,
        "accumulate": accumulate,
        "samples_per_update": m * accumulate,
        "max_tokens": budget,
        "updates_per_fit": updates,
        "reps": reps,
        "epoch_padding_fraction": {
            "fixed_m": planned["fixed_m_drawn"]["padding_fraction"],
            "tokens": planned["tokens_sorted"]["padding_fraction"],
        },
        "same_examples_per_update": same,
        "largest_group_loss_gap": gap,
        "padded_tokens_ratio": fixed[0]["padded_tokens"] / tokens[0]["padded_tokens"],
        "tokens_per_second_ratio_median": statistics.median(ratios["second"]),
        "tokens_per_second_ratios": ratios["second"],
        "tokens_per_cpu_second_ratio_median": statistics.median(ratios["cpu_second"]),
        "tokens_per_cpu_second_ratios": ratios["cpu_second"],
        "supervised_tokens_per_second_median": {
            kind: statistics.median(r["supervised_tokens_per_second"] for r in runs[kind]) for kind in runs
        },
        "fixed_m": fixed,
        "tokens": tokens,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--plan-n", type=int, default=1_000_000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=1, help="transformer layers of the fits' model")
    parser.add_argument("--threads", type=int, default=1, help="torch's threads (0: torch's default)")
    parser.add_argument("--no-fits", action="store_true", help="the planner only")
    parser.add_argument("--out", type=Path, default=None, help="folder of token_batches.json (default: here)")
    parser.add_argument("--smoke", action="store_true", help="a small run with a tiny fit, printed (written: --out)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    texts = docstring_texts(args.context, 2000 if args.smoke else None)
    lengths = np.array([len(text) for text in texts], dtype=np.int64)
    splits = [(8, 8, 1), (16, 4, 1), (8, 32, 1), (8, 128, 1), (8, 4, 2), (4, 4, 4), (8, 16, 8)]
    plans = [(64, 1), (64, 8), (1024, 8)]
    # the fits: (m, A, updates per fit with the first the warm-up, reps); the smoke's on short rows
    runs = [(4, 4, 3, 1)] if args.smoke else [(8, 8, 6, 3), (8, 128, 1, 3)]
    fit_texts = [text[:64] for text in texts[:400]] if args.smoke else texts
    n = 20_000 if args.smoke else args.plan_n
    result = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "data": {
            "rows": len(lengths),
            "context": args.context,
            "mean": float(lengths.mean()),
            "percentiles": {str(q): float(np.percentile(lengths, q)) for q in (10, 50, 90, 99)},
            "at_context": int((lengths == args.context).sum()),
        },
        "padding": [padding(lengths, m, a, d) for m, a, d in splits],
        "planning": [planning_time(lengths, n, b, d, 16 * args.context, args.reps) for b, d in plans],
    }
    if not args.no_fits:
        context = max(len(text) for text in fit_texts)
        result["fits"] = {
            "model": {"layers": args.layers, "width": 64, "heads": 4, "context": context},
            "load_average_before": list(os.getloadavg()),
            "runs": [fits(fit_texts, m, a, u, r, args.layers, context) for m, a, u, r in runs],
            "load_average_after": list(os.getloadavg()),
        }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None or not args.smoke:
        out = HERE if args.out is None else args.out
        out.mkdir(parents=True, exist_ok=True)
        (out / "token_batches.json").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
