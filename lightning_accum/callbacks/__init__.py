"""Callbacks of ``lightning_accum``, re-exported at the package's top level (listed in docs/api.md)."""

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
