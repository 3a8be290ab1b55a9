"""Lightning strategies that make ``accumulate_grad_batches`` exact, one module per engine over one base
(:class:`ExactAccumulation`); each class's docstring names its strategy strings (the DDP variants:
``lightning_accum.core.ddp.DDP_STRINGS``)."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_accum.strategies.base import CHECKPOINT_KEY, ExactAccumulation
from lightning_accum.strategies.ddp import DDPAccumulationStrategy
from lightning_accum.strategies.model_parallel import ModelParallelAccumulationStrategy
from lightning_accum.strategies.single import AccumulationStrategy

__all__ = [
    "CHECKPOINT_KEY",
    "AccumulationStrategy",
    "DDPAccumulationStrategy",
    "ExactAccumulation",
    "ModelParallelAccumulationStrategy",
    "register",
]


def register() -> None:
    """Register the strategy strings with Lightning's registry (done on ``import lightning_accum``)."""
    for strategy in (AccumulationStrategy, DDPAccumulationStrategy, ModelParallelAccumulationStrategy):
        strategy.register_strategies(StrategyRegistry)
