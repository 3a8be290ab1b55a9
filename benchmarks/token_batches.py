"""Micro-batches cut by tokens: what sorting inside the group buys, and the planning time per epoch.

``python benchmarks/token_batches.py`` writes ``benchmarks/token_batches.json`` (``--smoke``: a small run, printed).

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
"""

from __future__ import annotations

import argparse
import ast
import json
import platform
import statistics
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from lightning_accum import GlobalOrderSampler, TokenBatchSampler  # noqa: E402

SKIPPED = {"test", "tests", "idle_test", "site-packages"}


def docstring_lengths(context: int) -> np.ndarray:
    """The UTF-8 bytes of every docstring of the standard library's sources, truncated at ``context``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    lengths = []
    for path in sorted(root.rglob("*.py")):
        if SKIPPED & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):  # a few sources are deliberately broken
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                text = ast.get_docstring(node, clean=True)
                if text:
                    lengths.append(min(len(text.encode()), context))
    return np.array(lengths, dtype=np.int64)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--plan-n", type=int, default=1_000_000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="a small run, printed and not written")
    args = parser.parse_args(argv)
    lengths = docstring_lengths(args.context)
    if args.smoke:
        lengths = lengths[:2000]
    splits = [(8, 8, 1), (16, 4, 1), (8, 32, 1), (8, 128, 1), (8, 4, 2), (4, 4, 4), (8, 16, 8)]
    plans = [(64, 1), (64, 8), (1024, 8)]
    n = 20_000 if args.smoke else args.plan_n
    result = {
        "python": platform.python_version(),
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
    text = json.dumps(result, indent=1)
    if args.smoke:
        print(text)
    else:
        (HERE / "token_batches.json").write_text(text + "\n")
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
