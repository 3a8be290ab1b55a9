"""options: the options of exact accumulation validated once, a bad choice named with the valid ones."""

from __future__ import annotations

import pytest

import lightning_accum
from lightning_accum import AccumulationStrategy
from lightning_accum.engine import AccumulationEngine
from lightning_accum.options import validate_choice


def test_bad_choices_list_the_valid_ones() -> None:
    with pytest.raises(
        ValueError,
        match=r"`normalize` must be one of 'auto', 'tokens', 'samples', 'batches',"
        r" 'documents'; got 'x'",
    ):
        AccumulationEngine(normalize="x")
    with pytest.raises(ValueError, match=r"`partial_group` must be one of 'rescale', 'drop'; got 'keep'"):
        AccumulationEngine(partial_group="keep")
    with pytest.raises(TypeError, match=r"`count_tokens` must be a callable"):
        AccumulationEngine(count_tokens=3)  # type: ignore[arg-type]
    assert validate_choice("normalize", "tokens", ["tokens"]) == "tokens"


def test_strategy_argument_errors() -> None:
    with pytest.raises(
        ValueError, match=r"`normalize` must be one of 'auto', 'tokens', 'samples', 'batches', 'documents'; got 'mean'"
    ):
        AccumulationStrategy(normalize="mean")
    with pytest.raises(ValueError, match=r"`partial_group` must be one of 'rescale', 'drop'; got 'pad'"):
        lightning_accum.DDPAccumulationStrategy(partial_group="pad")
