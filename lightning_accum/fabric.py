"""Exact accumulation in Lightning Fabric loops: the strategy strings ``"accum"``, ``"accum_ddp"`` and its launch
variants in Fabric's registry, with the Trainer's manual API under the same names.

A Fabric loop writes its own accumulation (LitGPT's ``finetune`` and ``pretrain`` scripts are such loops). With an
accumulation strategy it reports each micro-batch and closes each group, and everything else stays Fabric's::

    fabric = L.Fabric(strategy="accum_ddp", devices=2)
    model, optimizer = fabric.setup(model, optimizer)
    for i, batch in enumerate(loader):
        last = (i + 1) % A == 0
        with fabric.no_backward_sync(model, enabled=not last):       # Fabric's own: DDP's no_sync on non-final ones
            loss = loss_fn(model(batch["input_ids"]), batch["labels"])  # the micro-batch's mean over its tokens
            fabric.backward(fabric.strategy.accumulate(loss, num_tokens=supervised_tokens(batch["labels"])))
        if last:
            record = fabric.strategy.close_group(optimizer)  # one all-reduce, the rescale by c · D / W, the decision
            optimizer.step()                                   # applied, or skipped (the GradScaler, a NaN, no token)
            optimizer.zero_grad()

The arithmetic is the Trainer's, composed of the same parts: one :class:`~lightning_accum.engine.AccumulationEngine`,
:class:`~lightning_accum.strategies.closing.GroupClosing`, :class:`~lightning_accum.strategies.manual.ManualGroups`,
:class:`~lightning_accum.strategies.checkpoint.OpenGroupCheckpoint`, and the engine adapters of
:mod:`~lightning_accum.strategies.adapter` (one device) and :class:`~lightning_accum.strategies.ddp.DDPAdapter`.
:class:`FabricExactAccumulation` is the one package layer between each public Fabric strategy and Fabric's class,
as :class:`~lightning_accum.ExactAccumulation` is for the Trainer's.

* ``fabric.strategy.accumulate(loss, num_tokens=..., num_samples=..., batch=..., group_size=...)`` records a
  micro-batch and returns ``loss · w / c`` for ``fabric.backward`` (exactly that tensor, before the next call);
* ``fabric.strategy.close_group(optimizer)`` closes the group right before ``optimizer.step()``; its
  :class:`~lightning_accum.GroupRecord` is final once the step ran (``applied``, ``skip_reason``, ``grad_scale``);
* ``fabric.strategy.ledger``: the exact, global counters;
* ``fabric.save(path, state)`` writes the ledger and, inside a group, the group (its counters and its gradient, summed
  over the replicas) under ``"lightning_accum"`` beside the user's state; ``fabric.load(path, state)`` restores them,
  so that a loop resumed mid-group (at the micro-batch after the one it saved at) closes the group exactly. A damaged
  entry is refused as in the Trainer.

Schedules follow applied updates when they are stepped after an applied update only (``if record.applied:
scheduler.step()``), or when they are :class:`~lightning_accum.AxisLR`: passed to ``fabric.setup(..., scheduler=s)``
(or bound with ``s.bind(fabric.strategy.engine)``) it counts what each applied update consumed, and may be stepped
after every ``optimizer.step()``. :func:`log_on_axis` logs on the run's axis.

Fabric's ``ModelParallelStrategy`` has no strategy string (it needs a ``parallelize_fn``): FSDP2 and tensor-parallel
accumulation are the Trainer's (``"accum_fsdp"``, ``"accum_model_parallel"``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy, SingleDeviceStrategy, Strategy
from lightning.fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.fabric.wrappers import is_wrapped
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_accum._worker_exit import close_process_group
from lightning_accum.axis_lr import AxisLR
from lightning_accum.decision import GroupListener
from lightning_accum.engine import AccumulationEngine
from lightning_accum.ledger import AccumulationLedger, GroupRecord
from lightning_accum.microbatch import Count
from lightning_accum.options import AccumulationOptions
from lightning_accum.strategies.adapter import EngineAdapter, NamedParameters
from lightning_accum.strategies.checkpoint import CHECKPOINT_KEY, OpenGroupCheckpoint
from lightning_accum.strategies.closing import GroupClosing, enabled_scaler
from lightning_accum.strategies.ddp import DDP_STRINGS, DDPAdapter
from lightning_accum.strategies.manual import ManualGroups
from lightning_accum.strategies.reading import read_checkpoint
from lightning_accum.strategies.single import the_one_device

__all__ = [
    "FabricAccumulationStrategy",
    "FabricDDPAccumulationStrategy",
    "FabricExactAccumulation",
    "log_on_axis",
    "register",
]

_Path = str | Path


class FabricExactAccumulation(Strategy):
    """The public base of the Fabric accumulation strategies: the Fabric hooks they change, and the manual API.

    Listed first in a strategy's bases, so that ``super()`` is Fabric's single-device or DDP strategy. Loops program
    against it: :meth:`accumulate`, :meth:`close_group`, :attr:`ledger`, :attr:`engine`,
    :attr:`data_parallel_replicas`, :meth:`add_group_listener`; what differs per engine is the adapter of the class
    named in :attr:`adapter_type`, as in the Trainer's strategies.
    """

    #: The class of this strategy's :class:`~lightning_accum.strategies.adapter.EngineAdapter`.
    adapter_type: ClassVar[type[EngineAdapter]] = EngineAdapter

    def _init_accumulation(self, options: AccumulationOptions) -> None:
        """Set up the parts from the options the constructor validated (before Fabric's ``__init__``)."""
        self._adapter = self.adapter_type(self)
        self._engine = AccumulationEngine.from_options(options)
        self._engine.bind(info=rank_zero_info, warn=rank_zero_warn)
        self._closing = GroupClosing(local=self._adapter.local_gradient)
        self._manual = ManualGroups()
        self._checkpoint = OpenGroupCheckpoint()
        self._modules: list[Module] = []  # what `fabric.setup` was given, unwrapped: the named parameters
        self._optimizers: list[Optimizer] = []

    # ------------------------------------------------------------------ the public interface

    @property
    def ledger(self) -> AccumulationLedger:
        """Exact global counters of the loop (identical on every rank); see :class:`AccumulationLedger`."""
        return self._engine.ledger

    @property
    def engine(self) -> AccumulationEngine:
        """The object that does the arithmetic and holds the options given to the strategy."""
        return self._engine

    @property
    def data_parallel_replicas(self) -> int:
        """``D``: the number of replicas that see different data and whose gradients are averaged."""
        return self._adapter.data_parallel_size

    def reduce_sum(self, tensor: Tensor) -> Tensor:
        """Sum ``tensor`` in place over the data-parallel replicas (a collective when ``D > 1``); return it."""
        return self._adapter.reduce_sum(tensor)

    @property
    def gradient_scaler(self) -> torch.amp.GradScaler | None:
        """The enabled GradScaler of the precision plugin (``precision="16-mixed"``), or ``None``."""
        return enabled_scaler(self.precision)

    def add_group_listener(self, listener: GroupListener) -> None:
        """Call ``listener(record, batch_samples)`` after every closed group (applied, skipped or dropped)."""
        self._engine.decisions.add_listener(listener)

    def remove_group_listener(self, listener: GroupListener) -> None:
        """Stop calling ``listener``."""
        self._engine.decisions.remove_listener(listener)

    def accumulate(
        self,
        loss: Tensor,
        num_tokens: Count | None = None,
        num_samples: Count | None = None,
        batch: Any = None,
        group_size: int | None = None,
    ) -> Tensor:
        """Record one micro-batch in the open group; return the tensor to pass to ``fabric.backward``.

        The same call as the Trainer's :meth:`ExactAccumulation.accumulate <lightning_accum.ExactAccumulation.
        accumulate>`: ``loss`` is the micro-batch's mean over its units, ``num_tokens`` its supervised tokens (an int
        or a 0-d integer tensor; ``None``: the strategy's ``count_tokens`` reads ``batch``), ``num_samples`` its
        samples (``None``: inferred from ``batch``), ``group_size`` the micro-batches per update you plan (it only
        sets the magnitude of what is back-propagated, never the update).

        Raises:
            RuntimeError: While a closed group waits for its ``optimizer.step()``, or while the tensor the previous
                call returned was never back-propagated.
            TypeError: ``loss`` is not a tensor.
        """
        counts = {"num_tokens": num_tokens, "num_samples": num_samples}
        return self._manual.accumulate(self._engine, loss, counts, batch, group_size, self.data_parallel_replicas)

    def close_group(self, optimizer: Optimizer, group_size: int | None = None) -> GroupRecord:
        """Close the group reported with :meth:`accumulate`, right before ``optimizer.step()``.

        One all-reduce of the group's counts, the rescale of ``optimizer``'s gradients by ``c · D / W`` and the
        decision. Then ``optimizer.step()`` updates (unless a GradScaler finds an overflow) or, for a group that makes
        no update (a NaN/Inf gradient without a scaler, no unit at all), does nothing; either way the group is in
        :attr:`ledger` and the listeners are called.

        ``group_size``: the micro-batches per replica a group holds; a group closed with fewer (the end of the data)
        is a partial group, rescaled with its real denominator or dropped by ``partial_group=``, and counted in
        ``ledger.partial_groups`` (``None``: every group is complete).

        Returns:
            The group's record; ``applied`` and ``skip_reason`` are final once ``optimizer.step()`` returned.

        Raises:
            ValueError: ``group_size`` is not a positive int, or smaller than the micro-batches reported.
            RuntimeError: With no micro-batch reported since the last close, while the previous group's
                ``optimizer.step()`` has not run, or while the tensor the last :meth:`accumulate` returned was never
                back-propagated.
        """
        inner = optimizer.optimizer if is_wrapped(optimizer) else optimizer  # type: ignore[attr-defined]
        self._install_carried()
        module = self._modules[0] if self._modules else None
        return self._manual.close(self._engine, self._closing, inner, module, self.gradient_scaler, group_size)

    # ------------------------------------------------------------------ Fabric's hooks

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        # The processes exist now (DDP's process group): the engine sums its groups over the adapter's replicas.
        self._engine.bind(self.root_device, self._adapter.replicas())

    @override
    def setup_module_and_optimizers(self, module: Module, optimizers: list[Optimizer], *scheduler: Any) -> Any:
        # `fabric.setup(..., scheduler=s)` hands the scheduler on (Fabric 2.6; Fabric 2.5 has no such argument).
        if scheduler and isinstance(scheduler[0], AxisLR):
            scheduler[0].bind(self._engine)  # it counts what each applied update consumed
        return super().setup_module_and_optimizers(module, optimizers, *scheduler)

    @override
    def setup_module(self, module: Module) -> Any:  # Module, or the engine's wrapper of it (DDP)
        self._modules.append(module)
        # Bound again: a one-device loop need not call `fabric.launch()`, which sets the environment up.
        self._engine.bind(self.root_device, self._adapter.replicas())
        return super().setup_module(module)

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        self._optimizers.append(optimizer)
        return super().setup_optimizer(optimizer)

    @override
    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        self._install_carried()
        # The tensor `accumulate` handed out: the open group notes when its gradient holds that micro-batch.
        ours = self._manual.is_handed_out(tensor)
        if ours:
            self._engine.take_backward_tensor()
        super().backward(tensor, module, *args, **kwargs)
        if ours:
            self._engine.backward_finished()

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        closure: Callable[[], Any] = kwargs.get("closure") or (lambda: None)
        return self._manual.optimizer_step(
            self._engine,
            self._closing,
            optimizer,
            closure,
            self.gradient_scaler,
            lambda: super(FabricExactAccumulation, self).optimizer_step(optimizer, **kwargs),
        )

    @override
    def save_checkpoint(
        self,
        path: _Path,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        if CHECKPOINT_KEY in state:
            raise ValueError(
                f"`fabric.save(path, state)`: the state holds a key {CHECKPOINT_KEY!r}, which the accumulation strategy"
                " writes itself (the ledger and an open group). Rename your entry."
            )
        parameters = self._parameters()
        entry = self._checkpoint.entry(
            self._engine,
            self._configuration(),
            running=None,
            failed=None,
            carry=lambda: self._adapter.carry_gradients(parameters),
            parameter_names=[name for name, _ in parameters],
        )
        super().save_checkpoint(path, {**state, CHECKPOINT_KEY: entry}, storage_options, filter)

    @override
    def load_checkpoint(
        self,
        path: _Path,
        state: Module | Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        load = super().load_checkpoint
        # Fabric 2.5 has no `weights_only` (and never passes it): its method is called as it is declared there.
        read = (
            (lambda: load(path, state, strict))
            if weights_only is None
            else (lambda: load(path, state, strict, weights_only))
        )
        remainder: dict[str, Any] = read_checkpoint(read, path)
        if not isinstance(state, Mapping) or not state:
            return remainder  # no loop state to restore: the checkpoint is returned as it is, the entry included
        entry = self._checkpoint.load(self._engine, remainder, str(path))
        remainder.pop(CHECKPOINT_KEY, None)
        # The loop resumes where it saved: the open group continues with the next micro-batch. Its places already
        # done, for the partial-group test of `close_group(group_size=)`, are the carried micro-batches per replica
        # of this run (the written count per replica when the number of replicas is the same).
        group = (entry or {}).get("open_group") or {}
        total = int(group.get("total_microbatches", int(group.get("microbatches", 0)) * int(group.get("replicas", 1))))
        position = total // max(1, self.data_parallel_replicas)
        holds = self._adapter.holds_group_sums()
        self._checkpoint.reopen(self._engine, self._configuration(), position, holds, self._parameters())
        return remainder

    @override
    def teardown(self) -> None:
        self._adapter.teardown()
        self._closing.reset()
        self._manual.reset()
        self._modules, self._optimizers = [], []
        super().teardown()

    # ------------------------------------------------------------------ parts of the hooks

    def _install_carried(self) -> None:
        """A group resumed from a checkpoint: its gradient is added before the loop's first backward (or close)."""
        if self._checkpoint.carried is not None:
            self._checkpoint.install(self._adapter.carried_part)

    def _parameters(self) -> NamedParameters:
        """The optimized parameters by name (a second module's names prefixed by its place in ``fabric.setup``)."""
        optimized = {id(p) for o in self._optimizers for group in o.param_groups for p in group["params"]}
        named: NamedParameters = []
        for index, module in enumerate(self._modules):
            prefix = f"{index}." if len(self._modules) > 1 else ""
            named += [(prefix + name, p) for name, p in module.named_parameters() if id(p) in optimized]
        return named

    def _configuration(self) -> dict[str, Any]:
        """What the checkpoint's groups depend on (a Fabric loop has no ``A`` the strategy knows)."""
        return {
            "strategy": type(self).__name__,
            "replicas": int(self.data_parallel_replicas),
            "normalize": self._engine.normalize,
            "partial_group": self._engine.partial_group,
        }


class FabricAccumulationStrategy(FabricExactAccumulation, SingleDeviceStrategy):
    """Exact accumulation in a Fabric loop on one device (``L.Fabric(strategy="accum")``).

    Args:
        normalize, count_tokens, partial_group, schedule_on, on_nonfinite, max_consecutive_skips: The options of
            exact accumulation, documented once in :class:`~lightning_accum.options.AccumulationOptions`
            (``partial_group`` and ``schedule_on`` are the loop's to apply in Fabric: the loop decides when a group
            closes and when a scheduler steps).
        device: The device; by default the one Fabric's accelerator selects.
        **kwargs: Passed to Fabric's ``SingleDeviceStrategy``.

    Example:
        >>> import lightning as L
        >>> import lightning_accum
        >>> fabric = L.Fabric(strategy="accum", accelerator="cpu")
        >>> type(fabric.strategy).__name__, fabric.strategy.data_parallel_replicas
        ('FabricAccumulationStrategy', 1)
    """

    def __init__(
        self,
        normalize: str = "auto",
        count_tokens: Callable[[Any], Count] | None = None,
        partial_group: str = "rescale",
        schedule_on: str = "applied",
        on_nonfinite: str = "skip",
        max_consecutive_skips: int | None = 100,
        device: str | torch.device | None = None,
        **kwargs: Any,
    ) -> None:
        self._init_accumulation(AccumulationOptions.pick(locals()))
        super().__init__(device=device if device is not None else "cpu", **kwargs)
        self._device_given = device is not None

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        """The device chosen by Fabric when none was given (read by Fabric's connector)."""
        return [self.root_device] if self._device_given else None

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        device = the_one_device(devices, "Fabric")
        if device is not None:
            self._root_device = device  # SingleDeviceStrategy's own (see docs/internals.md)
            self._device_given = True

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "accum", cls, description="Exact gradient accumulation in a Fabric loop on one device", override=True
        )


class _ClosingLauncher(_MultiProcessingLauncher):
    """Fabric's spawn/fork launcher, closing the process group in each worker once the launched function has returned
    (the end of a spawned worker with a live gloo group can abort it: see :mod:`lightning_accum._worker_exit`)."""

    @override
    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        super()._wrapping_function(*args, **kwargs)
        close_process_group(self._strategy)


class FabricDDPAccumulationStrategy(FabricExactAccumulation, DDPStrategy):
    """Exact accumulation in a Fabric loop across data-parallel replicas (``L.Fabric(strategy="accum_ddp")`` and
    ``"accum_ddp_spawn"``, ``"accum_ddp_fork"``, ``"accum_ddp_notebook"``, ``"accum_ddp_find_unused_parameters_true"``).

    Every micro-batch but a group's last runs inside Fabric's ``fabric.no_backward_sync(model, enabled=...)``; the
    close all-reduces the group's counts once and rescales the averaged gradient by ``c · D / W``, so the update is
    the token-weighted mean over every replica's micro-batches. Every replica reports the same number of micro-batches
    per group.

    Args:
        normalize, count_tokens, partial_group, schedule_on, on_nonfinite, max_consecutive_skips: See
            :class:`FabricAccumulationStrategy`.
        **kwargs: Passed to Fabric's ``DDPStrategy`` (``start_method``, ``process_group_backend``, ``timeout``, ...).

    Example:
        >>> import lightning as L
        >>> import lightning_accum
        >>> fabric = L.Fabric(strategy="accum_ddp_spawn", devices=2, accelerator="cpu")
        >>> type(fabric.strategy).__name__, fabric.strategy.data_parallel_replicas
        ('FabricDDPAccumulationStrategy', 2)
    """

    adapter_type = DDPAdapter

    def __init__(
        self,
        normalize: str = "auto",
        count_tokens: Callable[[Any], Count] | None = None,
        partial_group: str = "rescale",
        schedule_on: str = "applied",
        on_nonfinite: str = "skip",
        max_consecutive_skips: int | None = 100,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ) -> None:
        self._init_accumulation(AccumulationOptions.pick(locals()))
        super().__init__(start_method=start_method, **kwargs)

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if isinstance(self._launcher, _MultiProcessingLauncher) and self._start_method != "popen":
            self._launcher = _ClosingLauncher(self, start_method=self._start_method)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, options in DDP_STRINGS:
            description = f"Exact gradient accumulation in a Fabric loop with DDP ({options})"
            strategy_registry.register(name, cls, description=description, override=True, **options)


def log_on_axis(
    fabric: Fabric, metrics: Mapping[str, Any], axis: Literal["tokens", "samples", "updates"] = "tokens"
) -> int:
    """Log ``metrics`` at x = the run's axis (the ledger's exact count), with the count itself as ``accum/<axis>``.

    ``fabric.log_dict(metrics, step=fabric.strategy.ledger.tokens)`` does the same; this also writes the count by
    name, so that loggers whose x is a ``step`` column (CSV, MLflow) or a chart setting (W&B) can plot against it.

    Returns:
        The count logged at.

    Example:
        >>> import lightning as L
        >>> import lightning_accum
        >>> fabric = L.Fabric(strategy="accum", accelerator="cpu", loggers=[])
        >>> log_on_axis(fabric, {"loss": 2.5})
        0
    """
    strategy = fabric.strategy
    if not isinstance(strategy, FabricExactAccumulation):
        raise RuntimeError(
            f"log_on_axis needs an accumulation strategy, but the Fabric uses {type(strategy).__name__}. Pass"
            " `L.Fabric(strategy='accum')` on one device or `strategy='accum_ddp'` on several."
        )
    ledger = strategy.ledger
    count = {"tokens": ledger.tokens, "samples": ledger.samples, "updates": ledger.updates_applied}.get(axis)
    if count is None:
        raise ValueError(f"`axis` must be 'tokens', 'samples' or 'updates', got {axis!r}.")
    fabric.log_dict({**metrics, f"accum/{axis}": count}, step=count)
    return count


def register() -> None:
    """Register the strategy strings with Fabric's registry (done on ``import lightning_accum``)."""
    FabricAccumulationStrategy.register_strategies(STRATEGY_REGISTRY)
    FabricDDPAccumulationStrategy.register_strategies(STRATEGY_REGISTRY)
