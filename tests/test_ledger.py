"""The ledger: counting rules, plain-data state, weights_only checkpoints."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from lightning_accum import AccumulationLedger, GroupRecord


def test_counting_rules_for_applied_skipped_and_dropped_groups() -> None:
    ledger = AccumulationLedger()
    ledger.record(GroupRecord(loss=2.0, tokens=100, samples=4, microbatches=2, applied=True))
    ledger.record(GroupRecord(loss=math.nan, tokens=0, samples=4, microbatches=2, applied=False, skip_reason="empty"))
    ledger.record(GroupRecord(loss=1.0, tokens=30, samples=2, microbatches=1, applied=False, dropped=True))
    assert (ledger.updates_attempted, ledger.updates_applied, ledger.skipped_total) == (2, 1, 1)
    assert ledger.updates_skipped == {"empty": 1, "nonfinite": 0, "overflow": 0}
    # A dropped group is not an attempt: it is counted only in the dropped_* counters.
    assert (ledger.microbatches, ledger.samples, ledger.tokens) == (4, 8, 100)
    assert (ledger.dropped_microbatches, ledger.dropped_samples, ledger.dropped_tokens) == (1, 2, 30)


def test_state_is_plain_data_and_loads_with_weights_only(tmp_path: Path) -> None:
    ledger = AccumulationLedger(tokens=10**12 + 3, normalization="tokens")
    ledger.record(GroupRecord(loss=math.nan, tokens=0, samples=1, microbatches=1, applied=False, skip_reason="empty"))
    path = tmp_path / "ledger.pt"
    torch.save({"ledger": ledger.state_dict()}, path)
    state = torch.load(path, weights_only=True)["ledger"]
    restored = AccumulationLedger()
    restored.load_state_dict(state)
    assert restored == ledger
    assert restored.tokens == 10**12 + 3 and isinstance(restored.tokens, int)


def test_state_from_an_older_version_reads_missing_keys_with_defaults() -> None:
    ledger = AccumulationLedger()
    ledger.load_state_dict({"microbatches": 5, "updates_skipped": {"overflow": 2}})
    assert ledger.microbatches == 5 and ledger.updates_skipped == {"empty": 0, "nonfinite": 0, "overflow": 2}
    assert ledger.last_group is None and ledger.dropped_tokens == 0
