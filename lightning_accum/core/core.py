"""One core behind both doors: what the Trainer's and Fabric's accumulation strategies share, composed once.

A Trainer strategy (:class:`~lightning_accum.ExactAccumulation`) and a Fabric strategy
(:class:`~lightning_accum.fabric.FabricExactAccumulation`) each hold one :class:`AccumulationCore` and delegate to it:
the engine and the close, the manual API and its rules (one rulebook, both doors), the run's configuration and the
checkpoint entry. The front classes keep only what their framework's hooks need; the
public seam (``ledger``, ``engine``, ``group_open``, ...) is written once, :class:`CoreSeam`, a base of both.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_accum.core.adapter import EngineAdapter, NamedParameters
from lightning_accum.core.checkpoint import OpenGroupCheckpoint, Writing
from lightning_accum.core.closing import GroupClosing
from lightning_accum.core.lifecycle import GroupLifecycle, GroupState
from lightning_accum.core.manual import ManualGroups
from lightning_accum.core.rules import refuse
from lightning_accum.engine import AccumulationEngine
from lightning_accum.ledger import AccumulationLedger, GroupRecord
from lightning_accum.microbatch import Count
from lightning_accum.options import AccumulationOptions

__all__ = ["CLOSE_GROUP_DOC", "AccumulationCore", "CoreSeam", "given_device", "one_device_property"]

#: The documentation of both front classes' ``close_group(optimizer, group_size=None)``.
CLOSE_GROUP_DOC = """Close the group reported with ``accumulate``, right before ``optimizer.step()`` (manual API).

        One all-reduce of the group's counts, the rescale of ``optimizer``'s gradients by ``c · D / W`` and the
        decision, as at the end of a group in automatic optimization. Then call ``optimizer.step()``: it updates
        (unless a GradScaler finds an overflow) or, for a group that makes no update (a NaN/Inf gradient without a
        scaler, no unit at all), does nothing; either way the group is recorded in ``ledger`` and the listeners are
        called. Clip (``self.clip_gradients`` / ``fabric.clip_gradients``) after the close, never inside the group.

        Args:
            optimizer: The optimizer whose gradients the group accumulated.
            group_size: The micro-batches per replica a group holds: a group closed with fewer (the end of the data)
                is a partial group, rescaled with its real denominator or dropped (``partial_group=``), and counted
                in ``ledger.partial_groups``. ``None``: every group is complete.

        Returns:
            The group's record; ``applied`` and ``skip_reason`` are final once ``optimizer.step()`` returned (the
            same object is completed then).

        Raises:
            ValueError: ``group_size`` is not a positive int, or smaller than the micro-batches reported.
            RuntimeError: In a Trainer's automatic optimization, with no micro-batch reported since the last close,
                while the previous group's ``optimizer.step()`` has not run, while the tensor the last
                ``accumulate`` returned was never back-propagated, after a group whose last backward ran without
                gradient synchronisation where that matters (several DDP replicas, FSDP2), after a backward that
                reached another optimizer's parameters, when the group's gradients changed outside the strategy
                (``zero_grad()`` inside the group, torch's own ``loss.backward()``), or when the group opened on a
                nonzero gradient already there (a backward before its first ``accumulate``, a ``zero_grad`` forgotten
                after a step; a gradient zeroed in place is fine).
        """


def _manual() -> bool:  # a module-level function, not a lambda: a spawn launch pickles the strategy
    return False


class AccumulationCore:
    """The parts of one accumulation strategy, whichever framework runs it.

    Args:
        strategy: The front strategy (the adapter reads its model, mesh and ranks).
        adapter_type: The class of its :class:`~lightning_accum.core.adapter.EngineAdapter`.
        options: The options its constructor validated.
    """

    def __init__(self, strategy: Any, adapter_type: type[EngineAdapter], options: AccumulationOptions) -> None:
        self.adapter = adapter_type(strategy)
        self.engine = AccumulationEngine.from_options(options)
        self.engine.bind(info=rank_zero_info, warn=rank_zero_warn)
        shards = type(self.adapter).local_gradient is not EngineAdapter.local_gradient  # else the gradient itself
        self.closing = GroupClosing(local=self.adapter.local_gradient) if shards else GroupClosing()
        self._own(self.engine)
        #: Inside :meth:`aside`: the loop's steps run for a check (``AccumulationCheck``), not for the run.
        self.checking = False
        #: The optimized parameters by name (set by each front class): a group opens on them without a gradient.
        self.parameters: Callable[[], NamedParameters] = list
        #: Whether the loop runs automatic optimization (a Trainer's, set by its door): the manual API is refused there.
        self.automatic: Callable[[], bool] = _manual

    def _own(self, engine: AccumulationEngine) -> None:
        """Run on ``engine``, with a lifecycle of its own and the operations on it."""
        self.engine = engine
        #: The one owner of the group's lifecycle (:mod:`~lightning_accum.core.lifecycle`).
        self.group = GroupLifecycle(engine)
        self.manual = ManualGroups(self.group)
        self.checkpoint = OpenGroupCheckpoint(self.group)

    def bind(self, device: torch.device) -> None:
        """Bind the engine to ``device`` and the adapter's replicas, once the processes exist (both doors' set-up)."""
        self.engine.bind(device, self.adapter.replicas())
        self.closing.rank = self.adapter.shard_rank()  # named beside a NaN in this rank's own shard

    @contextmanager
    def aside(self, engine: AccumulationEngine) -> Generator[None, None, None]:
        """Run on ``engine`` (e.g. :meth:`AccumulationEngine.scratch`) inside the block, with a lifecycle of its own:
        the run's engine, open group and a checkpoint's group waiting are left untouched, and given back after."""
        saved = self.engine, self.group, self.manual, self.checkpoint, self.checking
        self._own(engine)
        self.checking = True
        try:
            yield
        finally:
            self.engine, self.group, self.manual, self.checkpoint, self.checking = saved

    # ------------------------------------------------------------------ the manual API

    def close_group(
        self,
        optimizer: Optimizer,
        module: Module | None,
        scaler: torch.amp.GradScaler | None,
        group_size: int | None = None,
        optimizers: Sequence[Optimizer] = (),
    ) -> GroupRecord:
        """Close the group over ``optimizer``'s gradients: :data:`CLOSE_GROUP_DOC`, with the front class's ``module``,
        GradScaler and every optimizer of the loop (a backward that reached another one's parameters is refused)."""
        if self.automatic():
            refuse(
                "manual_api_in_automatic_optimization",
                call="close_group",
                instead="In automatic optimization the strategy closes every group itself.",
            )
        self.install_carried()
        with self._naming_unpaired():
            return self.manual.close(
                self.engine, self.closing, optimizer, module, scaler, group_size, optimizers, self.adapter.sync_matters
            )

    def backward(self, tensor: Tensor, run: Callable[[], Any], unsynced: bool = False) -> Any:
        """A manual loop's backward of ``tensor`` through ``run()``, after the carried gradient of a resumed group. If
        ``tensor`` is the one :meth:`accumulate` handed out, the open group notes when its gradient holds that
        micro-batch, and whether the door ran it with gradient synchronisation blocked (``unsynced``); another tensor
        with a graph inside the open group is an error."""
        self.install_carried()
        ours = self.group.back_propagated(tensor)
        held = self.engine.microbatches_in_group
        if not ours and held and tensor.requires_grad:
            refuse("foreign_backward", held=held)
        if ours:
            self.manual.check_untouched(self.engine, "backward")
            self.engine.take_backward_tensor()
        with self._naming_unpaired():
            result = run()
        if ours:
            self.engine.backward_finished()
            self.group.backward_ran(unsynced, self.parameters)
        return result

    @contextmanager
    def _naming_unpaired(self) -> Generator[None, None, None]:
        """Around a manual loop's collectives (its close, its backward): a failed one is raised again with what the
        adapter says of it (:meth:`~lightning_accum.core.adapter.EngineAdapter.unpaired_collectives`), chained
        to the original, so that the rank's own traceback ends with the cause and the way out."""
        try:
            yield
        except Exception as error:
            message = self.adapter.unpaired_collectives(error)
            if message is None:
                raise
            raise RuntimeError(message) from error

    def refuse_a_group_left_open(self, call: str) -> None:
        """A model or optimizer set up (``call``) while a group holds micro-batches: an earlier loop ended inside it (a
        close over the new optimizer would find the old model's gradients and take them for another optimizer's)."""
        held = self.engine.microbatches_in_group
        if held:
            refuse("group_left_open_at_setup", call=call, held=held)

    def refuse_clipping(self, call: str) -> None:
        """Either door's clipping (``call`` names it) inside an open group is an error: the gradient is not yet the
        group's mean."""
        self.manual.refuse_clipping(self.engine, call)

    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], scaler: Any, lightning_step: Callable[[], Any]
    ) -> Any:
        """A manual loop's ``optimizer.step()`` (see :meth:`ManualGroups.optimizer_step
        <lightning_accum.core.manual.ManualGroups.optimizer_step>`)."""
        return self.manual.optimizer_step(self.engine, self.closing, optimizer, closure, scaler, lightning_step)

    # ------------------------------------------------------------------ the checkpoint entry

    def configuration(self, strategy_name: str, accumulate: int | None) -> dict[str, Any]:
        """What a checkpoint's groups depend on: ``A`` (where the loop says it: a Trainer), ``D``, the strategy and
        the ``normalize=`` and ``partial_group=`` options. One dictionary for both doors."""
        config: dict[str, Any] = {} if accumulate is None else {"accumulate": int(accumulate)}
        config.update(
            strategy=strategy_name,
            replicas=int(self.adapter.data_parallel_size),
            normalize=self.engine.options.normalize,
            partial_group=self.engine.options.partial_group,
        )
        return config

    def entry(
        self, config: dict[str, Any], parameters: NamedParameters, running: int | None, failed: str | None
    ) -> dict[str, Any]:
        """The package's checkpoint entry: the ledger, ``config`` and, inside a group, the group with its gradient
        summed over the replicas (collectives, unless ``failed`` says why the replicas cannot be reached)."""
        writing = Writing(
            config,
            running,
            failed,
            carry=lambda: self.adapter.carry_gradients(parameters, self.group.unsynced),
            parameter_names=[name for name, _ in parameters],
        )
        return self.checkpoint.entry(self.engine, writing)

    def reopen(self, config: dict[str, Any], position: int, parameters: NamedParameters) -> None:
        """Finish, exactly, the group a checkpoint was written in, at ``position`` of the resumed loop's group."""
        self.checkpoint.reopen(config, position, self.adapter.holds_group_sums(), parameters)

    def reopen_deferred(self) -> None:
        """The reopen of a group loaded before the loop set up its optimizers (``group.reopen_later``), once they
        are."""
        deferred = self.group.deferred
        if deferred is not None:
            self.reopen(*deferred, self.parameters())

    def install_carried(self) -> None:
        """A group resumed from a checkpoint: its gradient is added before the loop's first backward (or close)."""
        self.reopen_deferred()
        if self.group.state is GroupState.REOPENED:
            self.checkpoint.install(self.adapter.carried_part)

    def end(self, why: str, say: Callable[[str], None] | None = None, then: str = "") -> int:
        """The entry point that ran the strategy ends, and the group with it: both doors' teardowns call this (see
        :meth:`GroupLifecycle.end <lightning_accum.core.lifecycle.GroupLifecycle.end>`); the close's per-run layout
        and schedules end too. Returns the micro-batches discarded on this replica."""
        self.closing.reset()
        return self.group.end(why, say, then)


def given_device(strategy: Any, device: str | torch.device | None) -> str | torch.device:
    """What a one-device strategy's constructor hands its framework's: ``device``, or ``"cpu"`` until the connector
    chooses one (noted for :func:`one_device_property`)."""
    strategy._device_given = device is not None
    return device if device is not None else "cpu"


def one_device_property(chooser: str) -> Any:
    """The ``parallel_devices`` of a one-device strategy (set by ``chooser``'s connector: "the Trainer", "Fabric"):
    the device chosen when none was given to the constructor, one device only.

    It reads ``None``, so the connector's checks of a strategy's own devices against its accelerator flag are skipped
    as for Lightning's ``SingleDeviceStrategy`` (which has no such attribute): a strategy given a device and an
    accelerator instance is accepted as Lightning's is. A device given to the constructor is kept, whatever the
    connector selects, as Lightning's strategy keeps it."""

    def write(self: Any, devices: list[torch.device] | None) -> None:
        if not devices or self._device_given:
            return
        if len(devices) > 1:
            raise ValueError(
                f"strategy='accum' runs on one device, but {chooser} selected {len(devices)} devices. Use"
                " strategy='accum_ddp' (or 'accum_ddp_spawn') for several devices, or pass `devices=1`."
            )
        self._root_device = torch.device(devices[0])  # SingleDeviceStrategy's own (see docs/internals.md)
        self._device_given = True

    def read(self: Any) -> None:
        return None

    return property(read, write, doc=f"The device {chooser} chose when none was given (read by its connector).")


class CoreSeam:
    """The public seam of both front classes, written once: each member reads the part of ``self._core`` that owns it.
    No state, no hook, no ``super()`` call; after the framework's ``Strategy`` in their bases (docs/internals.md)."""

    _core: AccumulationCore

    @property
    def ledger(self) -> AccumulationLedger:
        """Exact global counters of the run (identical on every rank); see :class:`AccumulationLedger`."""
        return self._core.engine.ledger

    @property
    def engine(self) -> AccumulationEngine:
        """The object that does the arithmetic, with the options given to the strategy (``engine.options``)."""
        return self._core.engine

    @property
    def data_parallel_replicas(self) -> int:
        """``D``: the number of replicas that see different data and whose gradients are averaged."""
        return self._core.adapter.data_parallel_size

    @property
    def group_open(self) -> bool:
        """Whether an accumulation group is open: micro-batches reported since the last close, or a group carried
        over from a checkpoint that has not been closed yet (also before its first new micro-batch)."""
        return self._core.group.group_open

    @property
    def tensor_parallel_size(self) -> int:
        """The devices that share one model replica (1 without tensor parallelism)."""
        return self._core.adapter.tensor_parallel_size

    def reduce_sum(self, tensor: Tensor) -> Tensor:
        """Sum ``tensor`` in place over the data-parallel replicas (a collective when ``D > 1``); return it."""
        return self._core.adapter.reduce_sum(tensor)

    def accumulate(
        self,
        loss: Tensor,
        num_tokens: Count | None = None,
        num_samples: Count | None = None,
        batch: Any = None,
        group_size: int | None = None,
        num_documents: Count | None = None,
    ) -> Tensor:
        """Record one micro-batch of a manual loop in the open group; return the tensor to back-propagate.

        The manual API of both doors (a Trainer's ``training_step`` with ``automatic_optimization = False``, and a
        Fabric loop): back-propagate exactly the returned ``loss · w / c`` once, before the next call
        (``self.manual_backward`` / ``fabric.backward``), and call ``close_group(optimizer)`` before
        ``optimizer.step()``. Under DDP run every micro-batch but a group's last without gradient synchronisation
        (``strategy.no_backward_sync()`` / ``fabric.no_backward_sync(model, enabled=not last)``); every replica
        reports the same number of micro-batches per group. The rules hold alike at both doors.

        Args:
            loss: The micro-batch's mean loss over its units (a scalar tensor with a graph).
            num_tokens: Its supervised tokens (int or 0-d integer tensor), as ``"num_tokens"`` in automatic
                optimization; or ``None`` (then the strategy's ``count_tokens``, if given, reads ``batch``).
            num_samples: Its samples; ``None`` infers them from ``batch``'s tensors.
            batch: The micro-batch, for ``count_tokens`` and to infer the samples; optional.
            group_size: The micro-batches per update you plan: it only sets the magnitude of what is
                back-propagated (close to Lightning's ``loss / A``), never the update, which is exact whatever it is.
                ``None``: the previous group's micro-batches per replica (1 for the first group). ``1`` declares the
                group's only micro-batch, back-propagated as it is on one replica.
            num_documents: Its documents with a supervised token (``loss`` is then their mean:
                ``strategy.accumulate(**lightning_accum.document_mean_loss(...))``).

        Raises:
            RuntimeError: In a Trainer's automatic optimization (return the counts from ``training_step`` there),
                while a closed group waits for its ``optimizer.step()``, or while the tensor the previous call returned
                was never back-propagated. (A group that opens on a nonzero gradient already there, from a backward
                before its first ``accumulate`` or a ``zero_grad`` forgotten after a step, is refused at its close.)
            TypeError: ``loss`` is not a tensor.
            ValueError: Under ``normalize="auto"``, counts of a finer unit than the one the run fixed.
        """
        core = self._core
        if core.automatic():
            refuse(
                "manual_api_in_automatic_optimization",
                call="accumulate",
                instead="In automatic optimization return `{'loss': loss, 'num_tokens': n}` from `training_step`: the"
                " strategy weights it.",
            )
        core.reopen_deferred()
        counts = {"num_tokens": num_tokens, "num_samples": num_samples, "num_documents": num_documents}
        opening = None if core.group.group_open else core.parameters
        replicas = core.adapter.data_parallel_size
        return core.manual.accumulate(
            core.engine, loss, counts, batch, group_size, replicas, opening, core.closing.local
        )

    def add_group_listener(self, listener: Callable[..., None]) -> None:
        """Call ``listener(record, batch_samples)`` after every closed group (applied, skipped or dropped); see
        :meth:`GroupDecisions.add_listener <lightning_accum.decision.GroupDecisions.add_listener>`."""
        self._core.engine.decisions.add_listener(listener)

    def remove_group_listener(self, listener: Callable[..., None]) -> None:
        """Stop calling ``listener``."""
        self._core.engine.decisions.remove_listener(listener)
