"""The fork server of the multi-process tests, started once when the session starts.

The workers of multi-process tests (`helpers.run_ddp`, `helpers.forked_ddp()` and the strategies built with
`start_method="forkserver"`) are forked by Python's fork server: a process started clean, as a spawned one is, that
imports `helpers.PRELOADED` once and holds no thread when it forks. A spawned worker imports torch and Lightning anew,
about 6 s of a core each (3 s of them transformers, which torchmetrics imports when it is installed); a forked one
starts in a fraction of a second: tests/strategies/test_ddp_agreement.py and tests/strategies/test_model_parallel.py
took 58 s spawned and 19 s forked (2026-12-03).

A forked worker has the server's environment and random state, not the test's. So the server starts here
(`fork_server`), before any test has changed the environment, and the tests whose workers draw random numbers keep
Lightning's spawn launcher (which gives its workers the main process's random state), as do the tests of the spawn
launcher itself (`"accum_ddp_spawn"`, `start_method="spawn"`).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver

import pytest
from helpers import PRELOADED


@pytest.fixture(scope="session", autouse=True)
def fork_server() -> None:
    """Starts the fork server before the first test, with pytest's capture of the output already in place, so that
    what the forked workers print is captured with the test that runs them, as a spawned worker's is."""
    multiprocessing.set_forkserver_preload(PRELOADED)
    multiprocessing.forkserver.ensure_running()
