"""carry: an open group's carried state (its sums summed over the replicas, its c) and what it brings into the resumed
group, closed as the uninterrupted one."""

from __future__ import annotations

import torch

from lightning_accum.carry import Carried
from lightning_accum.engine import AccumulationEngine


def test_a_group_reopened_from_its_saved_state_closes_like_the_uninterrupted_one() -> None:
    microbatches = [(512, 2.0), (1536, 4.0), (100, 1.0)]

    def add(engine: AccumulationEngine, n: int, loss: float) -> torch.Tensor:
        out = engine.add_microbatch({"loss": torch.tensor(loss), "num_tokens": torch.tensor(n)}, None, accumulate=3)
        assert out is not None and engine.take_backward_tensor() is out
        engine.backward_finished()
        return out

    whole = AccumulationEngine(normalize="tokens")
    whole_backward = [add(whole, n, loss) for n, loss in microbatches]
    expected = whole.close_group(accumulate=3)

    first = AccumulationEngine(normalize="tokens")
    for n, loss in microbatches[:2]:
        add(first, n, loss)
    assert first.group_consistent
    saved = {"engine": first.state_dict(), "group": first.open_group_state()}
    sums = saved["group"]["sums"]
    assert saved["group"]["microbatches"] == 2
    assert (sums["units"], sums["weighted_loss"], sums["tokens_lo"], sums["tokens_hi"]) == (
        2048.0,
        512 * 2.0 + 1536 * 4.0,
        2048.0,
        0.0,
    )

    # The group carried in at its third place: its c goes to the engine, the rest to the close.
    carried = Carried.from_entry(saved["group"], holds_sums=True, position=2, total=2)
    second = AccumulationEngine(normalize="tokens")
    second.load_state_dict(saved["engine"])
    second.resume_open_group(carried.scale)
    torch.testing.assert_close(add(second, *microbatches[2]), whole_backward[2], rtol=0, atol=0)  # the same w / c
    outcome = second.close_group(accumulate=3, carried=carried)
    assert outcome.record == expected.record and outcome.factor == expected.factor
    assert outcome.record.loss == (512 * 2.0 + 1536 * 4.0 + 100 * 1.0) / 2148

    # A replica that does not hold the sums contributes only its own micro-batches (the holder adds the rest).
    elsewhere = Carried.from_entry(saved["group"], holds_sums=False, position=2, total=2)
    assert not elsewhere.sums and elsewhere.microbatches == 2 and elsewhere.done == 2
    other = AccumulationEngine(normalize="tokens")
    other.load_state_dict(saved["engine"])
    other.resume_open_group(elsewhere.scale)
    add(other, *microbatches[2])
    assert other.open_group_state(elsewhere)["sums"]["tokens_lo"] == 100
