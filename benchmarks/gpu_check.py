"""Checks that need a CUDA device (run where one is lent; CPU runs of the same code are the test suite's job).

1. Exactness on the GPU: one device, token-weighted accumulation at (m, A) = (2, 4), (4, 2), (1, 8) against a float64
   reference gradient computed on the CPU (relative error of the parameters after several SGD updates).
2. No host synchronisation on non-final micro-batches: the package's per-micro-batch path runs under
   ``torch.cuda.set_sync_debug_mode("error")`` (a synchronising CUDA call raises there).
3. fp16 with CUDA's GradScaler ("16-mixed"): overflow skips of the package vs plain Lightning on groups alternating
   between 1 supervised token and 4 × 32 tokens (issue: magnitudes independent of the previous group).
4. Throughput: a token model (embedding 1024, vocabulary 8192, sequences 256) at A = 8: plain Lightning,
   ``strategy="accum"``, and with AxisLogger; median seconds per update (wall clock, the device synchronised at each
   update) and the median ratio over alternating trials.

    python benchmarks/gpu_check.py --out DIR      # writes DIR/gpu_check.json and prints it
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
warnings.filterwarnings("ignore")

from helpers import IGNORE, VOCAB, ListDataset, TinyLM, params_vector, relative_error, sgd_reference  # noqa: E402
from lightning.pytorch.plugins import MixedPrecision  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import lightning_accum  # noqa: E402


def examples(lengths: list[int], seq: int, seed: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, VOCAB, (seq,), generator=gen)
        labels = torch.randint(0, VOCAB, (seq,), generator=gen)
        labels[n:] = IGNORE
        out.append({"input_ids": ids, "labels": labels})
    return out


def trainer(strategy: Any, accumulate: int, **kwargs: Any) -> L.Trainer:
    return L.Trainer(
        strategy=strategy,
        accelerator="gpu",
        devices=1,
        accumulate_grad_batches=accumulate,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def exactness() -> dict[str, float]:
    gen = torch.Generator().manual_seed(1)
    data = examples(torch.randint(0, 33, (32,), generator=gen).tolist(), seq=32, seed=1)
    reference = sgd_reference(TinyLM(lr=0.5), [data[i : i + 8] for i in range(0, 32, 8)], lr=0.5)
    errors = {}
    for m, a in ((2, 4), (4, 2), (1, 8)):
        model = TinyLM(lr=0.5)
        trainer("accum", a).fit(model, DataLoader(ListDataset(data), batch_size=m))
        errors[f"m={m},A={a}"] = relative_error(params_vector(model.cpu()), reference)
    return errors


class _SyncDebug(L.Callback):
    """Sync debug mode "error" from the start of each non-final micro-batch to its end (the package's whole path
    for that micro-batch: training_step, weighting, backward)."""

    def __init__(self) -> None:
        self.checked = 0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            torch.cuda.set_sync_debug_mode("error")
            self.checked += 1

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        torch.cuda.set_sync_debug_mode("default")


class _NoSyncLM(TinyLM):
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        loss = self.mean_loss(batch)  # no host copy of the ids (the helper's record would sync)
        return {"loss": loss, "num_tokens": (batch["labels"] != IGNORE).sum()}


class _SyncingLM(_NoSyncLM):
    """The control: a training step that reads its loss on the host (what the probe must catch)."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        self.last = out["loss"].item()
        return out


def host_syncs() -> dict[str, Any]:
    data = examples([5, 17, 32, 1] * 8, seq=32, seed=2)
    result: dict[str, Any] = {}
    for name, module in (("package", _NoSyncLM), ("control with .item()", _SyncingLM)):
        probe = _SyncDebug()
        try:
            trainer("accum", 4, callbacks=[probe]).fit(module(lr=0.5), DataLoader(ListDataset(data), batch_size=2))
            outcome = "no synchronising call"
        except RuntimeError as err:  # the sync debug mode raises on a synchronising call
            outcome = f"synchronised: {str(err)[:120]}"
        finally:
            torch.cuda.set_sync_debug_mode("default")
        result[name] = {"non_final_microbatches_checked": probe.checked, "result": outcome}
    return result


class _Scales(L.Callback):
    def __init__(self) -> None:
        self.scales: list[float] = []

    def on_before_zero_grad(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        self.scales.append(trainer.precision_plugin.scaler.get_scale())  # type: ignore[attr-defined]


def fp16_skips() -> dict[str, int]:
    lengths = [n for g in range(16) for n in ([1, 0, 0, 0] if g % 2 == 0 else [32] * 4)]
    data = examples(lengths, seq=32, seed=0)
    skips = {}
    for strategy in ("auto", "accum"):
        scales = _Scales()
        plugin = MixedPrecision("16-mixed", "cuda", scaler=torch.amp.GradScaler("cuda"))
        trainer(strategy, 2, plugins=[plugin], callbacks=[scales]).fit(
            TinyLM(lr=0.1), DataLoader(ListDataset(data), batch_size=2)
        )
        skips[strategy] = sum(1 for a, b in zip(scales.scales, scales.scales[1:], strict=False) if b < a)
    return skips


class _Clock(L.Callback):
    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_before_zero_grad(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())


class _WideLM(TinyLM):
    """A wider token model so that an update is real GPU work (embedding 1024, vocabulary 8192, sequences 256)."""

    def __init__(self) -> None:
        super().__init__(lr=1e-3, optimizer="adamw")
        self.embed = torch.nn.Embedding(8192, 1024)
        self.head = torch.nn.Linear(1024, 8192)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        return {"loss": self.mean_loss(batch), "num_tokens": (batch["labels"] != IGNORE).sum()}


def throughput(reps: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(4)
    n = 8 * 8 * 12
    ids = torch.randint(0, 8192, (n, 256), generator=gen)
    labels = torch.randint(0, 8192, (n, 256), generator=gen)
    lengths = torch.randint(1, 257, (n,), generator=gen)
    labels[torch.arange(256)[None, :] >= lengths[:, None]] = IGNORE
    data = [{"input_ids": ids[i], "labels": labels[i]} for i in range(n)]
    per_update: dict[str, list[float]] = {"lightning": [], "accum": [], "accum_axis_logger": []}
    for _ in range(reps):
        for name, strategy, callbacks in (
            ("lightning", "auto", []),
            ("accum", "accum", []),
            ("accum_axis_logger", "accum", [lightning_accum.AxisLogger(axis="tokens")]),
        ):
            clock = _Clock()
            torch.manual_seed(0)
            trainer(strategy, 8, callbacks=[clock, *callbacks]).fit(
                _WideLM(), DataLoader(ListDataset(data), batch_size=8)
            )
            intervals = [b - a for a, b in zip(clock.stamps[2:], clock.stamps[3:], strict=False)]
            per_update[name].append(statistics.median(intervals))
    base = per_update["lightning"]
    return {
        "seconds_per_update": {k: statistics.median(v) for k, v in per_update.items()},
        "over_lightning": {
            k: statistics.median(b / a for a, b in zip(base, v, strict=True)) for k, v in per_update.items()
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "lightning": L.__version__,
    }
    for name, check in (("exactness_rel_error", exactness), ("host_syncs", host_syncs), ("fp16_skips", fp16_skips)):
        try:
            result[name] = check()
        except Exception as err:  # reported, the other checks still run
            result[name] = f"failed: {type(err).__name__}: {err}"
        print(name, result[name], flush=True)
    try:
        result["throughput_A8"] = throughput(args.reps)
    except Exception as err:
        result["throughput_A8"] = f"failed: {type(err).__name__}: {err}"
    print("throughput_A8", result["throughput_A8"], flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_check.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
