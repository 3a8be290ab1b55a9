"""The one way the package puts its own callable on an object it does not own, and gives it back."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["InstancePatch", "patched"]

_MISSING: Any = object()
# Every patch not yet released, to re-point one set above a patch released first (weak: a holder that is gone).
_ACTIVE: weakref.WeakSet[InstancePatch] = weakref.WeakSet()


class InstancePatch:
    """``owner.name`` replaced on the instance until :meth:`release` by ``replacement(below, *args, **kwargs)``,
    ``below`` the callable in force before (``wraps=False``: ``replacement(*args, **kwargs)``)."""

    def __init__(self, owner: Any, name: str, replacement: Callable[..., Any], wraps: bool = True) -> None:
        self.owner = owner
        self.name = name
        self._held = vars(owner).get(name, _MISSING)  # what the instance itself held (not the class's method)
        self.below: Callable[..., Any] = getattr(owner, name)
        self._active = True

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self._active:  # released under someone else's wrapper: a pass-through
                return self.below(*args, **kwargs)
            if wraps:
                return replacement(self.below, *args, **kwargs)
            return replacement(*args, **kwargs)

        self.wrapper = wrapper
        object.__setattr__(owner, name, wrapper)  # past `Module.__setattr__`, which has nothing to do with callables
        _ACTIVE.add(self)

    def release(self) -> None:
        """Give back what the instance held (once); under another's wrapper, become a pass-through."""
        if not self._active:
            return
        self._active = False
        _ACTIVE.discard(self)
        current = vars(self.owner).get(self.name, _MISSING)
        if current is self.wrapper:
            if self._held is _MISSING:
                vars(self.owner).pop(self.name, None)
            else:
                object.__setattr__(self.owner, self.name, self._held)
            return
        for above in list(_ACTIVE):
            if above.owner is self.owner and above.name == self.name and above.below is self.wrapper:
                above.below = self.below  # ours leaves the chain; the one above now wraps what ours wrapped
                if above._held is self.wrapper:
                    above._held = self._held
                return
        # Someone else's wrapper sits above ours and holds it: ours stays as a pass-through to what it wrapped.


@contextmanager
def patched(owner: Any, name: str, replacement: Callable[..., Any], wraps: bool = True) -> Iterator[InstancePatch]:
    """:class:`InstancePatch` for the block, released when it ends (an exception included)."""
    patch = InstancePatch(owner, name, replacement, wraps=wraps)
    try:
        yield patch
    finally:
        patch.release()
