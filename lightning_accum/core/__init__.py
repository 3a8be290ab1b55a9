"""The core both doors build on: the engine adapters' interface, the group's close, the manual API and its rules, the
open-group checkpoint. It imports torch and ``lightning.fabric`` at most, never ``lightning.pytorch`` or either door
(``tests/project/test_layout.py`` checks it).
"""
