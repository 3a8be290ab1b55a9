"""The schedule of the global batch: its forms, its stages, its errors, and the group size Lightning reads."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from helpers import TinyLM, hand_trail, make_examples, params_vector, random_lengths, relative_error

from lightning_accum import AccumulationLedger, BatchSchedule
from lightning_accum.batch_schedule import as_schedule, parse_count, parse_stages


def test_the_three_forms_give_the_same_stages() -> None:
    as_dict = BatchSchedule({0: 768, 250 * 10**9: 1536, 500 * 10**9: 3072})
    as_text = BatchSchedule("0:768 250B:1536 500B:3072")
    assert as_dict == as_text
    assert as_schedule("0:768 250B:1536 500B:3072") == as_text
    assert as_schedule({0: 768, 250 * 10**9: 1536, 500 * 10**9: 3072}) == as_text
    # Megatron's ramp: 32 → 128 by 32 over 300 samples: stages at 0, 100, 200 and 300.
    ramp = BatchSchedule.ramp(start=32, increment=32, over=300, final=128, axis="samples")
    assert ramp == BatchSchedule({0: 32, 100: 64, 200: 96, 300: 128}, axis="samples")
    # Uneven spacing rounds each threshold up, as Megatron's floor(consumed / (over / n)) does.
    assert BatchSchedule.ramp(start=1, increment=1, over=10, final=4, axis="samples").table() == {
        0: 1,
        4: 2,
        7: 3,
        10: 4,
    }


def test_suffixes_and_decimals() -> None:
    assert [parse_count(t) for t in ("0", "12", "3K", "2m", "1.5B", "1T")] == [
        0,
        12,
        3000,
        2 * 10**6,
        15 * 10**8,
        10**12,
    ]
    assert parse_stages(" 0:8   1K:16 ") == {0: 8, 1000: 16}
    with pytest.raises(ValueError, match=r"whole number .* got '1\.5'\. Write e\.g\. '250B'"):
        parse_count("1.5")
    with pytest.raises(ValueError, match=r"got '12x'"):
        parse_count("12x")
    with pytest.raises(ValueError, match=r"each stage is written 'threshold:batch', got '1K'"):
        parse_stages("0:8 1K")


def test_the_stage_of_a_position_and_the_group_size() -> None:
    schedule = BatchSchedule({0: 64, 2_000_000: 128, 6_000_000: 256}, axis="tokens")
    assert [schedule.stage_at(p).index for p in (0, 1_999_999, 2_000_000, 5_999_999, 6_000_000, 10**12)] == [
        0,
        0,
        1,
        1,
        2,
        2,
    ]
    assert schedule.microbatches(AccumulationLedger(tokens=1_999_999), microbatch_size=4, replicas=2) == 8
    assert schedule.microbatches(AccumulationLedger(tokens=2_000_000), microbatch_size=4, replicas=2) == 16
    updates = BatchSchedule({0: 8, 3: 16}, axis="updates")
    assert updates.stage_at(AccumulationLedger(updates_applied=3, updates_attempted=5)).samples == 16


def test_batches_in_tokens_are_rows_of_the_sequence_length() -> None:
    schedule = BatchSchedule({0: 8192, 10**6: 16384}, batch_unit="tokens", sequence_length=1024)
    assert [(s.samples, s.tokens) for s in schedule.stages] == [(8, 8192), (16, 16384)]
    assert schedule.table() == {0: 8192, 10**6: 16384}
    with pytest.raises(ValueError, match=r"stage 1 \(from 1000000 tokens\) holds 1000 tokens per update, not a whole"):
        BatchSchedule({0: 2048, 10**6: 1000}, batch_unit="tokens", sequence_length=1024)
    with pytest.raises(ValueError, match=r"needs `sequence_length`.*got None\. Pass e\.g\. `sequence_length=2048`"):
        BatchSchedule({0: 2048}, batch_unit="tokens")


def test_lr_scaling_by_the_batch_of_the_first_stage() -> None:
    stages = {0: 16, 100: 64, 200: 8}  # a schedule may shrink the batch
    assert [BatchSchedule(stages, lr_scaling="sqrt").lr_factor(i) for i in range(3)] == [1.0, 2.0, 0.5**0.5]
    assert [BatchSchedule(stages, lr_scaling="linear").lr_factor(i) for i in range(3)] == [1.0, 4.0, 0.5]
    assert [BatchSchedule(stages).lr_factor(i) for i in range(3)] == [1.0, 1.0, 1.0]


def test_errors_name_the_argument_the_value_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"first threshold must be 0 .* got 100\. Add a stage `0: <batch>`"):
        BatchSchedule({100: 64, 200: 128})
    with pytest.raises(ValueError, match=r"thresholds must increase, but 100 follows 200\. Write the stages"):
        BatchSchedule({0: 64, 200: 128, 100: 256})
    with pytest.raises(ValueError, match=r"thresholds must increase, but 5000000000 follows 5000000000\."):
        BatchSchedule("0:64 5B:128 5B:256")
    with pytest.raises(ValueError, match=r"stage 1's batch must be a positive int, got 0"):
        BatchSchedule({0: 64, 10: 0})
    with pytest.raises(ValueError, match=r"`axis` must be one of 'tokens', 'samples', 'updates'; got 'steps'"):
        BatchSchedule({0: 64}, axis="steps")
    with pytest.raises(ValueError, match=r"`lr_scaling` must be one of 'sqrt', 'linear'; got 'cubic'"):
        BatchSchedule({0: 64}, lr_scaling="cubic")
    with pytest.raises(ValueError, match=r"`final - start` \(100 - 32\) must be a positive multiple of `increment=32`"):
        BatchSchedule.ramp(start=32, increment=32, over=10, final=100)
    with pytest.raises(ValueError, match=r"`BatchSchedule.ramp\(over=\.\.\.\)` must be a positive int, got 0"):
        BatchSchedule.ramp(start=32, increment=32, over=0, final=128)
    with pytest.raises(TypeError, match=r"`batch_schedule` must be a BatchSchedule.*got int"):
        as_schedule(64)  # type: ignore[arg-type]


def test_a_batch_not_divisible_by_m_times_d_names_the_stage_and_the_nearest_sizes() -> None:
    schedule = BatchSchedule({0: 8, 1000: 12, 2000: 48}, axis="samples")
    schedule.check(microbatch_size=2, replicas=2)
    with pytest.raises(ValueError, match=r"stage 1 \(from 1000 samples\) holds 12 .* m × D = 4 × 2 = 8 .* Use 8 or 16"):
        schedule.check(microbatch_size=4, replicas=2)
    with pytest.raises(ValueError, match=r"stage 0 \(from 0 samples\) holds 8 .* = 16 .* Use 16 for that stage"):
        schedule.microbatches(AccumulationLedger(), microbatch_size=8, replicas=2)


def test_a_fabric_loop_ramps_with_two_changed_lines_and_matches_the_float64_hand_loop() -> None:
    examples = make_examples(random_lengths(40, seed=7), seed=7)
    schedule = BatchSchedule({0: 4, 30: 8, 120: 16}, axis="tokens")
    expected = hand_trail(TinyLM(lr=0.5, seed=7), examples, schedule, epochs=2, lr=0.5)
    for m in (4, 2):
        fabric = L.Fabric(strategy="accum", accelerator="cpu", devices=1, loggers=[])
        module = TinyLM(lr=0.5, seed=7)
        model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.5))
        trail = []
        for _ in range(2):
            batches = [examples[i : i + m] for i in range(0, len(examples), m)]
            for index, rows in enumerate(batches):
                batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
                # The two lines a ramp changes: the group's size from the ledger, and the group's end from it.
                A = schedule.microbatches(fabric.strategy.ledger, microbatch_size=m, replicas=fabric.world_size)
                is_accumulating = fabric.strategy.engine.microbatches_in_group + 1 < A and index + 1 < len(batches)
                with fabric.no_backward_sync(model, enabled=is_accumulating):
                    loss = module.mean_loss(batch)
                    fabric.backward(fabric.strategy.accumulate(loss, num_tokens=(batch["labels"] != -100).sum()))
                if not is_accumulating:
                    fabric.strategy.close_group(optimizer, group_size=A)
                    optimizer.step()
                    optimizer.zero_grad()
                    trail.append(params_vector(module))
        assert len(trail) == len(expected)
        assert max(relative_error(p, e) for p, e in zip(trail, expected, strict=True)) < 1e-5, m
