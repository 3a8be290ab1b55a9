"""Keep Lightning from dispatching per-batch hooks that the package's callbacks do not implement.

Lightning calls every hook of every callback, overridden or not, each inside a profiler context: four per micro-batch
and two per update for each callback, about 5 µs each on a CPU core (measured: 0.5 % of an update of the small GPT of
the benchmark at A = 8 for the two callbacks). Its dispatch loop (``lightning.pytorch.trainer.call``) skips an
attribute that is not callable, so during a fit the callbacks set the per-batch hooks they do not implement to
``None`` on the instance (never a hook a subclass overrides) and remove those attributes in ``teardown``.

Only done where the installed Lightning's dispatch loop is seen to skip non-callable attributes; otherwise every hook
is left as it is and costs what it costs.
"""

from __future__ import annotations

import functools
import inspect

from lightning.pytorch import Callback

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
    try:
        from lightning.pytorch.trainer import call

        source = inspect.getsource(call._call_callback_hooks)
    except (ImportError, AttributeError, OSError, TypeError):
        return False
    return "if callable(fn):" in source


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
