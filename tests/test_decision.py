"""decision: what a closed group becomes (applied, skipped as empty, dropped as partial) and replicas' agreement."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import run_ddp

from lightning_accum.engine import AccumulationEngine


def test_empty_groups_are_skipped_attempts_warned_once_and_counted() -> None:
    engine = AccumulationEngine(normalize="tokens")
    with pytest.warns(UserWarning, match=r"update 1 is skipped: its group holds no tokens at all") as caught:
        for _ in range(3):
            for _ in range(2):
                engine.add_microbatch({"loss": torch.tensor(float("nan")), "num_tokens": 0}, None, accumulate=2)
            outcome = engine.close_group(accumulate=2)
            engine.finish_group(outcome, applied=False)
            assert outcome.action == "skip" and outcome.record.skip_reason == "empty"
            assert math.isnan(outcome.record.loss)
    assert len([w for w in caught if "holds no tokens" in str(w.message)]) == 1  # said once, counted always
    ledger = engine.ledger
    assert (ledger.updates_attempted, ledger.updates_applied, ledger.updates_skipped["empty"]) == (3, 0, 3)


def test_partial_group_policies() -> None:
    for policy, action in [("rescale", "apply"), ("drop", "drop")]:
        engine = AccumulationEngine(normalize="tokens", partial_group=policy)
        engine.add_microbatch({"loss": torch.tensor(1.0), "num_tokens": 7}, {"x": torch.zeros(3)}, accumulate=3)
        outcome = engine.close_group(accumulate=3)
        engine.finish_group(outcome, applied=action == "apply")
        assert outcome.action == action
        ledger = engine.ledger
        assert ledger.partial_groups == 1
        if policy == "drop":
            assert (ledger.updates_attempted, ledger.dropped_microbatches, ledger.dropped_samples) == (0, 1, 3)
            assert (ledger.dropped_tokens, ledger.tokens, ledger.samples) == (7, 0, 0)
        else:
            assert (ledger.updates_attempted, ledger.tokens, ledger.samples, ledger.dropped_tokens) == (1, 7, 3, 0)


def _three_units(rank: int, folder: str) -> None:
    """Three replicas weighting one group by tokens, samples and batches: what each one's close says."""
    from lightning_accum.engine import AccumulationEngine, Replicas

    torch.distributed.init_process_group("gloo")

    def reduce(tensor: torch.Tensor) -> torch.Tensor:
        torch.distributed.all_reduce(tensor)
        return tensor

    engine = AccumulationEngine(normalize=("tokens", "samples", "batches")[rank])
    engine.bind(replicas=Replicas(3, reduce))
    loss = torch.tensor(2.0, requires_grad=True)
    engine.add_microbatch({"loss": loss, "num_tokens": 5, "num_samples": 2}, None, accumulate=1)
    try:
        engine.close_group(accumulate=1)
        message = "no error"
    except RuntimeError as err:
        message = str(err)
    Path(folder, f"rank{rank}.json").write_text(json.dumps(message))


@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_three_replicas_on_three_units_get_the_same_error_on_every_rank(tmp_path: Path) -> None:
    # Before: codes 1 + 2 + 3 = 2 · 3, so the replica weighting by samples closed the group ("no error") while the two
    # others raised; the sum of the codes' squares (14 against 4 · 3) now tells every replica.
    run_ddp(_three_units, str(tmp_path), world_size=3)
    messages = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(3)]
    assert all(m.startswith("Replicas weight micro-batches by different units") for m in messages), messages
