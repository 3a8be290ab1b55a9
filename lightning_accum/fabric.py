"""Exact accumulation in Lightning Fabric loops: the strategy strings ``"accum"``, ``"accum_ddp"`` and its launch
variants, and ``"accum_fsdp"`` in Fabric's registry, with the Trainer's manual API under the same names.

A Fabric loop writes its own accumulation (LitGPT's ``finetune`` and ``pretrain`` scripts are such loops). With an
accumulation strategy it reports each micro-batch and closes each group, and everything else stays Fabric's::

    fabric = L.Fabric(strategy="accum_ddp", devices=2)
    model, optimizer = fabric.setup(model, optimizer)
    for i, batch in enumerate(loader):
        last = (i + 1) % A == 0
        with fabric.no_backward_sync(model, enabled=not last):       # Fabric's own: DDP's no_sync on non-final ones
            loss = loss_fn(model(batch["input_ids"]), batch["labels"])  # the micro-batch's mean over its tokens
            fabric.backward(fabric.strategy.accumulate(loss, num_tokens=supervised_tokens(batch["labels"], shift=True)))
        if last:
            record = fabric.strategy.close_group(optimizer)  # one all-reduce, the rescale by c · D / W, the decision
            optimizer.step()                                   # applied, or skipped (the GradScaler, a NaN, no token)
            optimizer.zero_grad()

Each Fabric strategy holds one :class:`~lightning_accum.core.core.AccumulationCore` (the engine, the close, the
manual API, the checkpoint entry, the engine adapter), as the Trainer's strategies do; :class:`FabricExactAccumulation`
is the one package layer between each public Fabric strategy and Fabric's class. The manual API and its rules are
documented once, on the core; checkpoints (``fabric.save`` / ``fabric.load``), schedules, :func:`log_on_axis`, sharded
models (:class:`FabricModelParallelAccumulationStrategy`, ``"accum_fsdp"``) and the end of a loop in
docs/howto.md ("Train in a Fabric loop").
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import DoublePrecision, Precision
from lightning.fabric.strategies import (
    STRATEGY_REGISTRY,
    DDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
    Strategy,
)
from lightning.fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.fabric.utilities.data import _update_dataloader
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.fabric.wrappers import is_wrapped
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_accum._worker_exit import ClosingWorkers, launcher_configuration
from lightning_accum.axis_lr import AxisLR
from lightning_accum.core.adapter import EngineAdapter, NamedParameters, optimized_parameters
from lightning_accum.core.closing import enabled_scaler
from lightning_accum.core.core import CLOSE_GROUP_DOC, AccumulationCore, CoreSeam, given_device, one_device_property
from lightning_accum.core.ddp import DDPAdapter, register_ddp_strings
from lightning_accum.core.entry import CHECKPOINT_KEY
from lightning_accum.core.mesh import (
    MeshAdapter,
    check_mesh_sizes,
    mesh_environment,
    refuse_unsharded,
    register_fsdp_string,
)
from lightning_accum.core.reading import read_checkpoint
from lightning_accum.evaluation_loss import EvaluationLoss, repeats_message
from lightning_accum.fabric_model_parallel import BackwardSyncNotes, shard_module_lists, sharded_state
from lightning_accum.ledger import AXES, GroupRecord
from lightning_accum.options import AccumulationOptions, validate_choice
from lightning_accum.sampler import global_order_for
from lightning_accum.token_batches import TokenBatches

__all__ = [
    "FabricAccumulationStrategy",
    "FabricDDPAccumulationStrategy",
    "FabricExactAccumulation",
    "FabricModelParallelAccumulationStrategy",
    "log_on_axis",
    "register",
]

_Path = str | Path


class FabricExactAccumulation(Strategy, CoreSeam):
    """The public base of the Fabric accumulation strategies: the Fabric hooks they change, and the interface loops
    program against (the manual API, :meth:`evaluation`, the seam). Listed first in a strategy's bases."""

    #: The class of this strategy's :class:`~lightning_accum.core.adapter.EngineAdapter`.
    adapter_type: ClassVar[type[EngineAdapter]] = EngineAdapter

    def _init_accumulation(self, keywords: dict[str, Any]) -> dict[str, Any]:
        """Set up the core from the options among the constructor's ``keywords`` (and ``token_batches``) before
        Fabric's ``__init__``; return the others, Fabric's (a keyword none takes is a ``TypeError`` naming them)."""
        fabric_init = super().__init__  # the framework strategy's, next in the instance's order
        options, others = AccumulationOptions.split(type(self).__name__, keywords, fabric_init, own=("token_batches",))
        token_batches: TokenBatches | None = others.pop("token_batches", None)
        self._core = AccumulationCore(self, self.adapter_type, options)
        self._tokens = token_batches  # a shuffled loader's micro-batches cut by tokens (`setup_dataloaders`)
        self._core.parameters = self._parameters
        self._sync: BackwardSyncNotes | None = None  # Fabric's no_backward_sync control, noted (DDP, FSDP2)
        self._modules: list[Module] = []  # what `fabric.setup` was given, unwrapped: the named parameters
        self._optimizers: list[Optimizer] = []
        return others

    # ------------------------------------------------------------------ the public interface

    @property
    def gradient_scaler(self) -> torch.amp.GradScaler | None:
        """The enabled GradScaler of the precision plugin (``precision="16-mixed"``), or ``None``."""
        return enabled_scaler(self.precision)

    @property
    def precision(self) -> Precision:
        """Fabric's plugin; ``"64-true"``'s keeps the module's outputs in float64 (docs/howto.md)."""
        return super().precision

    @precision.setter
    def precision(self, precision: Precision | None) -> None:
        plugin = _Float64Outputs() if type(precision) is DoublePrecision else precision
        super(FabricExactAccumulation, type(self)).precision.__set__(self, plugin)  # type: ignore[attr-defined]

    def evaluation(self) -> EvaluationLoss:
        """A new, empty :class:`~lightning_accum.evaluation_loss.EvaluationLoss`: ``add(loss, num_tokens=...)`` each
        batch (no host read), then ``compute()`` on every rank for the set's loss weighted by its units over every
        data-parallel replica (one all-reduce in float64; the same record on every rank; NaN with a warning for a set
        without any unit); ``reset()`` empties it for the next evaluation. The unit is the run's, as for
        ``accumulate`` (the first batch's before any training)."""
        return EvaluationLoss(self._core.engine, self._core.adapter.reduce_sum, lambda: self.root_device)

    def close_group(self, optimizer: Optimizer, group_size: int | None = None) -> GroupRecord:
        inner = optimizer.optimizer if is_wrapped(optimizer) else optimizer  # type: ignore[attr-defined]
        module = self._modules[0] if self._modules else None
        return self._core.close_group(inner, module, self.gradient_scaler, group_size, self._optimizers)

    close_group.__doc__ = CLOSE_GROUP_DOC

    # ------------------------------------------------------------------ Fabric's hooks

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._core.bind(self.root_device)  # the processes exist now (DDP's process group)

    @override
    def setup_module_and_optimizers(self, module: Module, optimizers: list[Optimizer], *scheduler: Any) -> Any:
        # `fabric.setup(..., scheduler=s)` hands the scheduler on.
        if scheduler and isinstance(scheduler[0], AxisLR):
            scheduler[0].bind(self._core.engine)  # it counts what each applied update consumed
        return super().setup_module_and_optimizers(module, optimizers, *scheduler)

    @override
    def setup_module(self, module: Module) -> Any:  # Module, or the engine's wrapper of it (DDP)
        self._core.refuse_a_group_left_open("fabric.setup_module")
        self._modules.append(module)
        self._core.bind(self.root_device)  # again: a one-device loop need not call `fabric.launch()`
        return super().setup_module(module)

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        self._core.refuse_a_group_left_open("fabric.setup_optimizers")
        self._optimizers.append(optimizer)
        return super().setup_optimizer(optimizer)

    @override
    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        # Overridden (so Fabric asks for `fabric.backward(loss)` over a plain `loss.backward()`, as for DeepSpeed):
        # the open group notes the backward of the tensor `accumulate` handed out and refuses any other inside it.
        fabric_backward = super().backward
        unsynced = self._sync is not None and self._sync.blocking
        self._core.backward(tensor, lambda: fabric_backward(tensor, module, *args, **kwargs), unsynced)

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        # `fabric.setup_dataloaders`: an unshuffled loader (an evaluation set, as a rule) padded by the sampler Fabric
        # put in is named, as the Trainer's evaluation names it: `fabric.strategy.evaluation()` would count repeats.
        if not getattr(getattr(dataloader, "sampler", None), "shuffle", True):
            replicas = self._core.adapter.data_parallel_size
            message = repeats_message(dataloader, "an evaluation over this loader", "the loader", replicas)
            if message is not None:
                rank_zero_warn(message)
        dataloader = super().process_dataloader(dataloader)
        if not self._core.engine.options.global_order and self._tokens is None:
            return dataloader
        # `global_order=True`: a shuffled loader (in a loop, the training one) reads a GlobalOrderSampler in place of
        # Fabric's distributed sampler or its own RandomSampler; in-order loaders keep theirs (`global_order_for`).
        layout = getattr(self, "distributed_sampler_kwargs", None) or {"num_replicas": 1, "rank": 0}
        seed = int(os.environ.get("PL_GLOBAL_SEED", "0"))
        if self._tokens is not None:  # `token_batches=`: that loader batched by tokens, in that order
            tokens = self._tokens.loader(dataloader, layout["num_replicas"], layout["rank"], seed, accumulate=None)
            return dataloader if tokens is None else tokens
        sampler = global_order_for(dataloader, layout["num_replicas"], layout["rank"], seed, in_order=False)
        if sampler is None or sampler is dataloader.sampler:
            return dataloader
        return _update_dataloader(dataloader, sampler)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        closure: Callable[[], Any] = kwargs.get("closure") or (lambda: None)
        lightning_step = super().optimizer_step
        return self._core.optimizer_step(
            optimizer, closure, self.gradient_scaler, lambda: lightning_step(optimizer, **kwargs)
        )

    @override
    def save_checkpoint(
        self,
        path: _Path,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        if filter is not None and isinstance(self, ModelParallelStrategy) and self._save_distributed_checkpoint:
            # Fabric's own refusal, before the entry's collectives (a group's shards are written beside Fabric's).
            raise NotImplementedError(
                f"{type(self).__name__} doesn't support loading distributed filtered checkpoints, so saving them is"
                " disabled."
            )
        if CHECKPOINT_KEY in state:
            raise ValueError(
                f"`fabric.save(path, state)`: the state holds a key {CHECKPOINT_KEY!r}, which the accumulation strategy"
                " writes itself (the ledger and an open group). Rename your entry."
            )
        entry = self._core.entry(self._configuration(), self._parameters(), running=None, failed=None)
        fabric_save = super().save_checkpoint
        self._core.adapter.write_checkpoint(
            {**state, CHECKPOINT_KEY: entry},
            path,
            storage_options,
            lambda s, p, o: fabric_save(p, s, o, filter),
            sharded_state,
            self._parameters,
        )

    @override
    def load_checkpoint(
        self,
        path: _Path,
        state: Module | Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        load = super().load_checkpoint
        remainder: dict[str, Any] = read_checkpoint(lambda: load(path, state, strict, weights_only), path)
        if isinstance(state, (Module, Optimizer)) or not isinstance(remainder, Mapping):
            # A module's or an optimizer's weights alone, or what a custom CheckpointIO returned that is not a
            # mapping: no loop state to restore, returned as Fabric returns it.
            return remainder
        if not state and CHECKPOINT_KEY not in remainder:
            return remainder  # `fabric.load(path)` of a file the package did not write (weights, say): as Fabric does
        if state and not any(isinstance(value, Optimizer) for value in state.values()):
            # Weights (and whatever else) without an optimizer: restored as plain Fabric restores them; the loop's
            # state (the ledger, an open group) resumes only with the optimizer the group was carried for.
            _say_group_not_resumed(remainder.get(CHECKPOINT_KEY), str(path))
            return remainder
        held = self._core.engine.microbatches_in_group
        if held or self._core.group.closed is not None:
            raise RuntimeError(
                f"`fabric.load({str(path)!r}, state)` was called while an accumulation group is open in the running"
                f" loop ({held} micro-batch(es) reported since the last close, or a closed group waiting for its"
                " `optimizer.step()`): the checkpoint's ledger and group would replace them. Load before the loop's"
                " first `accumulate` (or after a `close_group` and its `optimizer.step()`), or load the weights alone"
                " (`fabric.load(path, {'model': model})`)."
            )
        # Nothing reported yet: what an earlier load put there (a group not used yet) is replaced by this one. With an
        # optimizer in `state` (or no state), the loop resumes: the ledger and an open group (the entry is consumed).
        self._core.group.end("a new `fabric.load`")
        reader = self._core.adapter.distributed_reader(path, self._parameters)  # a group's gradient in shards
        entry = self._core.checkpoint.load(self._core.engine, remainder, str(path), reader)
        remainder.pop(CHECKPOINT_KEY, None)
        # The open group continues with the next micro-batch; its places already done (for `close_group(group_size=)`)
        # are the entry's micro-batches over all replicas, per replica of this run.
        group = (entry or {}).get("open_group") or {}
        total = int(group.get("total_microbatches", 0))
        position = total // max(1, self._core.adapter.data_parallel_size)
        config = self._configuration()
        if self._optimizers or not total:  # a checkpoint written between groups carries nothing to wait for
            self._core.reopen(config, position, self._parameters())
        else:  # loaded before `setup_optimizers` (FSDP2's order): reopened at the loop's next accumulate, backward or
            # close, when the parameters its optimizer holds are known (a save before writes the group as read)
            self._core.group.reopen_later(config, position)
        return remainder

    @override
    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        self._core.refuse_clipping("fabric.clip_gradients(model, optimizer, max_norm=...)")
        self.precision.unscale_gradients(optimizer)  # as Fabric's, with the engine adapter's clipping (the Trainer's)
        parameters = self.precision.main_params(optimizer)
        return self._core.adapter.clip_norm(parameters, max_norm, norm_type, error_if_nonfinite)

    @override
    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float | int) -> None:
        self._core.refuse_clipping("fabric.clip_gradients(model, optimizer, clip_val=...)")
        self.precision.unscale_gradients(optimizer)
        self._core.adapter.clip_value(self.precision.main_params(optimizer), clip_val)

    @override
    def teardown(self) -> None:
        # Fabric never calls it: `fabric.strategy.teardown()` is the documented end of a loop's state on the strategy
        # (its modules and optimizers, an open or carried group; the ledger stays, the run's record).
        self._core.end("`teardown` ended the loop", rank_zero_info)
        self._modules, self._optimizers = [], []
        super().teardown()

    # ------------------------------------------------------------------ parts of the hooks

    def _note_backward_sync(self) -> None:
        """Note when Fabric's ``no_backward_sync`` blocks synchronisation (after Fabric's ``__init__`` set its
        control; see :class:`~lightning_accum.fabric_model_parallel.BackwardSyncNotes`)."""
        self._sync = BackwardSyncNotes(self._backward_sync_control)  # type: ignore[attr-defined,arg-type]
        self._backward_sync_control = self._sync

    def _parameters(self) -> NamedParameters:
        """The optimized parameters by name (a second module's names prefixed by its place in ``fabric.setup``);
        before ``setup_optimizers``, every parameter of the set-up modules."""
        return optimized_parameters(self._modules, self._optimizers or None)

    def _configuration(self) -> dict[str, Any]:
        """What the checkpoint's groups depend on (a Fabric loop has no ``A`` the strategy knows)."""
        return self._core.configuration(type(self).__name__, accumulate=None)


class _Float64Outputs(DoublePrecision):
    """``"64-true"`` whose outputs stay float64, as the Trainer's (Fabric's are in torch's default dtype, float32)."""

    @override
    def convert_output(self, data: Any) -> Any:
        return data


class FabricAccumulationStrategy(FabricExactAccumulation, SingleDeviceStrategy):
    """Exact accumulation in a Fabric loop on one device (``L.Fabric(strategy="accum")``).

    Args:
        device: The device; by default the one Fabric's accelerator selects.
        **kwargs: The options by name (``normalize="tokens"``; :class:`~lightning_accum.options.AccumulationOptions`;
            ``partial_group`` and ``schedule_on`` the loop's to apply in Fabric); ``token_batches``, a shuffled
            loader's micro-batches cut by tokens in ``fabric.setup_dataloaders`` (a
            :class:`~lightning_accum.TokenBatches` with ``samples_per_update``; the loop's groups:
            ``loader.batch_sampler.groups(loader)``); and ``SingleDeviceStrategy``'s keywords. One that none of them
            takes is a ``TypeError`` naming them.

    Example:
        >>> import lightning as L
        >>> import lightning_accum
        >>> fabric = L.Fabric(strategy="accum", accelerator="cpu")
        >>> type(fabric.strategy).__name__, fabric.strategy.data_parallel_replicas
        ('FabricAccumulationStrategy', 1)
    """

    def __init__(self, device: str | torch.device | None = None, **kwargs: Any) -> None:
        kwargs = self._init_accumulation(kwargs)
        super().__init__(device=given_device(self, device), **kwargs)

    parallel_devices = one_device_property("Fabric")

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "accum", cls, description="Exact gradient accumulation in a Fabric loop on one device", override=True
        )


class _LedgerReturningLauncher(ClosingWorkers, _MultiProcessingLauncher):
    """Fabric's spawn/fork launcher that also brings rank zero's ledger back to the main process (``fabric.launch``
    returns rank zero's value, and ``fabric.strategy.ledger`` in the main process then reads what the run counted, as
    the Trainer's launcher does), and closes the process group in each worker (see
    :mod:`lightning_accum._worker_exit`)."""

    @override
    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        result, ledger = super().launch(function, *args, **kwargs)
        self._strategy.engine.load_state_dict(ledger)  # type: ignore[attr-defined]  # the strategy is ours
        return result

    @override
    def _wrapping_function(
        self, process_idx: int, function: Callable[..., Any], args: Any, kwargs: Any, *rest: Any
    ) -> None:
        engine = self._strategy.engine  # type: ignore[attr-defined]  # this worker's copy of the strategy

        def with_ledger(*args: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
            return function(*args, **kwargs), engine.state_dict()

        super()._wrapping_function(process_idx, with_ledger, args, kwargs, *rest)


class FabricDDPAccumulationStrategy(FabricExactAccumulation, DDPStrategy):
    """Exact accumulation in a Fabric loop across data-parallel replicas (``L.Fabric(strategy="accum_ddp")`` and
    ``"accum_ddp_spawn"``, ``"accum_ddp_fork"``, ``"accum_ddp_notebook"``, ``"accum_ddp_find_unused_parameters_true"``).

    Every micro-batch but a group's last runs inside ``fabric.no_backward_sync(model, enabled=...)``, and every replica
    reports the same number of micro-batches per group.

    Args:
        **kwargs: The options (see :class:`FabricAccumulationStrategy`) and the keywords of Fabric's ``DDPStrategy``
            (``start_method``, ``process_group_backend``, ``timeout``, ...).

    Example:
        >>> import lightning as L
        >>> import lightning_accum
        >>> fabric = L.Fabric(strategy="accum_ddp_spawn", devices=2, accelerator="cpu")
        >>> type(fabric.strategy).__name__, fabric.strategy.data_parallel_replicas
        ('FabricDDPAccumulationStrategy', 2)
    """

    adapter_type = DDPAdapter

    def __init__(
        self, *, start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen", **kwargs: Any
    ) -> None:
        kwargs = self._init_accumulation(kwargs)
        super().__init__(start_method=start_method, **kwargs)
        self._note_backward_sync()

    _configure_launcher = launcher_configuration(DDPStrategy, _MultiProcessingLauncher, _LedgerReturningLauncher)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_ddp_strings(strategy_registry, cls, " in a Fabric loop")


class FabricModelParallelAccumulationStrategy(FabricExactAccumulation, ModelParallelStrategy):
    """Exact accumulation in a Fabric loop with FSDP2 and tensor parallelism: Fabric's ``ModelParallelStrategy``
    (``L.Fabric(strategy="accum_fsdp")``, or this class with your own ``parallelize_fn``).

    ``fabric.setup_module(model)`` shards the model with ``parallelize_fn(model, device_mesh)``, as Fabric's strategy
    does; the optimizer is built from the sharded parameters afterwards (``fabric.setup_optimizers``). As in the
    Trainer's :class:`~lightning_accum.ModelParallelAccumulationStrategy`, ``D`` is the size of the mesh's
    ``data_parallel`` dimension. ``no_backward_sync``, clipping over the mesh, a group carried across ``fabric.save``
    shard by shard, and the float64 check (Fabric refuses ``precision="64-true"`` here: ``model.double()`` instead) are
    in docs/howto.md ("Sharded models in a Fabric loop").

    Args:
        parallelize_fn: ``(model, device_mesh) -> model``: applies ``fully_shard`` over
            ``device_mesh["data_parallel"]`` and/or ``parallelize_module`` over ``device_mesh["tensor_parallel"]``;
            ``"accum_fsdp"`` passes :func:`~lightning_accum.fabric_model_parallel.shard_module_lists`.
        data_parallel_size: ``D``, or ``"auto"``.
        tensor_parallel_size: The devices sharing one model replica, or ``"auto"``. With both ``"auto"``, Fabric's
            sizes (``D`` = number of nodes); with one of them an int, the other is the world size divided by it
            (``"accum_fsdp"``: ``tensor_parallel_size=1``, FSDP2 over every device).
        **kwargs: The options (see :class:`FabricAccumulationStrategy`) and the keywords of Fabric's
            ``ModelParallelStrategy`` (``save_distributed_checkpoint``, ``process_group_backend``, ``timeout``).

    Example:
        >>> import lightning as L
        >>> import lightning_accum
        >>> fabric = L.Fabric(strategy="accum_fsdp", devices=2, accelerator="cpu")
        >>> from lightning.fabric.strategies import ModelParallelStrategy
        >>> type(fabric.strategy).__name__, isinstance(fabric.strategy, ModelParallelStrategy)
        ('FabricModelParallelAccumulationStrategy', True)
    """

    adapter_type = MeshAdapter

    def __init__(
        self,
        parallelize_fn: Callable[[Any, Any], Any],
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = "auto",
        **kwargs: Any,
    ) -> None:
        check_mesh_sizes(data_parallel_size, tensor_parallel_size)
        kwargs = self._init_accumulation(kwargs)
        super().__init__(parallelize_fn, data_parallel_size, tensor_parallel_size, **kwargs)
        self._note_backward_sync()  # Fabric's control of `no_backward_sync`, noted (see docs/internals.md)

    @override
    def setup_environment(self) -> None:
        with mesh_environment(self, "Fabric's `devices=` / `num_nodes=`"):
            super().setup_environment()

    @override
    def setup_module(self, module: Module) -> Module:
        sharded = super().setup_module(module)
        self._modules[-1] = sharded  # the `parallelize_fn`'s module: the optimizer's parameters are its own
        how = (
            "In it, apply `fully_shard(module, mesh=device_mesh['data_parallel'])` (FSDP2) and/or"
            " `parallelize_module(module, device_mesh['tensor_parallel'], plan)`, or pass strategy='accum_fsdp'"
        )
        refuse_unsharded(sharded, self, "the `parallelize_fn`", how)
        return sharded  # type: ignore[no-any-return]

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        mine = {id(p) for module in self._modules for p in module.parameters()}
        if mine and not any(id(p) in mine for group in optimizer.param_groups for p in group["params"]):
            raise ValueError(
                f"The optimizer ({type(optimizer).__name__}) holds none of the parameters of the model"
                " `fabric.setup_module` sharded (sharding replaces them), so its steps would not train it. Build the"
                " optimizer after `model = fabric.setup_module(model)`, from `model.parameters()`, then call"
                " `optimizer = fabric.setup_optimizers(optimizer)` (not `fabric.setup(model, optimizer)`)."
            )
        return super().setup_optimizer(optimizer)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        layout = "fully_shard on each child of every ModuleList and on the root"
        register_fsdp_string(strategy_registry, cls, " in a Fabric loop", layout, parallelize_fn=shard_module_lists)


def _say_group_not_resumed(entry: Any, path: str) -> None:
    """One info line when a load without an optimizer leaves a checkpoint's open group behind."""
    group = entry.get("open_group") if isinstance(entry, Mapping) else None
    if isinstance(group, Mapping) and int(group.get("microbatches", 0) or 0):
        rank_zero_info(
            f"lightning_accum: {path!r} was written inside an accumulation group ({group['microbatches']}"
            " micro-batch(es) per replica); the state loaded holds no optimizer, so that group and the ledger are not"
            " resumed (weights only, as plain Fabric loads them). Pass the optimizer too to resume the loop."
        )


def log_on_axis(
    fabric: Fabric,
    metrics: Mapping[str, Any],
    axis: Literal["tokens", "samples", "updates", "documents"] = "tokens",
) -> int:
    """Log ``metrics`` at x = the run's axis (the ledger's exact count), with the count itself as ``accum/<axis>``.

    ``fabric.log_dict(metrics, step=fabric.strategy.ledger.tokens)`` does the same; this also writes the count by
    name, so that loggers whose x is a ``step`` column (CSV, MLflow) or a chart setting (W&B) can plot against it.
    ``axis`` is ``"tokens"``, ``"samples"``, ``"documents"`` (as :func:`~lightning_accum.document_mean_loss` reports
    them) or ``"updates"`` (applied).

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
    count = int(getattr(strategy.ledger, AXES[validate_choice("axis", axis, AXES)]))
    fabric.log_dict({**metrics, f"accum/{axis}": count}, step=count)
    return count


def register() -> None:
    """Register the strategy strings with Fabric's registry (done on ``import lightning_accum``)."""
    FabricAccumulationStrategy.register_strategies(STRATEGY_REGISTRY)
    FabricDDPAccumulationStrategy.register_strategies(STRATEGY_REGISTRY)
    FabricModelParallelAccumulationStrategy.register_strategies(STRATEGY_REGISTRY)
