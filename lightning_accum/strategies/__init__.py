"""Lightning strategies that make ``accumulate_grad_batches`` exact, one module per engine over one base.

- :class:`AccumulationStrategy` (``"accum"``): one device;
- :class:`DDPAccumulationStrategy` (``"accum_ddp"``, ``"accum_ddp_spawn"``, ``"accum_ddp_fork"``,
  ``"accum_ddp_notebook"``, ``"accum_ddp_find_unused_parameters_true"``): data-parallel replicas;
- :class:`ModelParallelAccumulationStrategy` (``"accum_fsdp"``, ``"accum_model_parallel"``): FSDP2 and tensor
  parallelism over a 2-D device mesh, ``D`` = the data-parallel size;
- :class:`ExactAccumulation`: the base both share, and the interface callbacks program against.
"""

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
