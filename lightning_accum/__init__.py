"""Exact, visible gradient accumulation for PyTorch Lightning.

Importing the package registers the strategy strings ``"accum"``, ``"accum_ddp"``,
``"accum_ddp_spawn"``, ``"accum_ddp_fork"``, ``"accum_ddp_notebook"``,
``"accum_ddp_find_unused_parameters_true"``, ``"accum_fsdp"`` and ``"accum_model_parallel"`` with Lightning's
strategy registry, and the same strings but the last one with Fabric's (``L.Fabric(strategy="accum")``; Fabric's
``"accum_fsdp"`` shards each block of every ``ModuleList`` and the root).

The modules, each with its one job, in the layers they import along: docs/internals.md ("One job per module").

Example:
    >>> import lightning_accum
    >>> from lightning.pytorch.strategies import StrategyRegistry
    >>> "accum" in StrategyRegistry and "accum_ddp_spawn" in StrategyRegistry
    True
"""

from lightning_accum.axis_lr import AxisLR, warmup_cosine, warmup_linear
from lightning_accum.batch_schedule import BatchSchedule
from lightning_accum.callbacks import (
    AccumulationCheck,
    AccumulationCheckError,
    AccumulationReport,
    AxisLogger,
    AxisProgressBar,
    AxisRichProgressBar,
    Horizon,
)
from lightning_accum.documents import document_mean_loss
from lightning_accum.engine import AccumulationEngine
from lightning_accum.evaluation_loss import EvaluationLoss, EvaluationRecord
from lightning_accum.fabric import (
    FabricAccumulationStrategy,
    FabricDDPAccumulationStrategy,
    FabricExactAccumulation,
    FabricModelParallelAccumulationStrategy,
    log_on_axis,
)
from lightning_accum.fabric import register as register_fabric
from lightning_accum.ledger import AccumulationLedger, GroupRecord
from lightning_accum.options import AccumulationOptions
from lightning_accum.sampler import GlobalOrderSampler
from lightning_accum.strategies import (
    AccumulationStrategy,
    DDPAccumulationStrategy,
    ExactAccumulation,
    ModelParallelAccumulationStrategy,
    register,
)
from lightning_accum.token_batches import TokenBatches, TokenBatchSampler
from lightning_accum.tokens import TokenWeightingWarning, causal_lm_tokens, seq2seq_tokens, supervised_tokens

__all__ = [
    "AccumulationCheck",
    "AccumulationCheckError",
    "AccumulationEngine",
    "AccumulationLedger",
    "AccumulationOptions",
    "AccumulationReport",
    "AccumulationStrategy",
    "AxisLR",
    "AxisLogger",
    "AxisProgressBar",
    "AxisRichProgressBar",
    "BatchSchedule",
    "DDPAccumulationStrategy",
    "EvaluationLoss",
    "EvaluationRecord",
    "ExactAccumulation",
    "FabricAccumulationStrategy",
    "FabricDDPAccumulationStrategy",
    "FabricExactAccumulation",
    "FabricModelParallelAccumulationStrategy",
    "GlobalOrderSampler",
    "GroupRecord",
    "Horizon",
    "ModelParallelAccumulationStrategy",
    "TokenBatchSampler",
    "TokenBatches",
    "TokenWeightingWarning",
    "causal_lm_tokens",
    "document_mean_loss",
    "log_on_axis",
    "seq2seq_tokens",
    "supervised_tokens",
    "warmup_cosine",
    "warmup_linear",
]

__version__ = "0.1.0"  # the one place the version is written: pyproject.toml reads it (setuptools `attr:`)

register()
register_fabric()
