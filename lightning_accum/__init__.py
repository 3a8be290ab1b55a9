"""Exact, visible gradient accumulation for PyTorch Lightning.

Importing the package registers the strategy strings ``"accum"``, ``"accum_ddp"``,
``"accum_ddp_spawn"``, ``"accum_ddp_fork"``, ``"accum_ddp_notebook"`` and
``"accum_ddp_find_unused_parameters_true"`` with Lightning's strategy registry.

Example:
    >>> import lightning_accum
    >>> from lightning.pytorch.strategies import StrategyRegistry
    >>> "accum" in StrategyRegistry and "accum_ddp_spawn" in StrategyRegistry
    True
"""

from lightning_accum.callbacks import AccumulationCheck, AccumulationCheckError, AccumulationReport, AxisLogger
from lightning_accum.engine import AccumulationEngine
from lightning_accum.ledger import AccumulationLedger, GroupRecord
from lightning_accum.strategies import AccumulationStrategy, DDPAccumulationStrategy, _register
from lightning_accum.tokens import TokenWeightingWarning, causal_lm_tokens, seq2seq_tokens, supervised_tokens

__all__ = [
    "AccumulationCheck",
    "AccumulationCheckError",
    "AccumulationEngine",
    "AccumulationLedger",
    "AccumulationReport",
    "AccumulationStrategy",
    "AxisLogger",
    "DDPAccumulationStrategy",
    "GroupRecord",
    "TokenWeightingWarning",
    "causal_lm_tokens",
    "seq2seq_tokens",
    "supervised_tokens",
]

__version__ = "0.1.0"

_register()
