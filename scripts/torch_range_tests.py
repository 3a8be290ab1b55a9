"""The tests scripts/check-torch-range.sh runs on the torch floor and the newest torch: one per line, for pytest.

    python scripts/torch_range_tests.py           # the pytest arguments, one a line
    python scripts/torch_range_tests.py --floor   # the torch floor pyproject.toml declares (`torch>=X`)

The subset is named here, not chosen by hand each time: the whole files of what a torch release can change under the
package (DDP, FSDP2, tensor parallelism, Fabric, mixed precision and GradScaler skips, checkpoints, evaluation, the
engine's kernels, the process group's end), and every test docs/internals.md names as the guard of a private torch or
Lightning name (its "Private names the package relies on" table, read at run time, so a guard added there is run
here without an edit). A guard inside a file already listed is not repeated.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Whole files: the engines, the doors and the kernels a torch release can change under the package.
FILES = (
    "tests/project/test_private_names.py",  # every private torch / Lightning name, present and behaving as relied on
    "tests/test_engine.py",  # the kernels of the close (GradScaler's fused check, `_foreach_mul_`)
    "tests/test_group.py",  # a group's float64 vector, counts in exact parts
    "tests/test_carry.py",  # a group carried across a checkpoint, closed by the engine
    "tests/core/test_closing.py",  # GradScaler skips, bf16 / fp16
    "tests/strategies/test_ddp.py",  # DDP (spawn launcher, the ledger brought back)
    "tests/test_worker_exit.py",  # the process group closed before a worker exits
    "tests/strategies/test_model_parallel.py",  # FSDP2 and tensor parallelism, the Trainer's door
    "tests/core/test_mesh_clipping.py",  # tensor parallelism on a Hugging Face Llama
    "tests/test_fabric.py",  # Fabric: one device, DDP
    "tests/test_fabric_model_parallel.py",  # Fabric: FSDP2, dp × tp, mid-group save and load
    "tests/strategies/test_checkpoint.py",  # checkpoints: DDP, a dead peer, float64
    "tests/core/test_checkpoint.py",  # the open group carried across a checkpoint
    "tests/core/test_entry.py",  # the entry as torch.load reads it back, every damage named
    "tests/core/test_reading.py",  # files and sharded folders torch cannot read
    "tests/strategies/test_checkpoint_across_engines.py",  # a checkpoint resumed under every engine
    "tests/core/test_adapter.py",  # a failed collective, recognised by where torch raises it
    "tests/strategies/test_evaluation.py",  # exact evaluation over replicas
    "tests/callbacks/test_report.py",  # memory and the run record
)


def internals_guards(text: str) -> list[str]:
    """The test ids in the "guarded by" column of docs/internals.md's private-names table (`tests/x.py::name`,
    a following `::other` meaning the same file)."""
    section = text.split("## Private names the package relies on", 1)[1].split("\n## ", 1)[0]
    guards: list[str] = []
    for line in section.splitlines():
        cells = line.split(" | ")
        if not line.startswith("| ") or len(cells) < 4:
            continue
        current = ""
        for path, name in re.findall(r"`(tests/[\w/]+\.py)?(?:::(\w+))?[^`]*`", cells[-1]):
            current = path or current
            if current:
                guards.append(f"{current}::{name}" if name else current)
    return guards


def subset() -> list[str]:
    guards = internals_guards((ROOT / "docs" / "internals.md").read_text(encoding="utf-8"))
    extra = [g for g in dict.fromkeys(guards) if g.split("::")[0] not in FILES]
    return [*FILES, *extra]


def floor() -> str:
    """The version in pyproject.toml's `torch>=X` requirement."""
    found = re.search(r'"torch>=([\d.]+)[",]', (ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    if found is None:
        raise SystemExit("pyproject.toml declares no `torch>=X` floor")
    return found.group(1)


if __name__ == "__main__":
    print(floor() if sys.argv[1:] == ["--floor"] else "\n".join(subset()))
