"""The package's frames on the hot path: how many calls into ``lightning_accum`` one training micro-batch makes,
between Lightning's ``on_train_batch_start`` and ``on_train_batch_end`` (training_step, backward, the optimizer step and
the close), for a group's non-final micro-batch and for its last. A count of the package's own Python calls, not of
torch's operations: it does not depend on the torch or Lightning release, and it grows only when the package's per
micro-batch work grows. Run: ``python benchmarks/hot_path.py`` (prints JSON); ``tests`` keep the counts bounded.

Figures (one device, automatic optimization, tokens reported, A = 4), in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L

import lightning_accum  # registers the strategy strings

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests")]

from helpers import TinyLM, fit, make_examples, random_lengths  # noqa: E402

PACKAGE = str(ROOT / "lightning_accum")


class PackageCalls(L.Callback):
    """Counts the calls whose code lies in the package, per training micro-batch (its index in the group kept)."""

    def __init__(self, accumulate: int) -> None:
        self.accumulate = accumulate
        self.counts: list[tuple[bool, int]] = []  # (the group's last micro-batch, package calls)
        self._count = 0

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            self._count += 1

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._count = 0
        sys.setprofile(self._profile)

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        sys.setprofile(None)
        self.counts.append(((batch_idx + 1) % trainer.accumulate_grad_batches == 0, self._count))


def measure(accumulate: int = 4, groups: int = 6, scheduled: bool = False) -> dict[str, int]:
    """The median package calls of a non-final and of a last micro-batch, after the first group (set-up);
    ``scheduled``: under a batch schedule of one stage of groups of ``accumulate`` (the cost per micro-batch)."""
    calls = PackageCalls(accumulate)
    examples = make_examples(random_lengths(2 * accumulate * groups))
    strategy: Any = "accum"
    if scheduled:
        strategy = lightning_accum.AccumulationStrategy(
            batch_schedule=lightning_accum.BatchSchedule({0: 2 * accumulate}, axis="samples")
        )
    fit(
        TinyLM(),
        examples,
        batch_size=2,
        accumulate=1 if scheduled else accumulate,
        strategy=strategy,
        callbacks=[calls],
    )
    later = calls.counts[accumulate:]
    return {
        "non_final": int(statistics.median(n for last, n in later if not last)),
        "last": int(statistics.median(n for last, n in later if last)),
    }


if __name__ == "__main__":
    print(json.dumps({"fixed": measure(), "scheduled": measure(scheduled=True)}))
