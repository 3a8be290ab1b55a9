"""core/ddp: the DDP strategy strings, registered with their constructor arguments."""

from __future__ import annotations

import lightning_accum


def test_strategy_strings_are_registered() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    for name in (
        "accum",
        "accum_ddp",
        "accum_ddp_spawn",
        "accum_ddp_fork",
        "accum_ddp_notebook",
        "accum_ddp_find_unused_parameters_true",
    ):
        assert name in StrategyRegistry, name
    strategy = StrategyRegistry.get("accum_ddp_find_unused_parameters_true")
    assert isinstance(strategy, lightning_accum.DDPAccumulationStrategy)
    assert strategy._ddp_kwargs == {"find_unused_parameters": True}
