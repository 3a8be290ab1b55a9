"""Callbacks of ``lightning_accum``, re-exported at the package's top level.

- :class:`AxisLogger`: every curve of the run on a tokens, samples or updates axis;
- :class:`AccumulationReport`: the final record of a run (JSON, console table, TensorBoard text);
- :class:`AccumulationCheck`: a pre-flight check of one update against the same examples in one batch;
- :class:`Horizon`: stop, validate and checkpoint at counts of tokens, samples or applied updates;
- :class:`AxisProgressBar` (TQDM) and :class:`AxisRichProgressBar` (Rich): progress on the run's axis against the
  budget, or plain lines outside a terminal.
"""

from lightning_accum.callbacks.axis_logger import AxisLogger
from lightning_accum.callbacks.check import AccumulationCheck, AccumulationCheckError
from lightning_accum.callbacks.horizon import Horizon
from lightning_accum.callbacks.progress import AxisProgressBar, AxisRichProgressBar
from lightning_accum.callbacks.report import AccumulationReport

__all__ = [
    "AccumulationCheck",
    "AccumulationCheckError",
    "AccumulationReport",
    "AxisLogger",
    "AxisProgressBar",
    "AxisRichProgressBar",
    "Horizon",
]
