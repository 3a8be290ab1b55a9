"""lightning_accum.core.core: the core both doors compose, and the public seam both front classes take from it."""

from __future__ import annotations

import typing

import pytest
from torch import Tensor

from lightning_accum import AccumulationLedger, AccumulationStrategy, DDPAccumulationStrategy
from lightning_accum.core.core import CoreSeam
from lightning_accum.engine import AccumulationEngine
from lightning_accum.evaluation_loss import EvaluationLoss
from lightning_accum.fabric import FabricAccumulationStrategy, FabricExactAccumulation

#: What a type checker must see of the seam: each member's return type, never ``Any``.
SEAM = {
    "ledger": AccumulationLedger,
    "engine": AccumulationEngine,
    "data_parallel_replicas": int,
    "group_open": bool,
    "tensor_parallel_size": int,
    "reduce_sum": Tensor,
    "accumulate": Tensor,
    "add_group_listener": type(None),
    "remove_group_listener": type(None),
}


def _returns(owner: type, name: str) -> object:
    member = owner.__dict__[name]
    function = member.fget if isinstance(member, property) else member
    return typing.get_type_hints(function, globalns=vars(__import__(function.__module__, fromlist=["_"])))["return"]


@pytest.mark.parametrize("name", sorted(SEAM))
def test_the_seam_is_typed_for_type_checkers(name: str) -> None:
    # Real properties and methods on the one seam class (not members built by name at import): mypy and users' type
    # checkers see the types, and each front class of both doors inherits them.
    assert _returns(CoreSeam, name) == SEAM[name]
    for front in (AccumulationStrategy, DDPAccumulationStrategy, FabricAccumulationStrategy):
        assert getattr(front, name) is getattr(CoreSeam, name)


def test_the_manual_api_is_typed_and_written_once_for_both_doors() -> None:
    assert _returns(FabricExactAccumulation, "evaluation") == EvaluationLoss
    assert "num_tokens" in (CoreSeam.accumulate.__doc__ or "")
    assert "accumulate" not in vars(FabricExactAccumulation)  # the seam's, at both doors


def test_the_engine_takes_the_options_once_and_names_them_for_a_stray_keyword() -> None:
    # Issue #64: the options are written once (`AccumulationOptions`); the engine takes them by name and reads them
    # there (`engine.options`), with no list of its own to fall behind.
    engine = AccumulationEngine(normalize="tokens", partial_group="drop")
    assert (engine.options.normalize, engine.options.partial_group) == ("tokens", "drop")
    assert "normalize" not in vars(AccumulationEngine)
    with pytest.raises(
        TypeError,
        match=r"AccumulationEngine\(\) got an unexpected keyword argument 'normalise'\. It takes"
        r" the options of exact accumulation: normalize, count_tokens, .*global_order",
    ):
        AccumulationEngine(normalise="tokens")
    with pytest.raises(ValueError, match=r"`normalize` must be one of"):  # validated as every strategy's
        AccumulationEngine(normalize="words")
