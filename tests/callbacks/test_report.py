"""AccumulationReport: the JSON, console and TensorBoard record of real runs, one device and DDP."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from helpers import (
    IGNORE,
    HoldMemory,
    ListDataset,
    TinyLM,
    fit,
    make_examples,
    make_trainer,
    random_lengths,
    reset_resident_peak,
    run_ddp,
)
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader

from lightning_accum import AccumulationReport, AccumulationStrategy
from lightning_accum.callbacks import report as report_module
from lightning_accum.callbacks.report import REPORT_FILENAME, format_report


def tokens_of(examples: list[dict[str, torch.Tensor]]) -> int:
    return sum(int((e["labels"] != IGNORE).sum()) for e in examples)


def test_report_of_a_run_with_a_partial_group(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lengths = random_lengths(14, seed=21)
    examples = make_examples(lengths, seed=21)
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    trainer = make_trainer(
        strategy=AccumulationStrategy(partial_group="rescale"),
        accumulate_grad_batches=3,
        logger=logger,
        callbacks=[AccumulationReport()],
    )
    trainer.fit(TinyLM(lr=0.5), DataLoader(ListDataset(examples), batch_size=2))
    record = json.loads((tmp_path / "tb" / "version_0" / REPORT_FILENAME).read_text())
    ledger = trainer.strategy.ledger

    # 7 micro-batches of 2 with A = 3: groups of 6, 6 and 2 examples.
    groups = [examples[0:6], examples[6:12], examples[12:14]]
    per_update_tokens = [tokens_of(g) for g in groups]
    assert record["status"] == "completed" and record["error"] is None
    assert record["micro_batch_size"] == {
        "configured": 2,
        "realized_min": 2,
        "realized_max": 2,
        "per_rank": [{"min": 2, "max": 2}],
    }
    assert (record["accumulate_grad_batches"], record["data_parallel_replicas"]) == (3, 1)
    assert record["effective_batch"]["configured"] == 6 and record["effective_batch"]["arithmetic"] == "2 × 3 × 1 = 6"
    assert (record["effective_batch"]["realized_min"], record["effective_batch"]["realized_max"]) == (2, 6)
    assert record["effective_batch"]["realized_mean"] == pytest.approx(14 / 3)
    assert record["tokens"]["total"] == sum(lengths) == ledger.tokens
    assert record["tokens"]["per_update_min"] == min(per_update_tokens)
    assert record["tokens"]["per_update_max"] == max(per_update_tokens)
    assert record["tokens"]["per_update_mean"] == pytest.approx(sum(per_update_tokens) / 3)
    assert record["samples"]["total"] == 14 and record["precision"] == "32-true" and record["normalization"] == "tokens"
    assert record["partial_group"] == {
        "policy": "rescale",
        "count": 1,
        "dropped_microbatches": 0,
        "dropped_samples": 0,
        "dropped_tokens": 0,
    }
    assert record["updates"] == {"attempted": 3, "applied": 3, "skipped": {"empty": 0, "nonfinite": 0, "overflow": 0}}
    memory = record["memory"]
    assert "VmHWM" in memory["source"] and memory["unit"] == "bytes"  # this fit's peak (Linux)
    assert 0 < memory["first_group_peak"][0] <= memory["run_peak"][0]
    # A peak above the process's peak before the fit is the counter's; at or below it, a sample (a lower bound).
    assert memory["peak_predates_fit"] == [memory["run_peak"][0] <= memory["peak_before_fit"][0]]
    assert record["time"]["wall_seconds"] > 0
    assert record["time"]["tokens_per_second"] == pytest.approx(sum(lengths) / record["time"]["wall_seconds"])
    assert record["ledger"]["tokens"] == ledger.tokens

    console = capsys.readouterr().out
    assert console.count("\n") <= 3 and "2 × 3 × 1 = 6" in console  # the summary; the table in its file
    assert "lightning_accum run record" in (tmp_path / "tb" / "version_0" / "accumulation_report.txt").read_text()
    events = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"tensors": 0})
    events.Reload()
    text = events.Tensors("accum/report/text_summary")[0]
    assert text.step == sum(lengths)
    assert "2 × 3 × 1 = 6" in text.tensor_proto.string_val[0].decode()


def test_drop_policy_is_recorded(tmp_path: Path) -> None:
    lengths = random_lengths(14, seed=22)
    report = AccumulationReport(path=tmp_path)
    fit(
        TinyLM(),
        make_examples(lengths, seed=22),
        2,
        3,
        strategy=AccumulationStrategy(partial_group="drop"),
        callbacks=[report],
    )
    record = json.loads((tmp_path / REPORT_FILENAME).read_text())
    assert record["partial_group"] == {
        "policy": "drop",
        "count": 1,
        "dropped_microbatches": 1,
        "dropped_samples": 2,
        "dropped_tokens": sum(lengths[12:]),
    }
    assert record["tokens"]["total"] == sum(lengths[:12]) and record["updates"]["attempted"] == 2


def test_realized_micro_batch_sizes_include_a_dropped_group(tmp_path: Path) -> None:
    # 14 examples in micro-batches of 4 with A = 3: a full group (4, 4, 4), then a partial one (2) that is dropped.
    report = AccumulationReport(path=tmp_path)
    fit(
        TinyLM(),
        make_examples(random_lengths(14, seed=23), seed=23),
        4,
        3,
        strategy=AccumulationStrategy(partial_group="drop"),
        callbacks=[report],
    )
    record = json.loads((tmp_path / REPORT_FILENAME).read_text())
    assert record["micro_batch_size"] == {
        "configured": 4,
        "realized_min": 2,
        "realized_max": 4,
        "per_rank": [{"min": 2, "max": 4}],
    }
    assert record["partial_group"]["dropped_samples"] == 2 and record["updates"]["attempted"] == 1
    assert (record["effective_batch"]["realized_min"], record["effective_batch"]["realized_max"]) == (12, 12)


class _Failing(TinyLM):
    def __init__(self, error: type[BaseException]) -> None:
        super().__init__()
        self.error = error

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        if batch_idx == 4:
            raise self.error("stopped on purpose")
        return super().training_step(batch, batch_idx)


def test_report_is_written_when_fit_fails(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="stopped on purpose"):
        fit(_Failing(ValueError), make_examples([3] * 12), 2, 2, callbacks=[AccumulationReport(path=tmp_path)])
    record = json.loads((tmp_path / REPORT_FILENAME).read_text())
    assert record["status"] == "failed" and record["error"] == "ValueError: stopped on purpose"
    assert record["updates"]["attempted"] == 2 and record["tokens"]["total"] == 2 * 2 * 2 * 3


def test_report_is_written_on_keyboard_interrupt(tmp_path: Path) -> None:
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit):  # Lightning's graceful shutdown exits after the hooks ran
            fit(
                _Failing(KeyboardInterrupt),
                make_examples([3] * 12),
                2,
                2,
                callbacks=[AccumulationReport(path=tmp_path)],
            )
    finally:
        signal.signal(signal.SIGINT, handler)
    record = json.loads((tmp_path / REPORT_FILENAME).read_text())
    assert record["status"] == "interrupted" and record["error"].startswith("KeyboardInterrupt")


SEED_TABLE_D2 = [(2, 8), (1, 16), (4, 4)]


def _seed_table_reports(rank: int, folder: str) -> None:
    examples = make_examples(random_lengths(64, seed=23), seed=23)
    for m, a in SEED_TABLE_D2:
        # The default location (the logger's directory) must not need a collective on rank zero alone.
        logger = TensorBoardLogger(folder, name=f"m{m}a{a}", version=0)
        fit(TinyLM(), examples, m, a, strategy="accum_ddp", devices=2, callbacks=[AccumulationReport()], logger=logger)


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_ddp_reports_carry_the_seed_table_effective_batch(tmp_path: Path) -> None:
    run_ddp(_seed_table_reports, str(tmp_path))
    lengths = random_lengths(64, seed=23)
    for m, a in SEED_TABLE_D2:
        record = json.loads((tmp_path / f"m{m}a{a}" / "version_0" / REPORT_FILENAME).read_text())
        batch = record["effective_batch"]
        assert (batch["configured"], batch["arithmetic"]) == (32, f"{m} × {a} × 2 = 32")
        assert (batch["realized_min"], batch["realized_mean"], batch["realized_max"]) == (32, 32, 32)
        assert record["data_parallel_replicas"] == 2 and record["updates"]["applied"] == 2
        assert record["tokens"]["total"] == sum(lengths) and record["samples"]["total"] == 64
        assert len(record["memory"]["run_peak"]) == 2 and all(v > 0 for v in record["memory"]["run_peak"])
        assert record["micro_batch_size"]["per_rank"] == [{"min": m, "max": m}] * 2


def _values(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [v for inner in tree.values() for v in _values(inner)]
    if isinstance(tree, list):
        return [v for inner in tree for v in _values(inner)]
    return [tree]


def test_path_may_name_the_json_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "records" / "first.json"
    report = AccumulationReport(path=target)
    fit(TinyLM(), make_examples(random_lengths(8, seed=31), seed=31), 2, 2, callbacks=[report])
    assert target.is_file() and not (target / REPORT_FILENAME).exists()
    assert json.loads(target.read_text())["status"] == "completed"
    assert report.written_to == str(target) and target.with_suffix(".txt").is_file()
    assert f"(written to {target}; the table: {target.with_suffix('.txt')})" in capsys.readouterr().out


def test_console_table_has_units_and_no_exponents(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = AccumulationReport(tmp_path, verbose=True)
    fit(TinyLM(), make_examples(random_lengths(8, seed=32), seed=32), 2, 2, callbacks=[report])
    table = capsys.readouterr().out
    record = json.loads((tmp_path / REPORT_FILENAME).read_text())
    rows = dict(
        re.split(r"\s{2,}", line, maxsplit=1) for line in table.splitlines() if line.startswith(("memory", "time"))
    )
    peak_mib = record["memory"]["run_peak"][0] / 2**20
    assert rows["memory.run_peak (per rank)"] == f"{peak_mib:,.1f} MiB"  # a thousands separator past 1,000 MiB
    assert rows["time.tokens_per_second"].endswith(" tokens/s") and rows["time.wall_seconds"].endswith(" s")
    assert "e+" not in table and "bytes" not in table
    assert f"(written to {tmp_path / REPORT_FILENAME}; the table: {tmp_path / 'accumulation_report.txt'})" in table


class _FailsAtOnce(TinyLM):
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        raise ValueError("stopped before any group closed")


def test_a_failed_run_records_none_not_placeholders(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="stopped before any group closed"):
        fit(_FailsAtOnce(), make_examples([3] * 8), 2, 2, callbacks=[AccumulationReport(path=tmp_path)])
    record = json.loads((tmp_path / REPORT_FILENAME).read_text())
    assert record["status"] == "failed"
    assert record["micro_batch_size"]["per_rank"] == [{"min": None, "max": None}]
    assert record["memory"]["first_group_peak"] == [None]
    assert -1 not in _values(record)


def test_a_trainer_whose_accumulate_grad_batches_is_none_keeps_the_strategys_error(tmp_path: Path) -> None:
    # `accumulate_grad_batches: null` in a config layered on one that sets it (issue #66) reaches the Trainer as None:
    # the schedule's error is the one raised, and the record is written, not replaced by a TypeError of its own.
    trainer = make_trainer(
        strategy=AccumulationStrategy(batch_schedule={0: 4}),
        accumulate_grad_batches=None,
        callbacks=[AccumulationReport(path=tmp_path)],
    )
    with pytest.raises(ValueError, match=r"the Trainer has `accumulate_grad_batches=None`. Remove"):
        trainer.fit(TinyLM(), DataLoader(ListDataset(make_examples([3] * 8)), batch_size=2))
    record = json.loads((tmp_path / REPORT_FILENAME).read_text())
    assert record["status"] == "failed" and record["error"].startswith("ValueError: `batch_schedule=` sets")


def test_an_error_in_an_earlier_setup_stays_the_only_error(tmp_path: Path) -> None:
    from lightning_accum import AxisLogger

    report = AccumulationReport(path=tmp_path)
    with pytest.raises(RuntimeError, match="AxisLogger needs an accumulation strategy") as caught:
        fit(TinyLM(), make_examples([3] * 8), 2, 2, strategy="auto", callbacks=[AxisLogger(axis="tokens"), report])
    assert caught.value.__context__ is None and caught.value.__cause__ is None  # no second, chained error
    assert not (tmp_path / REPORT_FILENAME).exists() and report.written_to is None


def test_a_second_fit_whose_peak_is_below_the_first_ones_says_its_peak_predates_it(tmp_path: Path) -> None:
    examples = make_examples(random_lengths(8, seed=3), seed=3)
    records = []
    reset_resident_peak()  # the first fit's 400 MB then raise the process's peak, whatever earlier tests held
    for name, callbacks in (("first", [HoldMemory(400)]), ("second", [])):
        report = AccumulationReport(path=tmp_path / name)
        fit(TinyLM(), examples, batch_size=2, accumulate=2, callbacks=[*callbacks, report])
        records.append(json.loads((tmp_path / name / REPORT_FILENAME).read_text())["memory"])
    first, second = records
    # The first fit raised the process's peak: its own, exactly.
    assert first["peak_predates_fit"] == [False] and first["run_peak"][0] - first["peak_before_fit"][0] > 300 * 2**20
    # The second's stayed below it: the peak the record gives is the first fit's, and it says so (a reset on request,
    # `reset_peak_memory=True`, gives the fit's own: test_the_fit_peak_leaves_the_process_peak_to_other_monitors_...).
    assert second["peak_predates_fit"] == [True] and second["run_peak"] == second["peak_before_fit"]
    assert second["run_peak"][0] >= first["run_peak"][0]


# ------------------------------------------------------------ edges
# AccumulationReport at its edges: an output path that cannot be written is an error before anything trains, and the
# process-wide peak-memory counters are left to other monitors, reset only on request (announced).


class _CountSteps(L.Callback):
    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, *args: Any) -> None:
        self.batches += 1


def _unwritable_targets(tmp_path: Path) -> list[tuple[Path, str]]:
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    folder = tmp_path / "existing_folder.json"
    folder.mkdir()
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)  # readable, not writable
    targets = [
        (a_file / "report.json", "is a file, so the folder"),
        (folder, "is a folder, not a file"),
    ]
    if os.geteuid() != 0:  # root writes anywhere: a read-only folder is no obstacle to it
        targets.append((locked / "report.json", "is not writable"))
    return targets


def test_a_path_that_cannot_be_written_is_an_error_before_the_first_update(tmp_path: Path) -> None:
    examples = make_examples(random_lengths(8, seed=1), seed=1)
    for target, why in _unwritable_targets(tmp_path):
        steps = _CountSteps()
        with pytest.raises(ValueError, match=rf"AccumulationReport cannot write its record: .*{why}.*Pass `path=`"):
            fit(TinyLM(), examples, batch_size=2, accumulate=2, callbacks=[AccumulationReport(path=target), steps])
        assert steps.batches == 0, target  # nothing trained


def test_a_path_whose_folders_do_not_exist_yet_is_fine(tmp_path: Path) -> None:
    target = tmp_path / "runs" / "deep" / "record.json"
    fit(TinyLM(), make_examples([3, 4, 5, 6]), batch_size=2, accumulate=2, callbacks=[AccumulationReport(path=target)])
    assert json.loads(target.read_text())["status"] == "completed"


def _peak_hwm() -> int:
    """The process's peak resident set, VmHWM, in bytes."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) * 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux's resident peak")
def test_the_fit_peak_leaves_the_process_peak_to_other_monitors_and_resets_it_only_on_request(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(report_module, "_ANNOUNCED", [])  # announced once per process: this test's process state
    examples = make_examples(random_lengths(8, seed=2), seed=2)
    block = torch.ones(600 * 2**20 // 4)  # 600 MB touched before the fit: the process's peak, set before it
    del block
    before = _peak_hwm()
    with caplog.at_level("INFO", logger="lightning.pytorch.utilities.rank_zero"):
        fit(TinyLM(), examples, 2, 2, callbacks=[HoldMemory(150), AccumulationReport(path=tmp_path / "kept")])
    # Not reset (before: reset by default): another monitor reading the peak still sees the 600 MB.
    assert _peak_hwm() == before
    assert not [r for r in caplog.records if "AccumulationReport: reset" in r.getMessage()]
    kept = json.loads((tmp_path / "kept" / REPORT_FILENAME).read_text())["memory"]
    # The fit's 150 MB stay below the earlier 600 MB: the counter did not rise, and the record says the peak it gives,
    # the process's, predates the fit (the fit's own peak is at most it).
    assert kept["peak_before_fit"] == [before] and kept["peak_predates_fit"] == [True]
    assert kept["run_peak"] == kept["first_group_peak"] == [before]
    assert "VmHWM" in kept["source"] and "not reset" in kept["source"]
    caplog.clear()
    with caplog.at_level("INFO", logger="lightning.pytorch.utilities.rank_zero"):
        fit(TinyLM(), examples, 2, 2, callbacks=[AccumulationReport(path=tmp_path / "reset", reset_peak_memory=True)])
    said = [r.getMessage() for r in caplog.records if "AccumulationReport: reset" in r.getMessage()]
    assert len(said) == 1 and "reset_peak_memory=True" in said[0]
    reset = json.loads((tmp_path / "reset" / REPORT_FILENAME).read_text())["memory"]
    # On request the process's peak is reset at the start of training: this fit's, exactly, and below the 600 MB.
    assert _peak_hwm() < before and reset["peak_before_fit"] == [before] and reset["peak_predates_fit"] == [False]
    assert "reset at the start of training" in reset["source"]
    assert reset["run_peak"][0] <= _peak_hwm() and reset["run_peak"][0] < kept["run_peak"][0]


def test_quiet_by_default_a_summary_on_the_console_and_the_table_in_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The table was 40 lines on the console after every fit (issue #66): three lines now, the table in its file.
    examples = make_examples([3, 4, 5, 6])
    fit(TinyLM(), examples, batch_size=2, accumulate=2, callbacks=[AccumulationReport(path=tmp_path)])
    printed = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    record = json.loads((tmp_path / REPORT_FILENAME).read_text())
    table = (tmp_path / "accumulation_report.txt").read_text()
    assert record["updates"]["applied"] == 1 and table == format_report(record) + "\n"  # the files are whole
    summary = printed[printed.index(next(p for p in printed if p.startswith("run record:"))) :]
    assert len(summary) == 3, summary
    assert summary[0].startswith("run record: completed, 1/1 updates applied, 18 tokens")
    assert (
        summary[1] == "  samples per update (m × A × D): 2 × 2 × 1 = 4; weighted by tokens; partial groups: 0 (rescale)"
    )
    assert summary[2].startswith(f"  (written to {tmp_path / REPORT_FILENAME}; the table:")
    fit(TinyLM(), examples, batch_size=2, accumulate=2, callbacks=[AccumulationReport(path=tmp_path, verbose=True)])
    assert (tmp_path / "accumulation_report.txt").read_text() in capsys.readouterr().out  # verbose: the whole table


def test_under_a_batch_schedule_the_report_states_each_stages_a_not_one_groups(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # m = 2 and stages of 4, 8 and 16 samples on the samples axis (24 examples: groups of 4, then 8, 8, then 4 left):
    # A is 2, 4, 8 by stage. Before, the report said `accumulate_grad_batches: 1` (the Trainer's attribute after the
    # fit) and an effective batch of 2 × 1 × 1 = 2.
    from lightning_accum import BatchSchedule

    schedule = BatchSchedule({0: 4, 4: 8, 20: 16}, axis="samples")
    report = AccumulationReport(path=str(tmp_path), verbose=True)
    trainer = make_trainer(strategy=AccumulationStrategy(batch_schedule=schedule), callbacks=[report])
    trainer.fit(
        TinyLM(lr=0.5), DataLoader(ListDataset(make_examples(random_lengths(24, seed=5), seed=5)), batch_size=2)
    )
    record = json.loads((tmp_path / REPORT_FILENAME).read_text())
    assert record["accumulate_grad_batches"] == [2, 4, 8]
    assert record["effective_batch"]["configured"] == [4, 8, 16]
    assert (
        record["effective_batch"]["arithmetic"]
        == "stage 0: 2 × 2 × 1 = 4; stage 1: 2 × 4 × 1 = 8; stage 2: 2 × 8 × 1 = 16"
    )
    assert record["effective_batch"]["realized_min"] == 4 and record["effective_batch"]["realized_max"] == 8
    stages = record["batch_schedule"]["stages"]
    assert [(s["stage"], s["accumulate_grad_batches"], s["updates"], s["samples"]) for s in stages] == [
        (0, 2, 1, 4),
        (1, 4, 2, 16),
        (2, 8, 1, 4),  # the epoch's last group: 4 of its 16 samples (a partial group, rescaled)
    ]
    out = capsys.readouterr().out
    assert re.search(r"accumulate_grad_batches +2, 4, 8\n", out), out
    assert re.search(r"batch_schedule\.stages\[1\] +from 4 samples: 8 samples/update, 2 updates, .*, A = 4\n", out)
