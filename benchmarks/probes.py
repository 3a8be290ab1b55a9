"""The benchmarks' instrumentation: the time spent in the package's own code (the tests' probe of host reads,
``tests/host_reads.py``, is used by the benchmark too)."""

from __future__ import annotations

import functools
import inspect
import time
from typing import Any

import lightning as L

__all__ = ["PackageTimer"]


class PackageTimer:
    """Thread CPU time spent in this package's own code during a fit, exclusive of the Lightning work it wraps.

    Lightning calls into the package through the strategy's overrides and the callbacks' hooks. The timer wraps
    those (``package`` methods) and the Lightning methods they delegate to (``baseline`` methods: the ``super()``
    implementations and the optimizer closure, which run the model and the optimizer as in plain Lightning).
    Time is charged to whichever kind is innermost on the call stack, so ``package_ns`` is what the package adds:
    the engine's bookkeeping, the group close, the rescale, the guard, the logging and the report. It is an upper
    bound: the clock reads of the wrappers themselves (about a microsecond a call) are charged to it too.

    ``dispatch_of``: callback types whose *dispatch* by Lightning is charged to the package too. Lightning calls every
    hook of every callback, overridden or not, each inside a profiler context: that work exists only because the
    callbacks are there. While active, the timer replaces Lightning's ``_call_callback_hooks`` with an equivalent
    loop (same order, same ``_current_fx_name`` bookkeeping, same profiler actions) that charges the dispatch of
    those callbacks, from the profiler context to the return of the hook, to the package (``by_method`` key
    ``"<Class>.dispatch"``; the attribute look-up that finds a hook silenced is not charged, well under a
    microsecond).

    The wrappers' own work (clock reads and Python, a few microseconds per call on a cold cache) is charged to the
    package too. :meth:`calibrate`, called from a hook on every micro-batch, measures it in the same fit: what the
    timer charges for an empty package call (``bare_ns``) and for one that delegates to an empty Lightning call
    (``pair_ns``), per call; with the counts of package calls (``calls``) and of Lightning calls made from package
    code (``nested_calls``) this estimates the timer's share of ``package_ns`` (:meth:`own_cost_ns`).

    Used as a context manager around ``trainer.fit``; the patches are removed on exit.
    """

    def __init__(
        self,
        package: list[tuple[type, str]],
        baseline: list[tuple[type, str]],
        dispatch_of: tuple[type, ...] = (),
    ) -> None:
        self.package_ns = 0
        #: ``package_ns`` split by the innermost wrapped package method (``Class.method``).
        self.by_method: dict[str, int] = {}
        self.calls = 0
        self.nested_calls = 0
        self.bare_ns = 0
        self.pair_ns = 0
        self.calibrations = 0

        def empty() -> None:
            return None

        inner = self._wrap(empty, is_package=False)

        def pair() -> None:
            inner()

        self._bare = self._wrap(empty, is_package=True, name="calibration.bare")
        self._pair = self._wrap(pair, is_package=True, name="calibration.pair")
        self._targets = [(cls, name, True) for cls, name in package] + [(cls, name, False) for cls, name in baseline]
        self._saved: list[tuple[type, str, Any]] = []
        self._stack: list[tuple[bool, str]] = []
        self._last = 0
        self._dispatch_of = dispatch_of
        self._saved_dispatch: Any = None

    @classmethod
    def for_strategy(
        cls, strategy_type: type, callback_types: list[type], parts: list[tuple[type, str]] | None = None
    ) -> PackageTimer:
        """Wrap every method ``strategy_type`` overrides below Lightning and every hook of ``callback_types``.

        ``parts``: package methods called from those, to be charged separately in :attr:`by_method` (e.g. the
        rescale inside ``optimizer_step``, or a callback's group listener).
        """
        from lightning.pytorch.loops.optimization.automatic import Closure
        from lightning.pytorch.strategies import Strategy

        package: list[tuple[type, str]] = []
        # Lightning's work that the package calls: the closure (model and backward) and a schedule's step (which the
        # strategy advances where plain Lightning would).
        baseline: list[tuple[type, str]] = [(Closure, "__call__"), (L.LightningModule, "lr_scheduler_step")]
        mro = strategy_type.__mro__
        lightning_start = next(i for i, klass in enumerate(mro) if klass.__module__.startswith("lightning."))
        for klass in mro[:lightning_start]:
            for name in _methods(klass):
                # Entry points only (what Lightning calls): wrapping the package's private helpers too would add the
                # timer's own clock reads to every helper call.
                base = next((k for k in mro[lightning_start:] if name in vars(k)), None)
                if base is None or not issubclass(base, Strategy):
                    continue
                package.append((klass, name))
                if (base, name) not in baseline:
                    baseline.append((base, name))
        for klass in callback_types:
            package += [(klass, name) for name in _methods(klass) if hasattr(L.Callback, name)]
        package += parts or []
        return cls(package, baseline, dispatch_of=tuple(callback_types))

    def _switch(self) -> None:
        now = time.thread_time_ns()
        if self._stack and self._stack[-1][0]:
            name = self._stack[-1][1]
            if name.startswith("calibration."):
                self.by_method[name] = self.by_method.get(name, 0) + now - self._last
            else:
                self.package_ns += now - self._last
                self.by_method[name] = self.by_method.get(name, 0) + now - self._last
        self._last = now

    def _wrap(self, function: Any, is_package: bool, name: str | None = None) -> Any:
        timer = self
        entry = (is_package, name or function.__qualname__)

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            timer._switch()
            if not is_package and timer._stack and timer._stack[-1][0]:
                timer.nested_calls += 1
            timer._stack.append(entry)
            timer.calls += is_package
            try:
                return function(*args, **kwargs)
            finally:
                timer._switch()
                timer._stack.pop()

        return wrapper

    def calibrate(self) -> None:
        """Measure the timer's own cost once: an empty package call, and one that makes an empty Lightning call."""
        calls, nested = self.calls, self.nested_calls
        first, second = (self._bare, self._pair) if self.calibrations % 2 else (self._pair, self._bare)
        first()  # alternated: the first of the two runs on the colder cache
        second()
        self.calls, self.nested_calls = calls, nested  # not the package's calls
        self.calibrations += 1
        self.bare_ns = self.by_method.get("calibration.bare", 0)
        self.pair_ns = self.by_method.get("calibration.pair", 0)

    def own_cost_ns(self, calls: int, nested_calls: int) -> float:
        """The timer's estimated share of the package time charged over ``calls`` package calls that made
        ``nested_calls`` Lightning calls."""
        if not self.calibrations:
            return 0.0
        bare = self.bare_ns / self.calibrations
        pair = self.pair_ns / self.calibrations
        return calls * bare + nested_calls * max(pair - bare, 0.0)

    def __enter__(self) -> PackageTimer:
        for cls, name, is_package in self._targets:
            original = vars(cls)[name]
            self._saved.append((cls, name, original))
            setattr(cls, name, self._wrap(original, is_package))
        if self._dispatch_of:
            from lightning.pytorch.trainer import call

            self._saved_dispatch = call._call_callback_hooks
            call._call_callback_hooks = self._call_callback_hooks
        return self

    def __exit__(self, *exc: Any) -> None:
        for cls, name, original in reversed(self._saved):
            setattr(cls, name, original)
        self._saved = []
        if self._saved_dispatch is not None:
            from lightning.pytorch.trainer import call

            call._call_callback_hooks = self._saved_dispatch
            self._saved_dispatch = None

    def _call_callback_hooks(
        self, trainer: Any, hook_name: str, *args: Any, monitoring_callbacks: bool | None = None, **kwargs: Any
    ) -> None:
        """Lightning 2.6's ``trainer.call._call_callback_hooks``, with the dispatch of ``dispatch_of`` timed."""
        from lightning.pytorch.callbacks import Checkpoint, EarlyStopping

        pl_module = trainer.lightning_module
        if pl_module:
            prev_fx_name = pl_module._current_fx_name
            pl_module._current_fx_name = hook_name
        callbacks = trainer.callbacks
        if monitoring_callbacks is True:
            callbacks = [cb for cb in callbacks if isinstance(cb, (EarlyStopping, Checkpoint))]
        elif monitoring_callbacks is False:
            callbacks = [cb for cb in callbacks if not isinstance(cb, (EarlyStopping, Checkpoint))]
        for callback in callbacks:
            fn = getattr(callback, hook_name)
            if not callable(fn):
                continue
            # From here on Lightning's work exists because the callback is there: charged to the package.
            timed = isinstance(callback, self._dispatch_of)
            if timed:
                self._switch()
                self._stack.append((True, f"{type(callback).__name__}.dispatch"))
                self.calls += 1
            try:
                with trainer.profiler.profile(f"[Callback]{callback.state_key}.{hook_name}"):
                    fn(trainer, trainer.lightning_module, *args, **kwargs)
            finally:
                if timed:
                    self._switch()
                    self._stack.pop()
        if pl_module:
            pl_module._current_fx_name = prev_fx_name


def _methods(klass: type) -> list[str]:
    """Names of the plain methods ``klass`` defines itself (no dunders, properties, static or class methods)."""
    return [
        name
        for name, value in vars(klass).items()
        if inspect.isfunction(value) and not (name.startswith("__") and name.endswith("__"))
    ]
