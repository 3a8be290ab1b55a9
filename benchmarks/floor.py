"""The floor of the price of exactness: what any exact package must add to plain Lightning, measured inside it.

``python benchmarks/floor.py`` runs plain Lightning (``strategy="auto"``) on the small GPT of ``run.py``, with only the
work an exact accumulation cannot leave out added to it, in the module's own hooks, and no package code at all:

- per micro-batch, the weighting ``loss · (w / c)`` (two tensor operations beside Lightning's ``loss / A``; formed,
  not back-propagated, so the backward is Lightning's), except at ``A = 1``, where the package back-propagates the
  loss as it is (``c = w``);
- per update, after the last backward: the NaN/Inf check of every gradient in GradScaler's fused kernel (the cheapest
  check measured, see ``docs/internals.md``) and one host read of the group's losses, the check's flag and the token
  counts, stacked (the skip decision cannot be taken without that read; the ledger and the loss logged need the rest);
- two callbacks that implement no hook (``AxisLogger`` and ``AccumulationReport`` act once per group through the
  engine, but Lightning dispatches every hook of every callback, overridden or not).

The work is timed directly (thread time around it); the dispatch of the two callbacks by ``PackageTimer``'s copy of
Lightning's dispatch loop. Each is related to the rest of the same update, as ``run.py``'s attributed measure relates
the package's time (``accum_timed``), so the two compare: a package's share can approach this floor, not go below it.
Results go to ``--out/floor.json`` and the standard output; ``benchmarks/RESULTS.md`` quotes them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]


def floor_trial(a: int, updates: int, warmup: int = 2) -> dict[str, Any]:
    """One fit of plain Lightning with the floor's work at ``A = a``: the median fractions of an update."""
    import lightning as L
    import run
    import torch
    from probes import PackageTimer
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    model, data, m = run.make_workload("gpt", a * updates)
    work_ns: list[tuple[str, int]] = []  # the floor's work by part, per micro-batch and per update, in thread time
    held: list[tuple[Any, Any]] = []  # the open group's (loss, tokens), detached

    class Floor(type(model)):  # type: ignore[misc]
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            output = super().training_step(batch, batch_idx)
            start = time.thread_time_ns()
            loss, tokens = output["loss"], output["num_tokens"]
            # The weighting, in the loss's dtype; none at A = 1 (the group's only micro-batch: c = w, the loss as is).
            weighted = loss * (tokens / c) if a > 1 else None
            held.append((loss.detach(), tokens))
            work_ns.append(("weighting", time.thread_time_ns() - start))
            del weighted  # after the clock: freeing its node is not part of the work
            return output

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            start = time.thread_time_ns()
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            flag = torch.zeros(())
            torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, one)
            checked = time.thread_time_ns()
            losses, tokens = [h[0] for h in held], [h[1].float() for h in held]
            torch.stack([*losses, flag, *tokens]).tolist()  # the one host read of an update
            held.clear()
            work_ns.extend([("check", checked - start), ("read", time.thread_time_ns() - checked)])

    # A constant c = A · M (M: a micro-batch's label positions, m rows of 96), and the check's factor 1.
    c, one = torch.tensor(float(a * m * 96)), torch.ones(())
    model.__class__ = Floor

    class Quiet(L.Callback):
        """A callback that implements no hook: what the package's two are on a micro-batch, to Lightning."""

    class QuietToo(Quiet):
        """The second of the two."""

    timer = PackageTimer([], [], dispatch_of=(Quiet, QuietToo))
    stamps: list[float] = []
    marks: list[tuple[int, int]] = []  # (the dispatch's time so far, the count of timed work so far)

    def clock() -> float:
        marks.append((timer.package_ns, len(work_ns)))
        return time.thread_time()

    callbacks = [run.update_timer(stamps, clock), Quiet(), QuietToo()]
    with tempfile.TemporaryDirectory() as logs:
        logger = L.pytorch.loggers.TensorBoardLogger(logs, name="floor")
        trainer = run._bench_trainer("auto", 1, a, updates, logger, callbacks)
        with run._quiet_stdout(), timer:
            trainer.fit(model, DataLoader(data, batch_size=m))
    work, dispatch, rest = [], [], []
    parts: dict[str, list[float]] = {"weighting": [], "check": [], "read": []}
    for (d0, w0), (d1, w1), t0, t1 in zip(
        marks[warmup:], marks[warmup + 1 :], stamps[warmup:], stamps[warmup + 1 :], strict=False
    ):
        w, d = sum(ns for _, ns in work_ns[w0:w1]) / 1e9, (d1 - d0) / 1e9
        work.append(w)
        dispatch.append(d)
        rest.append(t1 - t0 - w - d)
        for part, seconds in parts.items():
            seconds.append(sum(ns for kind, ns in work_ns[w0:w1] if kind == part) / 1e9 / rest[-1])
    return {
        **{f"{part}_fraction": statistics.median(fractions) for part, fractions in parts.items()},
        "A": a,
        "updates": len(rest),
        "seconds_per_update": statistics.median(w + d + r for w, d, r in zip(work, dispatch, rest, strict=True)),
        "work_fraction": statistics.median(w / r for w, r in zip(work, rest, strict=True)),
        "dispatch_fraction": statistics.median(d / r for d, r in zip(dispatch, rest, strict=True)),
        "floor_fraction": statistics.median((w + d) / r for w, d, r in zip(work, dispatch, rest, strict=True)),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accumulate", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--updates", type=int, default=150, help="updates per fit at A = 1 (8 / A times fewer above)")
    parser.add_argument("--out", default=str(HERE))
    parser.add_argument("--smoke", action="store_true", help="seconds: A = 1 and 2, 6 updates, once (a test)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.accumulate, args.reps, args.updates = [1, 2], 1, 6
    trials = []
    for rep, a in itertools.product(range(args.reps), args.accumulate):
        result = floor_trial(a, max(args.updates // a, 6))
        trials.append({**result, "rep": rep})
        print(
            f"rep {rep} A={a:<2} floor {result['floor_fraction'] * 100:.2f} % of the rest of the update"
            f" (the work {result['work_fraction'] * 100:.2f} %: weighting {result['weighting_fraction'] * 100:.2f},"
            f" check {result['check_fraction'] * 100:.2f}, read {result['read_fraction'] * 100:.2f}; two callbacks'"
            f" dispatch {result['dispatch_fraction'] * 100:.2f} %; update {result['seconds_per_update'] * 1e3:.2f} ms)",
            flush=True,
        )
    for a in args.accumulate:
        mine = [t for t in trials if t["A"] == a]
        medians = {k: statistics.median(t[k] for t in mine) for k in ("floor_fraction", "work_fraction")}
        print(f"A={a}: median over {len(mine)} fits: floor {medians['floor_fraction'] * 100:.2f} %")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "floor.json").write_text(json.dumps({"trials": trials}, indent=1) + "\n")


if __name__ == "__main__":
    main()
