"""AccumulationReport at its edges: an output path that cannot be written is an error before anything trains, and the
process-wide peak-memory counters are left to other monitors, reset only on request (announced)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from helpers import HoldMemory, TinyLM, fit, make_examples, random_lengths

from lightning_accum import AccumulationReport
from lightning_accum.callbacks import report as report_module
from lightning_accum.callbacks.report import REPORT_FILENAME


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


def test_one_line_instead_of_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    examples = make_examples([3, 4, 5, 6])
    fit(TinyLM(), examples, batch_size=2, accumulate=2, callbacks=[AccumulationReport(path=tmp_path, table=False)])
    printed = [line for line in capsys.readouterr().out.splitlines() if "run record" in line]
    assert len(printed) == 1 and printed[0].startswith("run record: completed, 1/1 updates applied")
    assert json.loads((tmp_path / REPORT_FILENAME).read_text())["updates"]["applied"] == 1  # the file is whole
