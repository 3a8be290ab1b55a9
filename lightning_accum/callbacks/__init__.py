"""Callbacks of ``lightning_accum``, re-exported at the package's top level.

- :class:`AxisLogger`: every curve of the run on a tokens, samples or updates axis.
"""

from lightning_accum.callbacks.axis_logger import AxisLogger

__all__ = ["AxisLogger"]
