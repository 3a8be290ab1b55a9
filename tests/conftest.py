"""Test set-up: the benchmarks' instrumentation (``benchmarks/probes.py``, not part of the package) is importable."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
