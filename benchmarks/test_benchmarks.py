"""The benchmark's own tests: its instruments, and a smoke run in seconds (the real run is `bash benchmarks/run.sh`).

They live beside the benchmark (collected by the test command through `testpaths`) so that the package's tests
import nothing from `benchmarks/`; they use the tests' tiny models.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_accum import AccumulationStrategy
from lightning_accum.strategies import ExactAccumulation
from lightning_accum.strategies.closing import GroupClosing

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]

from helpers import TinyLM, fit, make_examples  # noqa: E402
from probes import PackageTimer  # noqa: E402


@pytest.mark.timeout(300)
def test_benchmark_smoke_run_writes_its_results(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    variants = {(t["workload"], t["A"], t["variant"]) for t in results["trials"]}
    assert variants == {("mlp", a, v) for a in (1, 8) for v in ("lightning", "accum", "loop", "accum_timed")}
    assert all(t["seconds_per_update"] > 0 for t in results["trials"])
    timed = [t for t in results["trials"] if t["variant"] == "accum_timed"]
    assert all(0 < t["package_seconds_per_update"] < t["seconds_per_update"] for t in timed)
    assert all(0 < t["package_fraction_net"] < t["package_fraction"] for t in timed)
    assert {tuple(p["variants"]) for p in results["paired"]} == {("lightning", "accum"), ("lightning", "lightning")}
    assert {p["A"] for p in results["paired"]} == {1, 8}  # paired trials at A = 1 and 8
    for paired in results["paired"]:  # 5 updates a side, 2 of them warm-up: 3 intervals each, all positive
        assert [len(side) for side in paired["seconds_per_update"]] == [3, 3]
        assert all(seconds > 0 for side in paired["seconds_per_update"] for seconds in side)
    probe = results["probes"][0]
    assert probe["host_reads_per_nonfinal_microbatch"] == 0 and probe["host_reads_per_update"] == 1
    assert probe["graph_alive_after_backward"] == 0 and probe["graph_checked"] > 0
    text = (tmp_path / "RESULTS.md").read_text()
    assert "Time in the package's own code" in text
    assert "| mlp | 1 | 3 |" in text and "| mlp | 8 | 3 |" in text  # the paired table: 3 pairs at each A
    assert "| mlp | 1 | ≤ 1.06 |" in text and "| mlp | 8 | ≤ 1.04 |" in text  # the targets beside the measurements
    assert "| mlp | 8 |" in text and (tmp_path / "ratios.png").read_bytes()[:4] == b"\x89PNG"


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class _SlowModel(TinyLM):
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        _spin(0.01)  # Lightning's side of the work: the model
        return super().training_step(batch, batch_idx)


class _SlowCallback(L.Callback):
    def on_train_batch_end(self, *args: Any) -> None:
        _spin(0.004)  # the package's side (a callback of the package would be charged like this)


def test_package_timer_calibrates_its_own_cost() -> None:
    timer = PackageTimer([], [])
    with timer:
        for _ in range(50):
            timer.calibrate()
    assert timer.calibrations == 50 and timer.calls == 0 and timer.nested_calls == 0 and timer.package_ns == 0
    bare, pair = timer.bare_ns / 50, timer.pair_ns / 50
    assert 0 < bare < 1e6 and 0 < pair < 1e6  # microseconds, not milliseconds
    assert timer.own_cost_ns(10, 4) == pytest.approx(10 * bare + 4 * max(pair - bare, 0.0))


def test_package_timer_charges_the_package_and_not_the_lightning_work_it_wraps() -> None:
    timer = PackageTimer.for_strategy(AccumulationStrategy, [_SlowCallback])
    start = time.thread_time()
    with timer:
        fit(_SlowModel(), make_examples([4] * 8), batch_size=1, accumulate=4, callbacks=[_SlowCallback()])
    total = time.thread_time() - start
    assert total > 8 * 0.014
    # 8 callback calls of 4 ms are charged; the model's 8 x 10 ms inside the strategy's training_step are not.
    assert 8 * 0.004 <= timer.package_ns / 1e9 < 8 * 0.004 + 8 * 0.005
    assert timer.by_method["_SlowCallback.on_train_batch_end"] >= 8 * 0.004 * 1e9
    assert {"ExactAccumulation.training_step", "ExactAccumulation.optimizer_step"} <= set(timer.by_method)
    # Lightning's dispatch of the callback's hooks is charged to it too: at least the 8 calls inside it.
    dispatch = timer.by_method["_SlowCallback.dispatch"]
    assert 0 < dispatch < 8 * 0.004 * 1e9 and timer.calls >= 8 + 8 + 2  # hooks, training steps, optimizer steps
    # The patches are gone afterwards.
    assert not hasattr(ExactAccumulation.training_step, "__wrapped__")


class _SlowClosing(GroupClosing):
    def gradients_by_kind(self, *args: Any, **kwargs: Any) -> Any:
        _spin(0.05)  # part of the group's close, which runs inside the optimizer's step (below Lightning's)
        return super().gradients_by_kind(*args, **kwargs)


class _SlowClose(AccumulationStrategy):
    def __init__(self) -> None:
        super().__init__()
        self._closing = _SlowClosing()


def test_package_timer_charges_the_group_close_inside_the_optimizer_step() -> None:
    from run import timed_parts

    # 2 updates of 4 micro-batches; each close spins 50 ms of CPU time inside Lightning's optimizer_step.
    charged = []
    for parts in ([], timed_parts()):
        timer = PackageTimer.for_strategy(_SlowClose, [], parts=parts)
        with timer:
            fit(TinyLM(), make_examples([4] * 8), batch_size=1, accumulate=4, strategy=_SlowClose())
        charged.append(timer.package_ns / 1e9)
        assert ("GroupClosing.close" in timer.by_method) == bool(parts)
    assert charged[0] < 2 * 0.05  # without the close among the parts it goes uncounted (the rest is ~1 ms)
    assert charged[1] >= 2 * 0.05  # the benchmark's parts charge it to the package
