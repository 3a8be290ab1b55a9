"""How the package's callbacks take part in a fit: once per group, through the engine, not on every micro-batch.

:func:`attach` registers a callback's group listener with the strategy's engine and keeps Lightning from
dispatching the per-batch hooks the callback does not implement; :func:`detach` undoes both.

Lightning calls every hook of every callback, overridden or not, each inside a profiler context: four per micro-batch
and two per update for each callback, a few microseconds each on a cold CPU cache (measured for the two callbacks:
about 0.2 % of an update of the benchmark's small GPT at A = 8, 1.3 % of its tiny MLP's). Its dispatch loop
(``lightning.pytorch.trainer.call``) skips an attribute that is not callable, so during a fit the callbacks set the
per-batch hooks they do not implement to ``None`` on the instance (never a hook a subclass overrides) and remove
those attributes in ``teardown``.

Only done where the installed Lightning's dispatch loop is seen to skip a ``None`` hook (asked once, by calling it);
otherwise every hook is left as it is and costs what it costs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from lightning.pytorch import Callback, Trainer

#: Hooks Lightning calls once per batch or per update on every callback.
PER_BATCH_HOOKS: tuple[str, ...] = (
    "on_train_batch_start",
    "on_train_batch_end",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_validation_batch_start",
    "on_validation_batch_end",
)


@functools.cache
def _dispatch_skips_non_callables() -> bool:
    """Whether Lightning's callback dispatch skips a hook attribute that is ``None`` (asked of the installed
    Lightning once, with a callback whose hook is ``None`` and a minimal stand-in for the Trainer)."""
    from lightning.pytorch.profilers import PassThroughProfiler
    from lightning.pytorch.trainer import call

    probe = Callback()
    probe.on_train_batch_start = None  # type: ignore[assignment, method-assign]

    class _Trainer:
        def __init__(self) -> None:
            self.lightning_module = None
            self.callbacks = [probe]
            self.profiler = PassThroughProfiler()

    try:
        call._call_callback_hooks(_Trainer(), "on_train_batch_start", None, 0)  # type: ignore[arg-type]
    except Exception:
        return False
    return True


def silence_unused_hooks(callback: Callback) -> list[str]:
    """Set the per-batch hooks ``callback``'s class does not override to ``None`` on the instance; return their
    names (none where Lightning's dispatch would not skip them)."""
    if not _dispatch_skips_non_callables():
        return []
    silenced = [name for name in PER_BATCH_HOOKS if getattr(type(callback), name) is getattr(Callback, name)]
    for name in silenced:
        setattr(callback, name, None)
    return silenced


def restore_hooks(callback: Callback) -> None:
    """Undo :func:`silence_unused_hooks`."""
    for name in PER_BATCH_HOOKS:
        if callback.__dict__.get(name, 0) is None:
            del callback.__dict__[name]


def attach(callback: Callback, trainer: Trainer, listener: Callable[..., Any]) -> None:
    """In ``setup``: call ``listener`` after every group (see ``AccumulationEngine.add_listener``), and silence the
    per-batch hooks ``callback`` does not implement."""
    trainer.strategy.engine.add_listener(listener)  # type: ignore[attr-defined]
    silence_unused_hooks(callback)


def detach(callback: Callback, trainer: Trainer, listener: Callable[..., Any]) -> None:
    """In ``teardown``: undo :func:`attach`."""
    engine = getattr(trainer.strategy, "engine", None)
    if engine is not None:
        engine.remove_listener(listener)
    restore_hooks(callback)
