"""Lightning strategies that make ``accumulate_grad_batches`` exact.

``AccumulationStrategy`` runs on one device, ``DDPAccumulationStrategy`` on data-parallel replicas.
Both keep Lightning's own loop (zero_grad at a group's start, ``no_sync`` on non-final micro-batches,
the precision plugin's unscale, clipping and step) and change three things through strategy hooks:

* ``training_step``: read the micro-batch's loss and unit count and prepare ``loss · w / c``;
* ``backward``: back-propagate that tensor instead of Lightning's ``loss / A``;
* ``optimizer_step``: after the group's last backward, reduce the group's counters once, rescale the
  gradient by ``c · D / W`` (before unscale and clipping), then update, skip or drop.

``trainer.global_step`` keeps Lightning's meaning (optimizer-step calls, a dropped partial group
included); exact counts are in :attr:`ledger`.

Checkpoints hold the ledger and ``c`` under the key ``"lightning_accum"``; one written inside a group also
carries that group (its counters and its gradient summed over replicas), so a run resumed from it closes the
group exactly; what cannot be carried is reported when writing and when resuming.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy, Strategy, StrategyRegistry
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_accum._worker_exit import close_process_group
from lightning_accum.engine import AccumulationEngine, Count, GroupOutcome
from lightning_accum.ledger import AccumulationLedger
from lightning_accum.schedules import release_schedulers, take_over_schedulers

__all__ = ["AccumulationStrategy", "DDPAccumulationStrategy"]

#: Key of the strategy's state in checkpoints written through the strategy.
CHECKPOINT_KEY = "lightning_accum"


class _ExactAccumulation(Strategy):
    """The hook overrides both strategies share; every decision is made by the :class:`AccumulationEngine`.

    Listed first in the bases so its overrides wrap the Lightning strategy's own methods (``super()`` is the
    single-device or DDP strategy in the method resolution order).
    """

    _engine: AccumulationEngine

    def _init_engine(
        self,
        normalize: str,
        count_tokens: Callable[[Any], Count] | None,
        partial_group: str,
        schedule_on: str,
        on_nonfinite: str,
        max_consecutive_skips: int | None,
    ) -> None:
        self._engine = AccumulationEngine(
            normalize=normalize,
            count_tokens=count_tokens,
            partial_group=partial_group,
            schedule_on=schedule_on,
            on_nonfinite=on_nonfinite,
            max_consecutive_skips=max_consecutive_skips,
        )
        self._scheduled: list[Any] = []
        self._resumed_group: dict[str, Any] | None = None
        self._trainer_ref: Trainer | None = None  # set in `setup`: the hooks of every micro-batch read it

    @property
    def ledger(self) -> AccumulationLedger:
        """Exact global counters of the run (identical on every rank); see :class:`AccumulationLedger`."""
        return self._engine.ledger

    @property
    def engine(self) -> AccumulationEngine:
        """The object that does the arithmetic and holds the options given to the strategy."""
        return self._engine

    @property
    def data_parallel_replicas(self) -> int:
        """``D``: the number of replicas that see different data and whose gradients are averaged."""
        return 1

    def _all_reduce_sum(self, tensor: Tensor) -> Tensor:
        return tensor

    def _trainer(self) -> Trainer:
        if self._trainer_ref is not None:
            return self._trainer_ref
        module = self.lightning_module
        assert module is not None
        return module.trainer

    def _check_supported(self, trainer: Trainer) -> None:
        module = trainer.lightning_module
        if not module.automatic_optimization:
            raise RuntimeError(
                f"{type(self).__name__} supports automatic optimization only, but "
                f"`{type(module).__name__}.automatic_optimization` is False. With manual optimization you own the"
                " accumulation loop: use a Lightning strategy such as 'auto' or 'ddp', or switch to automatic"
                " optimization to get exact accumulation."
            )
        if getattr(self, "handles_gradient_accumulation", False):
            raise RuntimeError(
                f"{type(self).__name__} cannot work on a strategy that handles gradient accumulation itself"
                " (`handles_gradient_accumulation=True`, e.g. DeepSpeed). Use strategy='accum' or 'accum_ddp'."
            )

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        trainer = self._trainer()
        batch_idx = trainer.fit_loop.epoch_loop.batch_idx  # the index Lightning's hooks of this batch receive
        if self._resumed_group is not None or (
            self._engine.microbatches_in_group and batch_idx % trainer.accumulate_grad_batches == 0
        ):
            self._check_group_start(trainer, batch_idx)
        output = super().training_step(*args, **kwargs)
        batch = args[0] if args else kwargs.get("batch")
        self._engine.add_microbatch(
            output,
            batch,
            accumulate=trainer.accumulate_grad_batches,
            all_reduce=self._all_reduce_sum,
            replicas=self.data_parallel_replicas,
        )
        return output

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        tensor = self._engine.take_backward_tensor()
        result = super().backward(tensor if tensor is not None else closure_loss, optimizer, *args, **kwargs)
        self._engine.backward_finished()
        return result

    @property
    def _scaler(self) -> torch.amp.GradScaler | None:
        scaler = getattr(self.precision_plugin, "scaler", None)
        return scaler if isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled() else None

    def _gradients(self, optimizer: Optimizer) -> list[Tensor]:
        return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]

    def _first_nonfinite_name(self, optimizer: Optimizer) -> str:
        module = self.lightning_module
        names = {id(p): name for name, p in module.named_parameters()} if module is not None else {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
                    return f"`{names.get(id(p), 'unnamed parameter')}` (shape {tuple(p.shape)})"
        return "none found after the reduction"

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        # Lightning calls this once per group, on its last micro-batch; the closure runs that micro-batch's
        # training_step and backward. Running it first lets the group close before unscale and clipping.
        closure_result = closure()
        trainer = self._trainer()
        scaler = self._scaler
        # The engine rescales the gradient by c·D/W on the device and, without a GradScaler (which finds
        # non-finite gradients itself: skip reason "overflow"), checks it for NaN/Inf in the same pass.
        outcome = self._engine.close_group(
            accumulate=trainer.accumulate_grad_batches,
            device=self.root_device,
            all_reduce=self._all_reduce_sum,
            replicas=self.data_parallel_replicas,
            describe_nonfinite=lambda: self._first_nonfinite_name(optimizer),
            ends_epoch=bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch),
            gradients=self._gradients(optimizer),
            check_gradients=scaler is None and self._engine.on_nonfinite != "ignore",
        )
        if outcome.action != "apply":
            optimizer.zero_grad(set_to_none=True)
            self._finish(outcome, applied=False)
            return closure_result

        # Applied: the engine has rescaled the gradient (`outcome.scaled`; with no gradient there is nothing to scale).
        scale_before = scaler._scale.clone() if scaler is not None and scaler._scale is not None else None
        output = super().optimizer_step(optimizer, lambda: closure_result, model, **kwargs)
        if scale_before is None or scaler is None or scaler._scale is None:
            self._finish(outcome, applied=True)
            return output
        # The scaler multiplies its scale by backoff_factor (< 1, enforced by torch) exactly when it found an
        # Inf/NaN and skipped the step: for every optimizer, including fused ones that step unconditionally.
        # One host read per update.
        before, after = torch.stack([scale_before, scaler._scale.to(scale_before)]).tolist()
        outcome.record.grad_scale = before
        self._finish(outcome, applied=after >= before, skip_reason="overflow")
        return output

    def _finish(self, outcome: GroupOutcome, applied: bool, skip_reason: str | None = None) -> None:
        record = self._engine.finish_group(outcome, applied=applied, skip_reason=skip_reason)
        module = self.lightning_module
        if module is None:
            return
        for config in self._scheduled:
            if self._engine.schedule_due(record, config.frequency):
                config.scheduler.advance(lambda scheduler: module.lr_scheduler_step(scheduler, None))

    @override
    def setup(self, trainer: Trainer) -> None:
        super().setup(trainer)
        self._trainer_ref = trainer
        self._scheduled = take_over_schedulers(self.lr_scheduler_configs)

    @override
    def teardown(self) -> None:
        release_schedulers(self.lr_scheduler_configs)
        self._scheduled = []
        self._trainer_ref = None
        super().teardown()

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        trainer = self._trainer()
        self._check_supported(trainer)
        self._engine.warn_short_epoch(trainer.num_training_batches, trainer.accumulate_grad_batches)

    # ------------------------------------------------------------------ checkpoints

    def _group_parameters(self) -> list[tuple[str, Tensor]]:
        """The optimized parameters by name, in a fixed order (the same on every replica)."""
        module = self.lightning_module
        assert module is not None
        optimized = {
            id(p) for optimizer in self.optimizers for group in optimizer.param_groups for p in group["params"]
        }
        return [(name, p) for name, p in module.named_parameters() if id(p) in optimized]

    def _summed_gradients(self) -> dict[str, Tensor]:
        """The open group's accumulated gradient by parameter name, summed over replicas, on the CPU.

        Under DDP the gradient of a group's non-final micro-batches lives on each replica (``no_sync``); the sum is
        all DDP needs, since it averages the replicas' gradients at the group's last backward. Collective: a mask of
        which parameters hold a gradient anywhere, then one all-reduce per dtype.
        """
        params = self._group_parameters()
        replicas = self.data_parallel_replicas
        if not params:
            return {}
        device = params[0][1].device
        has_grad = torch.tensor([float(p.grad is not None) for _, p in params], device=device, dtype=torch.float64)
        if replicas > 1:
            self._all_reduce_sum(has_grad)
        held = [(name, p) for (name, p), flag in zip(params, has_grad.tolist(), strict=True) if flag > 0]
        by_dtype: dict[torch.dtype, list[tuple[str, Tensor]]] = {}
        for name, p in held:
            by_dtype.setdefault(p.dtype, []).append((name, p))
        gradients: dict[str, Tensor] = {}
        for dtype, members in by_dtype.items():
            flat = torch.cat(
                [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(dtype) for _, p in members]
            )
            if replicas > 1:
                self._all_reduce_sum(flat)
            flat = flat.cpu()
            offset = 0
            for name, p in members:
                gradients[name] = flat[offset : offset + p.numel()].reshape(p.shape).clone()
                offset += p.numel()
        return gradients

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        state = self._engine.state_dict()
        open_microbatches = self._engine.microbatches_in_group
        state["open_group_microbatches"] = open_microbatches
        if open_microbatches:
            # Written inside a group (OnExceptionCheckpoint, SIGTERM, a time-based or hand-written checkpoint):
            # carry the group's counters and its accumulated gradient, so that a run resumed from this file
            # finishes the group exactly (see `_check_group_start`). Every replica takes part (collectives).
            group = self._engine.open_group_state(self.root_device, self._all_reduce_sum, self.data_parallel_replicas)
            gradients = self._summed_gradients()
            if group["consistent"]:
                group["gradients"] = gradients
            else:
                rank_zero_warn(
                    "lightning_accum: this checkpoint is written while a micro-batch's backward had not completed;"
                    f" the open group's {open_microbatches} micro-batch(es) cannot be carried exactly and a run resumed"
                    " from it will say how many of them are lost."
                )
            state["open_group"] = group
            progress = self._trainer().fit_loop.epoch_loop.batch_progress.current
            if progress.ready > getattr(progress, "processed", progress.ready):
                rank_zero_warn(
                    f"lightning_accum: this checkpoint is written while micro-batch {progress.ready} of the epoch was"
                    " running. Lightning runs it again on resume, but a training loader that saves its position"
                    " (`state_dict`) already counts it as consumed, so it then delivers the next batch: that"
                    " micro-batch's examples are skipped (Lightning's behaviour, not this strategy's)."
                )
        checkpoint[CHECKPOINT_KEY] = state
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint: dict[str, Any] = super().load_checkpoint(checkpoint_path, weights_only)
        if CHECKPOINT_KEY in checkpoint:
            state = checkpoint[CHECKPOINT_KEY]
            self._engine.load_state_dict(state)
            # Checked against the loop's position at the first micro-batch of the resumed run.
            self._resumed_group = dict(state.get("open_group") or {"microbatches": 0})
        return checkpoint

    def _check_group_start(self, trainer: Trainer, batch_idx: int) -> None:
        """At the first micro-batch after a resume, reopen the group the checkpoint carries; at a group's first
        micro-batch, discard a group Lightning never stepped. Runs in ``training_step``, before Lightning zeroes the
        gradient at a group's start (no hook of its own on every micro-batch)."""
        if self._resumed_group is not None:
            group, self._resumed_group = self._resumed_group, None
            self._reopen_group(group, batch_idx)
        if self._engine.microbatches_in_group and batch_idx % trainer.accumulate_grad_batches == 0:
            # Lightning starts a group (and zeroes the gradient) while the previous one never reached an optimizer
            # step: the loader yielded fewer batches than its length announced, so Lightning's epoch ended early.
            lost = self._engine.discard_open_group()
            rank_zero_warn(
                f"lightning_accum: {lost} micro-batch(es) at the end of the previous epoch never reached an optimizer"
                " step: the training loader ended before the number of batches it announced (`len()`), and Lightning"
                " only steps on the batch it expects to be last. Their gradient is discarded and the ledger does not"
                " count them. Make the loader's length match what it yields."
            )

    def _reopen_group(self, group: dict[str, Any], batch_idx: int) -> None:
        """Finish, exactly, the group a checkpoint was written in; or say which micro-batches are lost."""
        carried = int(group["microbatches"])
        position = batch_idx % self._trainer().accumulate_grad_batches  # micro-batches of this group Lightning ran
        if position == 0 and carried == 0:
            return
        if position == carried and "gradients" in group:
            holder = self.is_global_zero  # one replica carries the sums and the gradient; DDP adds the others'
            self._engine.resume_open_group(group, holds_sums=holder)
            gradients: dict[str, Tensor] = group["gradients"]
            for name, p in self._group_parameters():
                saved = gradients.get(name) if holder else None
                p.grad = saved.to(device=p.device, dtype=p.dtype, copy=True) if saved is not None else None
            rank_zero_info(
                f"lightning_accum: resumed inside an accumulation group; its first {carried} micro-batch(es) come from"
                " the checkpoint (gradient and counters), so the group closes exactly."
            )
            return
        self._engine.note_missing_microbatches(position)
        reason = " without a consistent gradient" if carried and "gradients" not in group else ""
        rank_zero_warn(
            f"lightning_accum: resumed at micro-batch {position + 1} of an accumulation group, but the checkpoint"
            f" carries {carried} micro-batch(es) of that group{reason}, so none are carried over. The first {position}"
            " micro-batch(es) of the group, which Lightning does not run again, are not in its update (normalized by"
            " what remains). Checkpoints written between micro-batches (on_train_batch_end, OnExceptionCheckpoint"
            " after a failed hook there, SIGTERM) or at update boundaries resume exactly."
        )


class AccumulationStrategy(_ExactAccumulation, SingleDeviceStrategy):
    """Exact gradient accumulation on one device (strategy string ``"accum"``).

    Each micro-batch is weighted by its count of units, so the update applied after
    ``accumulate_grad_batches`` micro-batches is the gradient of ``Σ w·loss / Σ w`` over the whole group,
    whatever the micro-batch sizes. ``training_step`` returns the micro-batch's *mean* loss, alone or in
    a dict with ``"num_tokens"`` (supervised tokens) and/or ``"num_samples"``.

    Args:
        normalize: Unit each micro-batch is weighted by: ``"auto"`` (tokens if reported, else samples,
            else batches), ``"tokens"``, ``"samples"`` or ``"batches"``. The unit used is logged once and
            kept in ``ledger.normalization``.
        count_tokens: Optional ``batch -> int | Tensor``, used when ``training_step`` returns no ``num_tokens``.
        partial_group: ``"rescale"`` (update a partial final group with its real denominator) or ``"drop"``
            (no update for it; its micro-batches, samples and tokens are recorded in the ledger).
        schedule_on: ``"applied"`` (default): step-interval LR schedulers advance once per applied update
            (every ``frequency``-th applied update), never on a skipped one or per micro-batch;
            ``"attempted"``: once per attempt, skipped ones included.
        on_nonfinite: Without a GradScaler (fp32, bf16): ``"skip"`` (default) makes no update when the
            group's gradient holds a NaN/Inf (counted as ``"nonfinite"``, one warning naming the update),
            ``"raise"`` stops with an error naming the update and the first offending parameter,
            ``"ignore"`` keeps Lightning's behaviour (update anyway). With a GradScaler, its own check
            decides and skipped updates are counted as ``"overflow"``.
        max_consecutive_skips: Stop with an error after this many consecutive skipped updates (a loss that
            is NaN in every group would otherwise spin forever); ``None`` never stops.
        device: The device; by default the one the Trainer's accelerator selects.
        **kwargs: Passed to :class:`~lightning.pytorch.strategies.SingleDeviceStrategy`.

    ``trainer.global_step`` keeps Lightning's meaning (one per optimizer-step call: attempts, so
    ``max_steps`` behaves as users expect; a dropped partial group is counted too); the exact counts of
    attempted, applied and skipped updates are in :attr:`ledger` (``ledger.updates_applied``).

    Example:
        >>> import lightning as L
        >>> import lightning_accum
        >>> trainer = L.Trainer(strategy="accum", accumulate_grad_batches=4, accelerator="cpu", logger=False,
        ...                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        >>> type(trainer.strategy).__name__, trainer.strategy.engine.partial_group
        ('AccumulationStrategy', 'rescale')
    """

    strategy_name = "accum"

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
        self._init_engine(normalize, count_tokens, partial_group, schedule_on, on_nonfinite, max_consecutive_skips)
        super().__init__(device=device if device is not None else "cpu", **kwargs)
        self._device_given = device is not None

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        """The device chosen by the Trainer when none was given (read by Lightning's accelerator connector)."""
        return [self.root_device] if self._device_given else None

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        if not devices:
            return
        if len(devices) > 1:
            raise ValueError(
                f"strategy='accum' runs on one device, but the Trainer selected {len(devices)} devices. Use"
                " strategy='accum_ddp' (or 'accum_ddp_spawn') for several devices, or pass `devices=1`."
            )
        self._root_device = torch.device(devices[0])
        self._device_given = True

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("accum", cls, description="Exact gradient accumulation on one device", override=True)


class _LedgerReturningLauncher(_MultiProcessingLauncher):
    """Spawn/fork launcher that also brings rank zero's ledger back to the main process, and closes the process
    group in each worker before it exits (see :mod:`lightning_accum._worker_exit`)."""

    @override
    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        super()._wrapping_function(*args, **kwargs)
        close_process_group(self._strategy)

    @override
    def get_extra_results(self, trainer: Trainer) -> dict[str, Any]:
        extra = super().get_extra_results(trainer)
        extra[CHECKPOINT_KEY] = trainer.strategy.engine.state_dict()  # type: ignore[attr-defined]
        return extra

    @override
    def update_main_process_results(self, trainer: Trainer, extra: dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)
        if CHECKPOINT_KEY in extra:
            trainer.strategy.engine.load_state_dict(extra[CHECKPOINT_KEY])  # type: ignore[attr-defined]


class DDPAccumulationStrategy(_ExactAccumulation, DDPStrategy):
    """Exact gradient accumulation across data-parallel replicas (``"accum_ddp"`` and variants).

    DDP averages the replicas' gradients, so the gradient is rescaled by ``c · D / W_global`` once per
    update, with ``W_global`` the units of the whole group on all replicas, from one fused all-reduce of
    a small float64 vector. Lightning's ``no_sync`` stays on non-final micro-batches (forward included).

    Args:
        normalize: See :class:`AccumulationStrategy`.
        count_tokens: See :class:`AccumulationStrategy`.
        partial_group: See :class:`AccumulationStrategy`.
        schedule_on: See :class:`AccumulationStrategy`.
        on_nonfinite: See :class:`AccumulationStrategy`.
        max_consecutive_skips: See :class:`AccumulationStrategy`.
        **kwargs: Passed to :class:`~lightning.pytorch.strategies.DDPStrategy` (``start_method``,
            ``find_unused_parameters``, ``process_group_backend``, ...).

    An overflow or non-finite gradient on one replica reaches all of them (DDP averages the gradients before
    they are checked, so every replica checks the same values), and every replica takes the same decision.
    ``trainer.global_step`` counts attempts, as in Lightning; applied updates are in :attr:`ledger`.

    ``D`` is the world size: every process is one data replica (tensor or pipeline parallelism is not
    part of this strategy).

    Example:
        >>> import lightning as L
        >>> import lightning_accum
        >>> trainer = L.Trainer(strategy="accum_ddp_spawn", devices=2, accelerator="cpu", logger=False,
        ...                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        >>> type(trainer.strategy).__name__, trainer.strategy.data_parallel_replicas
        ('DDPAccumulationStrategy', 2)
    """

    strategy_name = "accum_ddp"

    def __init__(
        self,
        normalize: str = "auto",
        count_tokens: Callable[[Any], Count] | None = None,
        partial_group: str = "rescale",
        schedule_on: str = "applied",
        on_nonfinite: str = "skip",
        max_consecutive_skips: int | None = 100,
        **kwargs: Any,
    ) -> None:
        self._init_engine(normalize, count_tokens, partial_group, schedule_on, on_nonfinite, max_consecutive_skips)
        super().__init__(**kwargs)

    @property
    @override
    def data_parallel_replicas(self) -> int:
        return self.num_nodes * self.num_processes

    @override
    def _all_reduce_sum(self, tensor: Tensor) -> Tensor:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
        return tensor

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        text = str(exception).lower()
        if isinstance(exception, RuntimeError) and ("timed out" in text or "timeout" in text):
            # Every rank, not rank zero only: the rank that ran out of data may be the only one left to say so.
            warnings.warn(
                "lightning_accum: a collective timed out. If replicas ran out of training data at different"
                " micro-batches of the same accumulation group (an unevenly sharded iterable dataset), their"
                " collectives paired up wrongly before the group could close and be checked: shard the data"
                " evenly (drop the remainder). The wait is bounded by the strategy's `timeout=`.",
                UserWarning,
                stacklevel=1,
            )

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if isinstance(self._launcher, _MultiProcessingLauncher) and self._start_method != "popen":
            self._launcher = _LedgerReturningLauncher(self, start_method=self._start_method)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, options in (
            ("accum_ddp", {"start_method": "popen"}),
            ("accum_ddp_spawn", {"start_method": "spawn"}),
            ("accum_ddp_fork", {"start_method": "fork"}),
            ("accum_ddp_notebook", {"start_method": "fork"}),
            ("accum_ddp_find_unused_parameters_true", {"start_method": "popen", "find_unused_parameters": True}),
        ):
            strategy_registry.register(
                name, cls, description=f"Exact gradient accumulation with DDP ({options})", override=True, **options
            )


def _register() -> None:
    AccumulationStrategy.register_strategies(StrategyRegistry)
    DDPAccumulationStrategy.register_strategies(StrategyRegistry)
