"""The final record of a run: what was configured, what was realized, what it cost."""

from __future__ import annotations

import json
import math
import os
import resource
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_accum.callbacks.common import accumulation_strategy, token_group_stats
from lightning_accum.ledger import AccumulationLedger, GroupRecord
from lightning_accum.strategies import ExactAccumulation
from lightning_accum.strategies.checkpoint import slicing_state

__all__ = ["REPORT_FILENAME", "REPORT_SCHEMA", "AccumulationReport"]

REPORT_FILENAME = "accumulation_report.json"
REPORT_SCHEMA = "lightning_accum.report/1"


def _reset_peak_memory(device: torch.device) -> bool:
    """Reset CUDA's allocator peak or Linux's peak resident set; ``False`` where it cannot be reset."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        return False
    return True


def _peak_counter(device: torch.device) -> tuple[int, str]:
    """The process's peak memory in bytes and the counter's name (CUDA, ``VmHWM``, else ``ru_maxrss``)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "torch.cuda.max_memory_allocated (CUDA allocator peak)"
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024, "VmHWM (the process's peak RSS)"
    except OSError:
        pass
    # ru_maxrss is in kilobytes on Linux and bytes on macOS.
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * (1 if sys.platform == "darwin" else 1024)
    return peak, "getrusage ru_maxrss (the process's lifetime peak RSS)"


#: Whether the reset of the process's peak counters was announced (once per process).
_ANNOUNCED: list[bool] = []


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    return value


def _stats(values: list[int]) -> dict[str, float | int | None]:
    if not values:
        return {"min": None, "mean": None, "max": None}
    return {"min": min(values), "mean": sum(values) / len(values), "max": max(values)}


def _spread(counts: Counter[int]) -> dict[str, float | int | None]:
    """``min``, ``median`` and ``max`` of the values ``counts`` holds (value → how often)."""
    values = sorted(counts.elements())
    if not values:
        return dict.fromkeys(("min", "median", "max"))
    return {"min": values[0], "median": statistics.median(values), "max": values[-1]}


class AccumulationReport(Callback):
    """Write the final record of a run when ``fit`` ends, also when it ends by an exception.

    On global rank zero: ``accumulation_report.json`` (keys: docs/concepts.md, "The run record"), the same as a table in
    ``accumulation_report.txt`` and as text ``accum/report`` in every ``TensorBoardLogger``, and a console summary.

    Args:
        path: Folder for ``accumulation_report.json`` and ``.txt``, or a ``.json`` file name; by default the first
            logger's log directory, else the Trainer's ``default_root_dir``.
        reset_peak_memory: Reset the process's peak-memory counter at the start of training.
        verbose: Print the whole table on the console instead of the summary.

    Raises:
        ValueError: At setup, when the record's file cannot be written.

    Example:
        >>> from lightning_accum import AccumulationReport
        >>> AccumulationReport(path="runs").path, AccumulationReport(path="runs/first.json").path
        ('runs', 'runs/first.json')
    """

    def __init__(
        self, path: str | os.PathLike[str] | None = None, reset_peak_memory: bool = False, verbose: bool = False
    ) -> None:
        self.path = os.fspath(path) if path is not None else None
        self.reset_peak_memory = bool(reset_peak_memory)
        self.verbose = bool(verbose)
        self.record: dict[str, Any] | None = None
        #: Where the latest record went (``None`` before one is written, and on ranks other than zero).
        self.written_to: str | None = None
        # Set once setup ran on an accumulation strategy: the hooks after it have something to record.
        self._strategy: ExactAccumulation | None = None
        self._trainer: Trainer | None = None
        self._reset()

    def _reset(self) -> None:
        self._start = 0.0
        self._samples_per_update: list[int] = []
        self._tokens_per_update: list[int] = []
        self._documents_per_update: list[int] = []
        self._microbatch_min: int | None = None
        self._microbatch_max: int | None = None
        self._first_group_peak: int | None = None
        self._peak_before: int | None = None  # the peak counter at the start of training
        self._peak_reset = False  # it was reset there
        self._written = False
        # Under `token_batches=`: the plan's micro-batch samples and padded tokens (value → count), and per group its
        # tokens, padded tokens, micro-batches per replica, highest and mean replica load, long rows.
        self._token_microbatches: tuple[Counter[int], Counter[int]] = (Counter(), Counter())
        self._token_groups: list[tuple[int, int, int, int, float, int]] = []

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        strategy = accumulation_strategy(trainer, "AccumulationReport")
        problem = _unwritable(self._target(trainer)) if trainer.is_global_zero else None
        problem = strategy.broadcast(problem)  # every rank stops alike, none waits in a collective
        if problem is not None:
            raise ValueError(
                f"AccumulationReport cannot write its record: {problem}. Pass `path=` a writable folder, or a file name"
                " ending in `.json` in one (checked before training, so that the run does not end without its record)."
            )
        strategy.add_group_listener(self._on_group)  # once per group
        self._strategy, self._trainer = strategy, trainer

    def _target(self, trainer: Trainer) -> str:
        target = self.path or _log_dir(trainer)
        return target if target.endswith(".json") else os.path.join(target, REPORT_FILENAME)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._strategy is not None:  # None: setup raised or never ran, nothing was attached
            self._strategy.remove_group_listener(self._on_group)
        self._strategy = self._trainer = None

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._reset()
        self._start = time.perf_counter()
        device = trainer.strategy.root_device
        self._peak_before = _peak_counter(device)[0]
        self._peak_reset = self.reset_peak_memory and _reset_peak_memory(device)
        if self._peak_reset and not _ANNOUNCED:
            _ANNOUNCED.append(True)  # once per process: every fit resets them alike
            what = "CUDA's allocator peak" if device.type == "cuda" else "the process's peak resident memory"
            rank_zero_info(
                f"AccumulationReport: reset {what} at the start of training (reset_peak_memory=True), so that the"
                " report gives this fit's peak exactly; other monitors of the process read the reset counters too."
                " Without it (the default) the counters are left as they are, and a peak that predates the fit is"
                " reported as such (`peak_predates_fit`)."
            )

    def _on_group(self, group: GroupRecord, batch_samples: Sequence[int]) -> None:
        if batch_samples:
            low, high = min(batch_samples), max(batch_samples)
            self._microbatch_min = low if self._microbatch_min is None else min(low, self._microbatch_min)
            self._microbatch_max = high if self._microbatch_max is None else max(high, self._microbatch_max)
        if group.dropped:
            return  # not an attempt: its examples are in the ledger's dropped counters
        self._samples_per_update.append(group.samples)
        self._tokens_per_update.append(group.tokens)
        self._documents_per_update.append(group.documents)
        if self._trainer is not None and (plan := token_group_stats(self._trainer)):
            self._token_microbatches[0].update(plan["microbatch_samples"])
            self._token_microbatches[1].update(plan["microbatch_padded_tokens"])
            load = plan["replica_load"]
            counts = (plan["tokens"], plan["padded_tokens"], plan["microbatches"], max(load), sum(load) / len(load))
            self._token_groups.append((*counts, plan["long_rows"]))
        if self._first_group_peak is None and self._peak_before is not None and self._strategy is not None:
            self._first_group_peak = _peak_counter(self._strategy.root_device)[0]

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._finish(trainer, status="completed", error=None, gather=True)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self._strategy is None:
            return  # the run stopped before this callback's setup: no record, and no second error
        status = "interrupted" if isinstance(exception, KeyboardInterrupt) else "failed"
        # Other ranks may be gone: no collective here, this rank's values only.
        self._finish(trainer, status=status, error=f"{type(exception).__name__}: {exception}", gather=False)

    # ------------------------------------------------------------------ the record

    def _gather(self, trainer: Trainer, values: list[int], gather: bool) -> list[list[int]]:
        if not gather or trainer.world_size == 1:
            return [values]
        tensor = torch.tensor(values, dtype=torch.int64, device=trainer.strategy.root_device)
        gathered = trainer.strategy.all_gather(tensor)
        return [[int(v) for v in row] for row in gathered.reshape(trainer.world_size, -1).tolist()]

    def build(self, trainer: Trainer, status: str, error: str | None, gather: bool = True) -> dict[str, Any]:
        """The record as a JSON-ready dict (collective under DDP when ``gather``)."""
        strategy = accumulation_strategy(trainer, "AccumulationReport")
        ledger = strategy.ledger
        run_peak, source = _peak_counter(strategy.root_device)
        before = run_peak if self._peak_before is None else self._peak_before  # None: stopped before training started
        predates = not self._peak_reset and run_peak <= before  # the counter did not rise: the fit may not have set it
        mine = [self._first_group_peak, run_peak, self._microbatch_min, self._microbatch_max, before, predates]
        # -1 marks "none" in the gathered integer tensor only; the record says None.
        per_rank = [
            [v if v >= 0 else None for v in row]
            for row in self._gather(trainer, [-1 if v is None else int(v) for v in mine], gather)
        ]
        m = getattr(trainer.train_dataloader, "batch_size", None)
        a: int | list[int] = trainer.accumulate_grad_batches
        # D counts data-parallel replicas, not devices: the devices of one tensor-parallel group share one replica.
        d, tp = strategy.data_parallel_replicas, strategy.tensor_parallel_size
        tp_note = f"; tensor parallel {tp} (devices sharing one replica)" if tp > 1 else ""
        configured: int | list[int] | None = m * a * d if m is not None and isinstance(a, int) else None
        arithmetic = (f"{m} × {a} × {d} = {configured}" if m is not None else f"? × {a} × {d}") + tp_note
        sampler = strategy.token_sampler
        if sampler is not None and isinstance(sampler.samples_per_update, int) and isinstance(a, int):
            configured = sampler.samples_per_update  # the fixed-m run's B, cut by tokens
            arithmetic = f"{configured // (a * d)} × {a} × {d} = {configured}, cut by tokens{tp_note}"
        if strategy.batch_schedule is not None:  # one A per stage reached (the Trainer's attribute: the last group's)
            stages = strategy.batch_stages
            a = [stage["accumulate_grad_batches"] for stage in stages]
            configured = [stage["samples_per_update"] for stage in stages]
            arithmetic = "; ".join(
                f"stage {stage['stage']}: {b // (size * d)} × {size} × {d} = {b}"
                for stage, size, b in zip(stages, a, configured, strict=True)
            )
            arithmetic = (arithmetic or "no stage reached") + tp_note
        wall = time.perf_counter() - self._start if self._start else 0.0
        mins = [row[2] for row in per_rank if row[2] is not None]
        maxs = [row[3] for row in per_rank if row[3] is not None]
        return {
            "schema": REPORT_SCHEMA,
            "status": status,
            "error": error,
            "micro_batch_size": {
                "configured": m,
                "realized_min": min(mins) if mins else None,
                "realized_max": max(maxs) if maxs else None,
                "per_rank": [{"min": row[2], "max": row[3]} for row in per_rank],
            },
            "accumulate_grad_batches": a,
            "data_parallel_replicas": d,
            "tensor_parallel_size": tp,
            "effective_batch": {
                "configured": configured,
                "arithmetic": arithmetic,
                **{f"realized_{name}": value for name, value in _stats(self._samples_per_update).items()},
            },
            "tokens": {
                "total": ledger.tokens,
                **{f"per_update_{name}": value for name, value in _stats(self._tokens_per_update).items()},
            },
            "samples": {"total": ledger.samples},
            "precision": str(trainer.precision),
            "normalization": ledger.normalization,
            "partial_group": {
                "policy": strategy.engine.options.partial_group,
                "count": ledger.partial_groups,
                "dropped_microbatches": ledger.dropped_microbatches,
                "dropped_samples": ledger.dropped_samples,
                "dropped_tokens": ledger.dropped_tokens,
            },
            "updates": {
                "attempted": ledger.updates_attempted,
                "applied": ledger.updates_applied,
                "skipped": dict(ledger.updates_skipped),
            },
            "memory": {
                "source": f"{source}, {'reset at the start of training' if self._peak_reset else 'not reset'}",
                "unit": "bytes",
                "first_group_peak": [row[0] for row in per_rank],
                "run_peak": [row[1] for row in per_rank],
                # Added keys (the ones above keep their meaning): what tells this fit's peak from an earlier one.
                "peak_before_fit": [row[4] for row in per_rank],
                "peak_predates_fit": [bool(row[5]) for row in per_rank],
            },
            "time": {
                "wall_seconds": wall,
                "tokens_per_second": ledger.tokens / wall if wall > 0 else None,
                "samples_per_second": ledger.samples / wall if wall > 0 else None,
            },
            **self._documents(ledger),
            **self._token_batches(strategy),
            **_batch_stages(strategy),
            **self._slicing(trainer, strategy, gather),
            "ledger": _finite_or_none(ledger.state_dict()),
        }

    def _documents(self, ledger: AccumulationLedger) -> dict[str, Any]:
        if not (ledger.documents or ledger.dropped_documents or ledger.normalization == "documents"):
            return {}
        per_update = {f"per_update_{name}": value for name, value in _stats(self._documents_per_update).items()}
        return {"documents": {"total": ledger.documents, **per_update, "dropped": ledger.dropped_documents}}

    def _token_batches(self, strategy: ExactAccumulation) -> dict[str, Any]:
        options, groups = strategy.token_batches, self._token_groups
        if options is None:
            return {}
        tokens, padded, per_update, top, mean, long_rows = list(map(list, zip(*groups, strict=True))) or [[]] * 6
        samples, padded_microbatches = self._token_microbatches
        return {
            "token_batches": {
                "max_tokens": options.max_tokens,
                "count": options.count,
                "groups": len(groups),
                "microbatches_per_update": _spread(Counter(per_update)),
                "microbatch_samples": _spread(samples),
                "microbatch_padded_tokens": _spread(padded_microbatches),
                "tokens": sum(tokens),
                "padded_tokens": sum(padded),
                "padding_fraction": 1.0 - sum(tokens) / sum(padded) if padded else None,
                "imbalance": {
                    "run": sum(top) / sum(mean) if mean else None,
                    "worst_group": max((t / m for t, m in zip(top, mean, strict=True)), default=None),
                },
                "long_rows": sum(long_rows),
            }
        }

    @staticmethod
    def _slicing(trainer: Trainer, strategy: ExactAccumulation, gather: bool) -> dict[str, Any]:
        log = strategy.slicing
        if log.configured is None:
            return {}
        mine = log.state_dict()
        mine["slice_sizes"] = {str(size): count for size, count in mine["slice_sizes"].items()}
        rows = slicing_state(mine, trainer.world_size, gather)["per_rank"]
        return {"microbatch_slicing": {"configured": log.configured, "per_rank": rows}}

    def _finish(self, trainer: Trainer, status: str, error: str | None, gather: bool) -> None:
        if self._written:
            return
        self._written = True
        record = self.record = self.build(trainer, status, error, gather)
        if not trainer.is_global_zero:
            return
        target = self._target(trainer)
        os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
        with open(target, "w") as f:
            json.dump(record, f, indent=2, allow_nan=False, default=str)
        self.written_to = target
        table = format_report(record)
        text = os.path.abspath(target[: -len(".json")] + ".txt")
        with open(text, "w") as f:
            f.write(table + "\n")
        where = f"(written to {os.path.abspath(target)}; the table: {text})"
        print(f"{table}\n{where}" if self.verbose else f"{format_summary(record)}\n  {where}")
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                markdown = "\n".join("    " + line for line in table.splitlines())  # preformatted in TensorBoard
                logger.experiment.add_text("accum/report", markdown, global_step=int(ledger_axis(record)))
                logger.experiment.flush()


def _batch_stages(strategy: ExactAccumulation) -> dict[str, Any]:
    schedule = strategy.batch_schedule
    if schedule is None:
        return {}
    return {"batch_schedule": {"schedule": repr(schedule), "axis": schedule.axis, "stages": strategy.batch_stages}}


def _unwritable(target: str) -> str | None:
    """Why the file ``target`` cannot be written (``None``: it can), found without writing it."""
    if os.path.isdir(target):
        return f"{target!r} is a folder, not a file"
    folder = os.path.abspath(os.path.dirname(target) or ".")
    existing = folder
    while not os.path.exists(existing):  # the nearest folder that exists: the rest is created when writing
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing!r} is a file, so the folder {folder!r} cannot be created"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"the folder {existing!r} is not writable"
    if os.path.exists(target) and not os.access(target, os.W_OK):
        return f"the file {target!r} exists and is not writable"
    return None


def _log_dir(trainer: Trainer) -> str:
    """The first logger's directory, read without a collective."""
    if trainer.loggers:
        logger = trainer.loggers[0]
        folder = getattr(logger, "log_dir", None) or logger.save_dir
        if folder:
            return str(folder)
    return str(trainer.default_root_dir)


def ledger_axis(record: dict[str, Any]) -> int:
    """The step of the report's text: the run's tokens, else samples."""
    return int(record["tokens"]["total"] or record["samples"]["total"])


_MIB = 1024 * 1024

#: Console units of the record's keys (the JSON keeps plain numbers: bytes, seconds).
_UNITS: dict[str, str] = {
    "time.wall_seconds": "s",
    "time.tokens_per_second": "tokens/s",
    "time.samples_per_second": "samples/s",
}


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        text = str(value)
    elif isinstance(value, float):
        text = f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}" if abs(value) >= 1 else f"{value:.3g}"
    elif isinstance(value, int):
        text = f"{value:,}"
    elif isinstance(value, dict):
        return ", ".join(f"{k} {_fmt(v)}" for k, v in value.items()) or "-"
    elif isinstance(value, list):
        return ", ".join(_fmt(v, unit) for v in value) or "-"
    else:
        text = str(value)
    return f"{text} {unit}" if unit else text


def _mib(values: list[int | None]) -> str:
    return ", ".join("-" if v is None else f"{v / _MIB:,.1f} MiB" for v in values) or "-"


def format_headline(record: dict[str, Any]) -> str:
    """The record in one line."""
    updates = record.get("updates", {})
    skipped = {k: v for k, v in updates.get("skipped", {}).items() if v}
    said = f" ({_fmt(skipped)})" if skipped else ""
    peaks = [p for p in record.get("memory", {}).get("run_peak", []) if p is not None]
    peak = f", peak {max(peaks) / _MIB:,.1f} MiB" if peaks else ""
    return (
        f"run record: {record.get('status')}, {updates.get('applied', 0)}/{updates.get('attempted', 0)} updates"
        f" applied{said}, {_fmt(record.get('tokens', {}).get('total'))} tokens"
        f"{peak}, {record.get('time', {}).get('wall_seconds', 0.0):.1f} s"
    )


def format_summary(record: dict[str, Any]) -> str:
    """The console's summary: :func:`format_headline`, then the batch, the unit and partial groups."""
    partial, batch = record.get("partial_group", {}), record.get("effective_batch", {}).get("arithmetic")
    return (
        f"{format_headline(record)}\n  samples per update (m × A × D): {batch};"
        f" weighted by {record.get('normalization')}; partial groups: {partial.get('count')} ({partial.get('policy')})"
        + _token_line(record.get("token_batches"))
    )


def _token_line(tokens: dict[str, Any] | None) -> str:
    """The summary's line under ``token_batches=`` (empty otherwise)."""
    if not tokens or not tokens["groups"]:
        return ""
    s, p = ([_fmt(v) for v in tokens[k].values()] for k in ("microbatch_samples", "microbatch_padded_tokens"))
    imbalance = tokens["imbalance"]
    return (
        f"\n  token batches: {s[0]}-{s[2]} samples, {p[0]}-{p[2]} padded tokens per micro-batch (medians {s[1]},"
        f" {p[1]}); padding {100 * tokens['padding_fraction']:.1f} %, replica imbalance {imbalance['run']:.3f} (worst"
        f" group {imbalance['worst_group']:.3f}), {tokens['long_rows']} long rows"
    )


def format_report(record: dict[str, Any]) -> str:
    """The record as a two-column text table."""
    rows: list[tuple[str, str]] = []
    for key, value in record.items():
        if key in ("schema", "ledger"):
            continue
        if not isinstance(value, dict):
            rows.append((key, _fmt(value)))
            continue
        for sub, inner in value.items():
            name = f"{key}.{sub}"
            if key == "memory" and sub == "unit":
                continue  # the console shows MiB
            if key == "memory" and isinstance(inner, list):
                shown = _fmt(inner) if sub == "peak_predates_fit" else _mib(inner)
                rows.append((name + " (per rank)", shown))
            elif key == "batch_schedule" and sub == "stages":
                rows += [
                    (
                        f"{name}[{st['stage']}]",
                        f"from {st['threshold']:,} {value['axis']}: {st['samples_per_update']:,} samples/update,"
                        f" {st['updates']:,} updates, {st['tokens']:,} tokens, {st['samples']:,} samples,"
                        f" A = {st.get('accumulate_grad_batches', '?')}",
                    )
                    for st in inner
                ]
            elif sub == "per_rank" and isinstance(inner, list):
                rows.append((name, "; ".join(_fmt(r) for r in inner)))
            else:
                rows.append((name, _fmt(inner, _UNITS.get(name, ""))))
    width = max(len(k) for k, _ in rows)
    lines = ["lightning_accum run record"] + [f"{k.ljust(width)}  {v}" for k, v in rows]
    return "\n".join(lines)
