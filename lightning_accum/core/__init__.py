"""The core both doors build on: the engine adapters' interface, the group's close, the manual API and its rules, the
open-group checkpoint (its entry and how it is read). It imports torch and ``lightning.fabric`` at most: nothing here
imports ``lightning.pytorch`` or either door (``lightning_accum.strategies``, ``lightning_accum.fabric``);
``tests/test_layout.py`` checks it.
"""
