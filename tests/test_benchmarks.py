"""The benchmark runs (a smoke run in seconds; the real one is `bash benchmarks/run.sh`, not part of the tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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
    assert variants == {("mlp", a, v) for a in (1, 8) for v in ("lightning", "accum", "loop")}
    assert all(t["seconds_per_update"] > 0 for t in results["trials"])
    probe = results["probes"][0]
    assert probe["host_reads_per_nonfinal_microbatch"] == 0 and probe["host_reads_per_update"] == 1
    assert probe["graph_alive_after_backward"] == 0 and probe["graph_checked"] > 0
    text = (tmp_path / "RESULTS.md").read_text()
    assert "| mlp | 8 |" in text and (tmp_path / "ratios.png").read_bytes()[:4] == b"\x89PNG"
