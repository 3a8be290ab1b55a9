"""group: a group's sums formed into one float64 vector, counts carried in exact integer parts whatever their size."""

from __future__ import annotations

import torch

from lightning_accum.engine import AccumulationEngine, Replicas
from lightning_accum.group import GroupSums
from lightning_accum.microbatch import read_microbatch


def test_counts_above_two_to_the_53_are_exact() -> None:
    engine = AccumulationEngine(normalize="tokens")
    big = 2**53 + 1  # a float64 sum would round it to 2**53
    engine.add_microbatch({"loss": torch.tensor(1.0), "num_tokens": torch.tensor(big)}, None, accumulate=2)
    engine.add_microbatch({"loss": torch.tensor(1.0), "num_tokens": big}, None, accumulate=2)
    outcome = engine.close_group(accumulate=2)
    engine.finish_group(outcome, applied=True)
    assert outcome.record.tokens == 2 * big and engine.ledger.tokens == 2 * big
    # Across replicas too: the parts are summed exactly by the all-reduce.
    engine = AccumulationEngine(normalize="tokens")
    engine.bind(replicas=Replicas(2, lambda t: t.mul_(2)))
    engine.add_microbatch({"loss": torch.tensor(1.0), "num_tokens": torch.tensor(big)}, None, accumulate=1)
    outcome = engine.close_group(accumulate=1)
    assert outcome.record.tokens == 2 * big and outcome.record.samples == 0


def test_the_groups_vector_is_float64_so_the_requirement_is_real() -> None:
    # What the check protects: the vector a group closes into is float64 on the device the engine is bound to.
    sums = GroupSums()
    sums.add(read_microbatch({"loss": torch.tensor(2.0), "num_tokens": 3}, None, None, num_samples=1))
    vector = sums.local_vector(torch.device("cpu"), "tokens")
    assert vector.dtype == torch.float64
