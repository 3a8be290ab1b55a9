"""Stress loop for crashes at the end of 2-process spawn runs (issue 23).

Runs many short 2-process CPU fits over gloo (a tiny token model, a few updates) with
``strategy="accum_ddp_spawn"`` (the package) and ``strategy="ddp_spawn"`` (plain Lightning), interleaved,
and counts the runs whose child process died: ``ProcessExitedException`` (e.g. ``process 1 terminated with
signal SIGABRT``), ``terminate called without an active exception`` on the children's stderr, a hang, or
any other failure. Writes ``summary.json`` and ``summary.md`` (counts per variant) into ``--out``, keeps
the log of every failed run, and with ``--core-dumps`` a ``gdb`` backtrace of every thread of each
crashed child.

Usage (from the repository root; be kind to a shared machine)::

    nice -n 19 python benchmarks/spawn_stress.py --runs 50 --out runs/spawn-stress
    nice -n 19 python benchmarks/spawn_stress.py --runs 20 --variants accum_ddp_spawn --load 2 \\
        --faulthandler --core-dumps --out runs/spawn-stress-cores

Options:

- ``--runs N``: fits per variant (each fit spawns two fresh worker processes);
- ``--variants``: any of ``accum_ddp_spawn`` (the package), ``ddp_spawn`` (Lightning) and
  ``accum_ddp_spawn_no_close`` (the package without its close of the process group at the end of each worker,
  i.e. the package as it was before the workaround, kept to show the difference);
- ``--batch K``: fits per driver process (the driver imports torch once for K fits; the workers are
  fresh processes for every fit either way);
- ``--load K``: K busy-looping processes (at the lowest priority) for the duration, to starve threads;
- ``--faulthandler``: ``PYTHONFAULTHANDLER=1`` in the workers (Python stacks on SIGABRT/SIGSEGV; a C++
  ``std::terminate`` from a thread without Python frames shows as ``<no Python frame>``);
- ``--core-dumps``: unlimited core size for the workers, each fit in its own directory, and
  ``gdb -batch -ex "thread apply all bt"`` on every core found (cores are deleted after, unless
  ``--keep-cores``). Needs ``kernel.core_pattern`` to write a file into the working directory.

The core of the loop is :func:`stress`, which the slow test in ``benchmarks/test_benchmarks.py`` runs with a
small N.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # this checkout's package, also when run as a script

from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher  # noqa: E402

import lightning_accum  # noqa: E402, F401  (registers the strategy strings)
from lightning_accum.strategies import DDPAccumulationStrategy  # noqa: E402
from lightning_accum.strategies.ddp import _LedgerReturningLauncher  # noqa: E402

VARIANTS = ("accum_ddp_spawn", "ddp_spawn", "accum_ddp_spawn_no_close")
TERMINATE = "terminate called without an active exception"
MARK = "[spawn_stress] run "

# ---------------------------------------------------------------------------- one fit (driver side)


class TinyLM(L.LightningModule):
    """Embedding -> linear head; mean cross-entropy over the supervised tokens, with their count."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.head = nn.Linear(8, 11)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        ids, labels = batch
        loss = F.cross_entropy(
            self.head(torch.tanh(self.embed(ids))).flatten(0, 1), labels.flatten(), ignore_index=-100
        )
        return {"loss": loss, "num_tokens": (labels != -100).sum()}

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class _LauncherWithoutClose(_LedgerReturningLauncher):
    """The package's launcher without its end-of-worker close of the process group (the package before issue 23)."""

    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        _MultiProcessingLauncher._wrapping_function(self, *args, **kwargs)


class _StrategyWithoutClose(DDPAccumulationStrategy):
    """``accum_ddp_spawn`` with :class:`_LauncherWithoutClose`."""

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        self._launcher = _LauncherWithoutClose(self, start_method="spawn")


def _fit_once(variant: str, seed: int, updates: int, accumulate: int) -> None:
    """One ``Trainer.fit`` of a tiny token model on 2 spawned CPU processes over gloo."""
    torch.manual_seed(seed)
    batch_size, devices = 2, 2
    n = updates * accumulate * batch_size * devices
    ids = torch.randint(0, 11, (n, 6))
    labels = torch.randint(0, 11, (n, 6))
    labels[:, 4:] = -100
    strategy: Any = _StrategyWithoutClose(start_method="spawn") if variant == "accum_ddp_spawn_no_close" else variant
    os.environ.pop("MASTER_PORT", None)  # a fresh free port for every fit
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_epochs=1,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(TinyLM(), DataLoader(TensorDataset(ids, labels), batch_size=batch_size))


def _describe(exc: BaseException) -> dict[str, Any]:
    return {
        "exception": type(exc).__name__,
        "message": str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else "",
        "signal": getattr(exc, "signal_name", None),
        "exit_code": getattr(exc, "exit_code", None),
    }


def _driver(args: argparse.Namespace) -> int:
    """Runs ``--batch`` fits of one variant, one JSON line per fit on stdout; workers' stderr is ours."""
    if args.core_dumps:
        resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    for index in args.indices:
        run_dir = Path(args.work) / f"{args.variant}-{index:04d}"
        run_dir.mkdir(parents=True, exist_ok=True)
        os.chdir(run_dir)  # a crashed worker's core lands here (core_pattern "core")
        print(f"{MARK}{index} begin", file=sys.stderr, flush=True)
        start = time.monotonic()
        record: dict[str, Any] = {"variant": args.variant, "index": index, "outcome": "ok"}
        try:
            _fit_once(args.variant, index, args.updates, args.accumulate)
        except Exception as exc:  # every failure is counted, none stops the loop
            record.update(outcome="crash", **_describe(exc))
        record["seconds"] = round(time.monotonic() - start, 2)
        print(f"{MARK}{index} end", file=sys.stderr, flush=True)
        print(json.dumps(record), flush=True)
    return 0


# ---------------------------------------------------------------------------- orchestration


@contextlib.contextmanager
def cpu_load(processes: int) -> Iterator[None]:
    """``processes`` busy loops at the lowest priority while the block runs."""
    code = "import os\nos.nice(19)\nx = 0\nwhile True:\n    x = (x * 7 + 1) % 1000003\n"
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(processes)]
    try:
        yield
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait()


def _segments(stderr: str) -> dict[int, str]:
    """The workers' stderr of each fit, cut at the driver's markers."""
    parts: dict[int, list[str]] = {}
    current: int | None = None
    for line in stderr.splitlines():
        if line.startswith(MARK):
            index_text, what = line[len(MARK) :].split()
            current = int(index_text) if what == "begin" else None
            continue
        if current is not None:
            parts.setdefault(current, []).append(line)
    return {index: "\n".join(lines) for index, lines in parts.items()}


def _backtraces(run_dir: Path, keep_cores: bool) -> str:
    texts = []
    for core in sorted(run_dir.glob("core*")):
        if shutil.which("gdb") is None:
            texts.append(f"{core.name}: gdb not found")
            continue
        result = subprocess.run(
            ["gdb", "-batch", "-nx", "-ex", "thread apply all bt", sys.executable, str(core)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        texts.append(f"===== {core.name}\n{result.stdout}\n{result.stderr}")
        if not keep_cores:
            core.unlink()
    return "\n".join(texts)


def run_batch(
    variant: str,
    indices: Sequence[int],
    out: Path,
    *,
    updates: int = 4,
    accumulate: int = 2,
    faulthandler: bool = False,
    core_dumps: bool = False,
    keep_cores: bool = False,
    timeout: float = 600.0,
) -> list[dict[str, Any]]:
    """Runs the fits ``indices`` of ``variant`` in one driver process; one record per fit."""
    work = out / "work"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    if faulthandler:
        env["PYTHONFAULTHANDLER"] = "1"
    command = [sys.executable, str(Path(__file__).resolve()), "_driver", "--variant", variant, "--work", str(work)]
    command += ["--updates", str(updates), "--accumulate", str(accumulate), "--indices", *map(str, indices)]
    if core_dumps:
        command.append("--core-dumps")
    try:
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
        stdout, stderr, hung = result.stdout, result.stderr, False
    except subprocess.TimeoutExpired as exc:  # the driver's children are killed with it (PDEATHSIG)
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
        hung = True
    records = {r["index"]: r for r in (json.loads(line) for line in stdout.splitlines() if line.startswith("{"))}
    segments = _segments(stderr)
    out_records = []
    for index in indices:
        record = records.get(index) or {"variant": variant, "index": index, "outcome": "hang" if hung else "lost"}
        text = segments.get(index, "")
        record["terminate_message"] = TERMINATE in text
        if record["terminate_message"] and record["outcome"] == "ok":
            record["outcome"] = "crash"
        run_dir = work / f"{variant}-{index:04d}"
        if record["outcome"] != "ok":
            logs = out / "failures"
            logs.mkdir(parents=True, exist_ok=True)
            name = f"{variant}-{index:04d}"
            (logs / f"{name}.log").write_text(text or stderr)
            if core_dumps and run_dir.exists():
                traces = _backtraces(run_dir, keep_cores)
                if traces:
                    (logs / f"{name}.gdb.txt").write_text(traces)
                    record["backtrace"] = str(logs / f"{name}.gdb.txt")
        if run_dir.exists() and not keep_cores:
            shutil.rmtree(run_dir, ignore_errors=True)
        out_records.append(record)
    return out_records


def stress(
    runs: int,
    variants: Sequence[str],
    out: Path,
    *,
    batch: int = 5,
    load: int = 0,
    progress: bool = False,
    **options: Any,
) -> dict[str, Any]:
    """Runs ``runs`` fits per variant, interleaved batch by batch; returns and writes the summary."""
    for variant in variants:
        if variant not in VARIANTS:
            raise ValueError(f"`variants` must be among {VARIANTS}, got {variant!r}.")
    out.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    started = time.time()
    with cpu_load(load):
        for first in range(0, runs, batch):
            indices = list(range(first, min(first + batch, runs)))
            for variant in variants:
                new = run_batch(variant, indices, out, **options)
                records.extend(new)
                with (out / "runs.jsonl").open("a") as log:
                    log.write("".join(json.dumps(r) + "\n" for r in new))
                if progress:
                    bad = [r for r in new if r["outcome"] != "ok"]
                    print(f"{variant} runs {indices[0]}-{indices[-1]}: {len(bad)} failed {bad or ''}", flush=True)
    summary = summarize(records, variants)
    summary["settings"] = {
        "runs_per_variant": runs,
        "batch": batch,
        "load_processes": load,
        "minutes": round((time.time() - started) / 60, 1),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        **{k: v for k, v in options.items() if isinstance(v, (int, float, bool, str))},
    }
    with contextlib.suppress(ImportError):
        import lightning
        import torch

        summary["settings"].update(torch=torch.__version__, lightning=lightning.__version__)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "summary.md").write_text(markdown(summary))
    return summary


def summarize(records: Sequence[dict[str, Any]], variants: Sequence[str]) -> dict[str, Any]:
    counts: dict[str, dict[str, int]] = {}
    for variant in variants:
        mine = [r for r in records if r["variant"] == variant]
        counts[variant] = {
            "runs": len(mine),
            "failed": sum(r["outcome"] != "ok" for r in mine),
            "sigabrt": sum(r.get("signal") == "SIGABRT" for r in mine),
            "terminate_message": sum(bool(r.get("terminate_message")) for r in mine),
            "hang": sum(r["outcome"] == "hang" for r in mine),
        }
    failures = [r for r in records if r["outcome"] != "ok"]
    return {"counts": counts, "failures": failures}


def markdown(summary: dict[str, Any]) -> str:
    lines = [
        '| variant | runs | failed | SIGABRT | "terminate called" | hang |',
        "|---|---:|---:|---:|---:|---:|",
    ]
    for variant, c in summary["counts"].items():
        lines.append(
            f"| `{variant}` | {c['runs']} | {c['failed']} | {c['sigabrt']} | {c['terminate_message']} | {c['hang']} |"
        )
    settings = summary.get("settings", {})
    if settings:
        lines += ["", "Settings: " + ", ".join(f"{k}={v}" for k, v in settings.items())]
    for failure in summary["failures"]:
        lines.append(f"- `{failure['variant']}` run {failure['index']}: {failure.get('message') or failure['outcome']}")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_driver"]:
        parser = argparse.ArgumentParser()
        parser.add_argument("--variant", required=True, choices=VARIANTS)
        parser.add_argument("--work", required=True)
        parser.add_argument("--indices", type=int, nargs="+", required=True)
        parser.add_argument("--updates", type=int, default=4)
        parser.add_argument("--accumulate", type=int, default=2)
        parser.add_argument("--core-dumps", action="store_true")
        return _driver(parser.parse_args(argv[1:]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50, help="fits per variant")
    parser.add_argument("--variants", nargs="+", default=["accum_ddp_spawn", "ddp_spawn"], choices=VARIANTS)
    parser.add_argument("--batch", type=int, default=5, help="fits per driver process")
    parser.add_argument("--updates", type=int, default=4, help="optimizer updates per fit")
    parser.add_argument("--accumulate", type=int, default=2, help="accumulate_grad_batches")
    parser.add_argument("--load", type=int, default=0, help="busy-looping processes for the duration")
    parser.add_argument("--faulthandler", action="store_true", help="PYTHONFAULTHANDLER=1 in the workers")
    parser.add_argument("--core-dumps", action="store_true", help="core files and gdb backtraces of crashes")
    parser.add_argument("--keep-cores", action="store_true", help="keep core files and run directories")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per driver before it counts as hung")
    parser.add_argument("--out", type=Path, default=Path("spawn-stress"), help="folder for the summary and logs")
    args = parser.parse_args(argv)
    summary = stress(
        args.runs,
        args.variants,
        args.out,
        batch=args.batch,
        load=args.load,
        progress=True,
        updates=args.updates,
        accumulate=args.accumulate,
        faulthandler=args.faulthandler,
        core_dumps=args.core_dumps,
        keep_cores=args.keep_cores,
        timeout=args.timeout,
    )
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
