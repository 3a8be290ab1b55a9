"""Callbacks of ``lightning_accum``.

The logging (``AxisLogger``), run-record (``AccumulationReport``) and pre-flight
(``AccumulationCheck``) callbacks live here; they are added by the issues that deliver them and
re-exported at the package's top level.
"""

__all__: list[str] = []
