"""slicing: a loader batch's samples counted and cut (the strategy's slices are strategies/test_slicing.py's)."""

from __future__ import annotations

import pytest
import torch
from helpers import IGNORE, TinyLM, fit
from strategies.test_slicing import _examples
from torch import Tensor

from lightning_accum import AccumulationStrategy
from lightning_accum.slicing import SlicingLog, count_samples, slice_batch


def test_a_batch_without_a_common_leading_dimension_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"share no leading \(sample\) dimension \(leading dimensions found: \[3, 4\]"):
        count_samples({"ids": torch.zeros(4, 2), "extra": torch.zeros(3)})
    examples = [{"input_ids": e["input_ids"], "labels": e["labels"], "lens": torch.ones(2)} for e in _examples(8)]

    def collate(items: list[dict[str, Tensor]]) -> dict[str, Tensor]:
        batch = {k: torch.stack([i[k] for i in items]) for k in ("input_ids", "labels")}
        batch["lens"] = torch.ones(3)
        return batch

    with pytest.raises(ValueError, match="split_batch=lambda batch, start, stop"):
        fit(TinyLM(seed=1), examples, 4, 1, strategy=AccumulationStrategy(microbatch_size=2), collate_fn=collate)


def test_default_cut_keeps_non_sample_values_whole() -> None:
    batch = {"x": torch.arange(12).reshape(6, 2), "meta": ("a", 3), "scalar": torch.tensor(1.0), "mask": torch.ones(6)}
    part = slice_batch(batch, 2, 4, 6)
    assert part["x"].tolist() == [[4, 5], [6, 7]] and part["meta"] == ("a", 3)
    assert part["scalar"].ndim == 0 and part["mask"].shape == (2,)
    assert IGNORE == -100  # the helpers' ignore index, used by the labels sliced above


def test_a_limit_in_tokens_survives_a_checkpoint_in_its_unit() -> None:
    tokens = SlicingLog(configured="auto", size=18, unit="tokens")
    restored = SlicingLog(configured="auto")
    restored.load_state_dict(tokens.state_dict())
    assert (restored.size, restored.unit) == (18, "tokens")
    restored.load_state_dict({**tokens.state_dict(), "unit": None})  # written before the unit was saved: samples
    assert (restored.size, restored.unit) == (18, "samples")
