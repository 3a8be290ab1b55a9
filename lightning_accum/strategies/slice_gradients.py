"""Where a sliced loader batch's gradients go (``microbatch_size=``): kept aside across Lightning's ``zero_grad``, and a
backward that may run out of memory written into fresh tensors."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from lightning_accum.slicing import is_out_of_memory

__all__ = ["SliceGradients"]


class SliceGradients:
    """The optimized parameters' gradients while a loader batch runs as slices (docs/internals.md, "Slices inside
    Lightning's step")."""

    def __init__(self) -> None:
        self._parameters: list[Tensor] | None = None
        self._layout: tuple[int, ...] = ()
        self._pending: list[tuple[Tensor, Tensor]] | None = None

    def params(self, optimizers: Sequence[Any]) -> list[Tensor]:
        """The optimized parameters; rebuilt when a parameter group was added since (e.g. ``BackboneFinetuning``)."""
        layout = tuple(len(group["params"]) for optimizer in optimizers for group in optimizer.param_groups)
        if self._parameters is None or layout != self._layout:
            # Each parameter once, in the order the optimizers first hold it.
            by_id = {id(p): p for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]}
            self._parameters, self._layout = list(by_id.values()), layout
        return self._parameters

    def release(self, optimizers: Sequence[Any]) -> None:
        """Drop the previous group's gradients, before a group's first slice runs its backward."""
        for p in self.params(optimizers):
            p.grad = None

    def keep_aside(self, optimizers: Sequence[Any]) -> None:
        """Take the slices' gradients off the parameters until :meth:`install`."""
        params = self.params(optimizers)
        self._pending = [(p, p.grad) for p in params if p.grad is not None]
        for p in params:
            p.grad = None

    def install(self) -> None:
        """Put the gradients kept aside back, added to those the parameters hold."""
        pending, self._pending = self._pending, None
        for p, g in pending or ():
            p.grad = g if p.grad is None else p.grad.add_(g)

    def protected(self, optimizers: Sequence[Any], run: Callable[[], None]) -> BaseException | None:
        """Run a backward into fresh gradient tensors and add them to the accumulated ones only once it completed;
        ``None``, or the out-of-memory error (without its traceback; the accumulated gradients untouched)."""
        params = self.params(optimizers)
        held = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            run()
        except BaseException as error:
            for p, h in zip(params, held, strict=True):
                p.grad = h  # the partial gradient of the failed backward is dropped
            if is_out_of_memory(error):
                error.__traceback__ = None  # its frames hold the failed backward's graph
                return error
            raise
        for p, h in zip(params, held, strict=True):
            if h is None:
                continue
            fresh = p.grad
            if fresh is not None:
                h.add_(fresh)
            p.grad = h
        return None
