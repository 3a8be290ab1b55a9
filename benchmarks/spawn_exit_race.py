"""A deterministic reproduction of the crash of issue 23: a gloo thread that needs the GIL while a worker exits.

The crash at the end of 2-process spawn runs ("terminate called without an active exception", then
``ProcessExitedException: process 1 terminated with signal SIGABRT``) is rare in real runs because it needs an
unlucky schedule. This script forces that schedule in plain torch, no Lightning:

1. rank 1 starts an asynchronous ``all_reduce`` of a tensor created in Python and drops its handles (gloo's work
   thread now holds the tensor), then its worker function returns and the process begins to exit;
2. rank 1's last exit callback is a C function that holds the GIL for a while (``sum(range(n))``), so the work
   thread, which needs the GIL to release the tensor's Python object (``TensorImpl::decref_pyobject``) once the
   collective completes, waits for the GIL across the start of interpreter finalization;
3. rank 0 joins the collective only once rank 1 is inside that callback.

When the work thread finally gets the GIL, CPython (3.13 and older) ends it with ``pthread_exit``, whose forced
unwinding through the work object's ``noexcept`` destructor calls ``std::terminate``. The faulting thread's stack
(gdb on the core file): ``abort ← std::terminate ← __gxx_personality_v0 ← _Unwind_ForcedUnwind ← pthread_exit ←
PyThread_exit_thread ← take_gil ← PyEval_AcquireThread ← pybind11::gil_scoped_acquire ←
ConcretePyInterpreterVTable::decref ← c10::TensorImpl::decref_pyobject ← ~vector<vector<Tensor>> ←
ProcessGroupGloo::AsyncWork::~AsyncWork ← ProcessGroupGloo::runLoop``.

``--mode close`` ends each worker with :func:`lightning_accum._worker_exit.close_process_group` (what the
package's spawn launcher does): the barrier waits for the collective, the process group is destroyed and its
threads are joined while the interpreter is alive, and the run ends cleanly.

Usage::

    python benchmarks/spawn_exit_race.py --mode exit --runs 3    # crashes every time (Python <= 3.13)
    python benchmarks/spawn_exit_race.py --mode close --runs 3   # no crash

Prints one JSON object: ``{"mode": ..., "runs": n, "sigabrt": k, "terminate_message": k, "other": k}``.
"""

from __future__ import annotations

import argparse
import atexit
import json
import multiprocessing.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TERMINATE = "terminate called without an active exception"

if os.environ.get("SPAWN_EXIT_RACE_CHILD"):
    # Registered first, so it runs last among the exit callbacks (``_bootstrap`` has already run the one of
    # multiprocessing, which would otherwise run after it and hand the GIL over in time).
    atexit.unregister(multiprocessing.util._exit_function)
    atexit.register(sum, range(int(os.environ.get("SPAWN_EXIT_RACE_SUM", "100000000"))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def _worker(rank: int, port: int, mode: str, flag: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    dist.barrier()
    if rank == 1:
        tensor = torch.ones(4)
        work = dist.all_reduce(tensor, async_op=True)
        del tensor, work  # gloo's work thread holds the tensor now
        # Runs just before the GIL-holding callback (exit callbacks run last-registered first).
        atexit.register(lambda: Path(flag).write_text("exiting"))
    else:
        deadline = time.monotonic() + 120
        while mode == "exit" and not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # rank 1 is inside the callback that holds the GIL
        dist.all_reduce(torch.ones(4))
        if mode == "exit":
            time.sleep(2.0)  # stay alive while rank 1 exits
    if mode == "close":
        from lightning_accum._worker_exit import close_process_group

        class _Plain:  # close_process_group only needs a `barrier`
            def barrier(self, name: str) -> None:
                dist.barrier()

        close_process_group(_Plain())


def _one(mode: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flag = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"spawn-exit-race-{os.getpid()}")
    os.environ["SPAWN_EXIT_RACE_CHILD"] = "1"
    try:
        mp.spawn(_worker, args=(port, mode, flag), nprocs=2)
        print("RESULT ok", flush=True)
    except Exception as exc:
        print(f"RESULT {type(exc).__name__}: {exc}", flush=True)
    finally:
        if os.path.exists(flag):
            os.remove(flag)


def run(mode: str, runs: int, timeout: float = 300.0) -> dict[str, object]:
    """Runs ``runs`` fresh 2-process launches in ``mode`` (``exit`` or ``close``) and counts the crashes."""
    counts = {"mode": mode, "runs": runs, "sigabrt": 0, "terminate_message": 0, "other": 0}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    for _ in range(runs):
        done = subprocess.run(
            [sys.executable, __file__, "--one", mode], capture_output=True, text=True, timeout=timeout, env=env
        )
        text = done.stdout + done.stderr
        result = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
        counts["terminate_message"] += TERMINATE in text  # type: ignore[operator]
        if result and "SIGABRT" in result[-1]:
            counts["sigabrt"] += 1  # type: ignore[operator]
        elif not result or result[-1] != "RESULT ok":
            counts["other"] += 1  # type: ignore[operator]
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("exit", "close"), default="exit")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--one", choices=("exit", "close"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        _one(args.one)
        return 0
    print(json.dumps(run(args.mode, args.runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
