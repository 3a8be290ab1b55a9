"""Recipe: ramp the global batch by tokens, beside a fixed batch, each exact under two splits, on one tokens axis.

Large-model pretraining starts with a small global batch and grows it as the loss falls (Megatron-LM's
``--step-batch-size-schedule "0:768 250B:1536 500B:3072"``, nanochat's 1/4 → 1/2 → full batch with square-root
learning-rate scaling). This recipe trains a tiny next-token model on synthetic sequences of varying length (padding
is not supervised, so every micro-batch holds a different number of tokens) twice:

- **ramp**: ``BatchSchedule(--schedule, axis="tokens", lr_scaling="sqrt")``, by default ``"0:8 500:16 1.5K:32"``:
  8 sequences per update, 16 from 500 supervised tokens seen, 32 from 1,500 (Megatron's form; K, M, B suffixes).
  The learning rate of stage ``i`` is ``--lr × sqrt(B_i / B_last)``: the last stage's batch trains at ``--lr``;
- **fixed**: the last stage's batch from the start, as a one-stage schedule ``{0: B_last}`` at ``--lr`` (the same
  groups as ``accumulate_grad_batches = B_last / m``, and ``AxisLogger`` writes its global batch too).

Each run trains under two splits of the same examples, ``m = 4`` and ``m = 2`` sequences per micro-batch on one
device (the schedule sets ``A = B / m`` at each group's start: A = 2, 4, 8 and 4, 8, 16 for the default ramp). The
strategy's ``global_order=True`` reads one seeded, shuffled order of the data under both, so every update holds the
same sequences. The runs train in float64 (``precision="64-true"``) so that the splits can be compared to rounding:
a group's token-weighted gradient is summed in another order under each split. In float32 that rounding, carried on
by AdamW, leaves the splits up to about 1e-5 apart after these runs, too close to a small real error to tell them
apart; in float64 they end within ``--tolerance`` (1e-10) of each other (1.1e-15 and 4.5e-14 with the defaults).

Written under ``--out``: TensorBoard logs on the tokens axis (``AxisLogger(axis="tokens")``: ``accum/loss``,
``accum/global_batch``, the stage's samples per update, and ``accum/batch_stage``) in ``ramp/m4``, ``ramp/m2``,
``fixed/m4``, ``fixed/m2``; ``summary.json``; and, with matplotlib (``pip install ".[demo]"``),
``loss_vs_tokens.png``. The table printed at the end gives per run the stages reached (``strategy.batch_stages``),
tokens, updates, the held-out loss and the largest parameter difference between the splits; the recipe exits with
status 1 if the splits of a run differ by more than the tolerance. CPU, seconds::

    python examples/batch_ramp.py --out runs/batch_ramp
    tensorboard --logdir runs/batch_ramp
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the recipes' shared model and data

from _data import IGNORE_INDEX, CountingSequences, TinyLM

from lightning_accum import AccumulationStrategy, AxisLogger, BatchSchedule

RUNS = ("ramp", "fixed")
SPLITS = (4, 2)  # m, sequences per micro-batch; D = 1, and the schedule sets A = B / m
PICTURE = "loss_vs_tokens.png"
SUMMARY = "summary.json"


def schedules(text: str) -> dict[str, BatchSchedule]:
    """The ramp of ``--schedule`` and the fixed run's one stage (the ramp's last batch)."""
    ramp = BatchSchedule(text, axis="tokens", lr_scaling="sqrt")
    if len(ramp.stages) < 2:
        raise SystemExit(f"--schedule {text!r} has one stage: a ramp needs two or more, e.g. '0:8 500:16 1.5K:32'.")
    return {"ramp": ramp, "fixed": BatchSchedule({0: ramp.stages[-1].samples}, axis="tokens")}


def train(run: str, schedule: BatchSchedule, m: int, args: argparse.Namespace) -> dict[str, Any]:
    """One fit of ``run`` at ``m`` sequences per micro-batch; its record, and its parameters in float64."""
    last = schedule.stages[-1].samples
    # The last stage's batch trains at --lr; sqrt scaling multiplies stage i's rate by sqrt(B_i / B_0).
    lr = args.lr * math.sqrt(schedule.stages[0].samples / last) if schedule.lr_scaling == "sqrt" else args.lr
    L.seed_everything(args.seed, verbose=False)  # the same initial weights, and the seed of the data's order
    model = TinyLM(lr=lr)
    trainer = L.Trainer(
        strategy=AccumulationStrategy(batch_schedule=schedule, global_order=True),
        accelerator="cpu",
        precision="64-true",
        max_epochs=args.epochs,
        logger=TensorBoardLogger(args.out, name=run, version=f"m{m}", default_hp_metric=False),
        callbacks=[AxisLogger(axis="tokens")],
        log_every_n_steps=1,  # a point per update
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = CountingSequences(args.examples, seed=args.seed)
    trainer.fit(model, DataLoader(data, batch_size=m, shuffle=True))  # global_order=True replaces the shuffle
    ledger, stages = trainer.strategy.ledger, trainer.strategy.batch_stages
    held_out = evaluate(model, CountingSequences(64, seed=args.seed + 1))
    sizes = " → ".join(str(s["accumulate_grad_batches"]) for s in stages)
    print(f"  {run}, m = {m}: A = {sizes}; {ledger.updates_applied} updates, {ledger.tokens:,} tokens", flush=True)
    return {
        # A stage's A is the split's own (its batch over m); the rest of its record is the same at every split.
        "stages": [{key: value for key, value in s.items() if key != "accumulate_grad_batches"} for s in stages],
        "tokens": ledger.tokens,
        "updates": ledger.updates_applied,
        "held_out_loss": held_out,
        "parameters": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
    }


@torch.no_grad()
def evaluate(model: TinyLM, data: CountingSequences) -> float:
    """The token-weighted loss over ``data`` (every supervised token counts once)."""
    model.eval()
    logits = model(data.input_ids)
    loss = F.cross_entropy(logits.flatten(0, 1), data.labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return float(loss) / data.supervised_tokens()


def read_scalars(folder: Path, tag: str) -> list[tuple[int, float]]:
    """(tokens, value) of ``tag`` from the TensorBoard event files in ``folder``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    return [(int(e.step), float(e.value)) for e in events.Scalars(tag)]


def plot(out: Path) -> Path | None:
    """Loss and global batch against tokens, ramp beside fixed (both splits; they overlay); ``None`` without
    matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, batch_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run, color in zip(RUNS, ("tab:blue", "tab:orange"), strict=True):
        for m, style in zip(
            SPLITS, ({"linewidth": 4, "alpha": 0.35}, {"linewidth": 1, "linestyle": "--"}), strict=True
        ):
            folder = out / run / f"m{m}"
            label = f"{run}, m = {m}"
            loss_ax.plot(*zip(*read_scalars(folder, "accum/loss"), strict=True), color=color, label=label, **style)
            batch = read_scalars(folder, "accum/global_batch")
            batch_ax.step(*zip(*batch, strict=True), where="pre", color=color, label=label, **style)
    loss_ax.set(title="token-weighted loss of each update", xlabel="supervised tokens seen", ylabel="loss (nats/token)")
    batch_ax.set(title="global batch (accum/global_batch)", xlabel="supervised tokens seen", ylabel="samples/update")
    for ax in (loss_ax, batch_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / PICTURE
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def stages_text(stages: Sequence[dict[str, int]]) -> str:
    """``8 (9 updates) → 16 (8) → 32 (11)``: each stage reached, its samples per update and its updates."""
    parts = [f"{s['samples_per_update']} ({s['updates']}{' updates' if i == 0 else ''})" for i, s in enumerate(stages)]
    return " → ".join(parts)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/batch_ramp", help="folder for the logs, summary and picture")
    parser.add_argument("--schedule", default="0:8 500:16 1.5K:32", help="the ramp, 'tokens:batch ...'")
    parser.add_argument("--examples", type=int, default=256, help="training sequences (one epoch)")
    parser.add_argument("--epochs", type=int, default=2, help="epochs of every run")
    parser.add_argument("--lr", type=float, default=0.03, help="AdamW's rate at the last stage's batch")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data, its order and the model")
    parser.add_argument("--tolerance", type=float, default=1e-10, help="largest parameter difference between splits")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    # A deprecation inside Lightning 2.6's own loaders (torch 2.13's pytree), not the recipe's: kept out of its output.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*", category=FutureWarning)
    out = Path(args.out)
    for run in RUNS:  # earlier event files in the same folders would add their points to these runs'
        shutil.rmtree(out / run, ignore_errors=True)
    summary: dict[str, Any] = {"tolerance": args.tolerance, "runs": {}}
    for run, schedule in schedules(args.schedule).items():
        print(f"{run}: {schedule!r}", flush=True)
        fits = {m: train(run, schedule, m, args) for m in SPLITS}
        first, second = (fits[m] for m in SPLITS)
        for key in ("stages", "tokens", "updates"):
            if first[key] != second[key]:
                raise SystemExit(f"{run}: the splits m = {SPLITS} reached other {key}: {first[key]} != {second[key]}")
        summary["runs"][run] = {
            "schedule": repr(schedule),
            "stages": first["stages"],
            "tokens": first["tokens"],
            "updates": first["updates"],
            "held_out_loss": {f"m{m}": fit["held_out_loss"] for m, fit in fits.items()},
            "max_parameter_difference": float((first["parameters"] - second["parameters"]).abs().max()),
        }
    out.mkdir(parents=True, exist_ok=True)
    (out / SUMMARY).write_text(json.dumps(summary, indent=1))

    print(f"\nfloat64; splits (m, D) = {SPLITS[0]}, 1 and {SPLITS[1]}, 1 in one order (global_order=True)")
    print(f"{'run':<6} {'batch per update (updates)':<34} {'tokens':>7} {'updates':>7} {'held-out loss':>13} "
          f"{'max |Δparam| between splits':>28}")  # fmt: skip
    for run, record in summary["runs"].items():
        loss = record["held_out_loss"][f"m{SPLITS[0]}"]
        difference = record["max_parameter_difference"]
        print(f"{run:<6} {stages_text(record['stages']):<34} {record['tokens']:>7,} {record['updates']:>7} "
              f"{loss:>13.6f} {difference:>28.1e}")  # fmt: skip
    picture = plot(out)
    print(f"\nlogs: tensorboard --logdir {out.resolve()}  (x: supervised tokens)")
    print(f"summary: {(out / SUMMARY).resolve()}")
    print(f"picture: {picture.resolve()}" if picture else "picture: not drawn (pip install matplotlib)")
    worst = max(record["max_parameter_difference"] for record in summary["runs"].values())
    if worst > args.tolerance:
        print(f"the splits differ by {worst:.1e} > --tolerance {args.tolerance:.0e}", file=sys.stderr)
        raise SystemExit(1)
    print(f"both runs: the two splits agree within {args.tolerance:.0e}")
    return summary


if __name__ == "__main__":
    main()
