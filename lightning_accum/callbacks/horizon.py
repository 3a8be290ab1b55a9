"""Drive a run by tokens, samples, documents or applied updates: a budget, validation points and checkpoint points."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_accum.axis_lr import check_counts_reported
from lightning_accum.callbacks.common import accumulation_strategy, format_count
from lightning_accum.ledger import AXES, AccumulationLedger
from lightning_accum.options import validate_choice
from lightning_accum.patching import InstancePatch

__all__ = ["UNITS", "Horizon"]

#: The unit each axis is counted in, as the budget and the progress bars show it.
UNITS = {"tokens": "tok", "samples": "sp", "updates": "upd", "documents": "doc"}


def _positive(argument: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(
            f"`{argument}` must be a positive int (a count on the Horizon's axis) or None; got {value!r}. Pass e.g."
            f" `{argument}=2_000_000_000` for 2 B tokens, or leave it out."
        )
    return value


def next_multiple(count: int, every: int) -> int:
    """The first multiple of ``every`` above ``count``."""
    return (count // every + 1) * every


class Horizon(Callback):
    """Stop, validate and checkpoint at counts of tokens, samples, documents or applied updates, read from the ledger
    after every attempted update (docs/howto.md, "Run on a token budget"). It logs no metric; with ``stop_at`` the
    progress bar shows ``budget``.

    Args:
        axis: ``"tokens"``, ``"samples"``, ``"documents"`` or ``"updates"`` (applied updates).
        stop_at: The budget: ``trainer.should_stop`` at the first update that reaches it; or ``None``.
        validate_every: A validation run at each multiple, besides Lightning's schedule; or ``None``.
        checkpoint_every: ``{dirpath}/{axis}={count}.ckpt`` at each multiple; or ``None``.
        dirpath: Folder of the checkpoints (:attr:`checkpoint_dir`).

    Raises:
        ValueError: For an unknown ``axis`` or a budget or interval that is not a positive int.
        RuntimeError: The Trainer's strategy is not an accumulation strategy, or the run reports no counts of
            ``axis``.

    Example:
        >>> import lightning as L
        >>> import lightning_accum
        >>> horizon = lightning_accum.Horizon(axis="tokens", stop_at=2_000_000_000, validate_every=100_000_000)
        >>> trainer = L.Trainer(strategy="accum", callbacks=[horizon], max_epochs=-1, accelerator="cpu",
        ...                     logger=False, enable_checkpointing=False)
    """

    def __init__(
        self,
        axis: str = "tokens",
        stop_at: int | None = None,
        validate_every: int | None = None,
        checkpoint_every: int | None = None,
        dirpath: str | Path | None = None,
    ) -> None:
        self.axis = validate_choice("axis", axis, AXES)
        self.stop_at = _positive("stop_at", stop_at)
        self.validate_every = _positive("validate_every", validate_every)
        self.checkpoint_every = _positive("checkpoint_every", checkpoint_every)
        self.dirpath = dirpath
        #: The next count at which to validate / write a checkpoint (``None`` until fitting starts).
        self.next_validation: int | None = None
        self.next_checkpoint: int | None = None
        #: Paths of the checkpoints written by this instance, in order.
        self.checkpoints: list[str] = []
        self._attempts_seen = 0
        self._validate_now = False
        self._checkpoint_after_validation = False
        self._trainer: Trainer | None = None
        self._patches: list[InstancePatch] = []  # released when the fit ends (teardown, on_exception)
        self._state_key: tuple[str, str] | None = None  # (axis, key)

    @property
    @override
    def state_key(self) -> str:
        # The axis only: a run resumed with another budget or interval still finds its state (and recomputes).
        # Lightning formats this key for every hook call it profiles: formed once per axis.
        key = self._state_key
        if key is None or key[0] != self.axis:
            key = self._state_key = (self.axis, self._generate_state_key(axis=self.axis))
        return key[1]

    # ------------------------------------------------------------------ counts

    def count(self, ledger: AccumulationLedger) -> int:
        """The current count on the Horizon's axis."""
        return int(getattr(ledger, AXES[self.axis]))

    # ------------------------------------------------------------------ set-up and tear-down

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        accumulation_strategy(trainer, "Horizon")
        if stage != "fit":
            return
        self._release()  # what an earlier fit on this instance left (none unless its end was never reached)
        self._trainer = trainer
        self.next_validation = self.next_checkpoint = None  # set by `load_state_dict` or `on_train_start`
        self.checkpoints = []
        self._validate_now = self._checkpoint_after_validation = False
        if self.validate_every is not None:
            self._patch_validation_check(trainer)
        bar = trainer.progress_bar_callback
        if self.stop_at is not None and bar is not None:

            def get_metrics(original: Callable[..., Any], trainer: Trainer, pl_module: LightningModule) -> Any:
                metrics = original(trainer, pl_module)
                if self._trainer is not None and self.stop_at is not None:
                    count = self.count(trainer.strategy.ledger)  # type: ignore[attr-defined]
                    metrics["budget"] = f"{format_count(count)}/{format_count(self.stop_at)} {UNITS[self.axis]}"
                return metrics

            self._patches.append(InstancePatch(bar, "get_metrics", get_metrics))

    def _patch_validation_check(self, trainer: Trainer) -> None:
        loop = trainer.fit_loop.epoch_loop
        original = getattr(loop, "_should_check_val_fx", None)
        if not callable(original):
            import lightning

            raise RuntimeError(
                "Horizon(validate_every=...) asks Lightning's training loop to validate through"
                f" `fit_loop.epoch_loop._should_check_val_fx`, which Lightning {lightning.__version__} does not have."
                " Pin lightning to a tested version (2.6), or leave `validate_every` out and use `val_check_interval`."
            )

        def should_check_val(original: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
            if self._validate_now and trainer.enable_validation:
                return True
            return bool(original(*args, **kwargs))

        self._patches.append(InstancePatch(loop, "_should_check_val_fx", should_check_val))

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._release()

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._release()  # Lightning calls no callback's `teardown` after an exception

    def _release(self) -> None:
        for patch in reversed(self._patches):
            patch.release()
        self._patches = []
        self._trainer = None

    # ------------------------------------------------------------------ the run

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        ledger = accumulation_strategy(trainer, "Horizon").ledger
        count = self.count(ledger)
        self._attempts_seen = ledger.updates_attempted
        if self.validate_every is not None and self.next_validation is None:
            self.next_validation = next_multiple(count, self.validate_every)
        if self.checkpoint_every is not None and self.next_checkpoint is None:
            self.next_checkpoint = next_multiple(count, self.checkpoint_every)
        if self.validate_every is not None and not trainer.enable_validation:
            rank_zero_warn(
                f"Horizon(validate_every={self.validate_every}) has nothing to run: the Trainer has no validation"
                " (a `val_dataloaders` loader, a `validation_step` and `limit_val_batches > 0` are needed)."
            )
        if self.stop_at is not None and count >= self.stop_at:
            rank_zero_info(f"Horizon: the run is already at {count} {self.axis}, at or past stop_at={self.stop_at}.")
            trainer.should_stop = True

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._validate_now = False
        if self._checkpoint_after_validation:  # the validation did not run after all: write it now
            self._checkpoint_after_validation = False
            self._save(trainer)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        ledger = trainer.strategy.ledger  # type: ignore[attr-defined]
        if ledger.updates_attempted == self._attempts_seen:
            return  # inside a group, or a dropped partial group: no update boundary
        self._attempts_seen = ledger.updates_attempted
        check_counts_reported("Horizon", self.axis, ledger)
        count = self.count(ledger)
        checkpoint_due = False
        if self.next_checkpoint is not None and self.checkpoint_every is not None and count >= self.next_checkpoint:
            self.next_checkpoint = next_multiple(count, self.checkpoint_every)
            checkpoint_due = True
        if self.next_validation is not None and self.validate_every is not None and count >= self.next_validation:
            self.next_validation = next_multiple(count, self.validate_every)
            self._validate_now = True
        if self.stop_at is not None and count >= self.stop_at:
            rank_zero_info(f"Horizon: stopping at {count} {self.axis} (stop_at={self.stop_at}).")
            trainer.should_stop = True
        if checkpoint_due:
            if self._validate_now and trainer.enable_validation:
                self._checkpoint_after_validation = True  # Lightning validates right after this hook
            else:
                self._save(trainer)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._checkpoint_after_validation and not trainer.sanity_checking:
            self._checkpoint_after_validation = False
            self._save(trainer)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._checkpoint_after_validation:
            self._checkpoint_after_validation = False
            self._save(trainer)
        count = self.count(trainer.strategy.ledger)  # type: ignore[attr-defined]
        if self.stop_at is not None and count < self.stop_at:
            rank_zero_warn(
                f"Horizon: training ended at {count} {self.axis}, before stop_at={self.stop_at}: the Trainer's"
                " `max_epochs`/`max_steps`/`max_time` ended it first. Pass `max_epochs=-1` to let the budget decide."
            )

    # ------------------------------------------------------------------ checkpoints

    def checkpoint_dir(self, trainer: Trainer) -> Path:
        """The checkpoints' folder: ``dirpath``, the ``ModelCheckpoint``'s, else ``{default_root_dir}/checkpoints``."""
        if self.dirpath is not None:
            return Path(self.dirpath)
        callback = trainer.checkpoint_callback
        if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
            return Path(callback.dirpath)
        return Path(trainer.default_root_dir) / "checkpoints"

    def _save(self, trainer: Trainer) -> None:
        count = self.count(trainer.strategy.ledger)  # type: ignore[attr-defined]
        path = self.checkpoint_dir(trainer) / f"{self.axis}={count}.ckpt"
        trainer.save_checkpoint(path, weights_only=False)  # every rank takes part; the strategy writes once
        self.checkpoints.append(str(path))

    # ------------------------------------------------------------------ state

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "axis": self.axis,
            "stop_at": self.stop_at,
            "validate_every": self.validate_every,
            "checkpoint_every": self.checkpoint_every,
            "next_validation": self.next_validation,
            "next_checkpoint": self.next_checkpoint,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # The saved points hold only for the intervals they were computed with; otherwise `on_train_start` recomputes.
        if state_dict.get("validate_every") == self.validate_every:
            self.next_validation = state_dict.get("next_validation")
        if state_dict.get("checkpoint_every") == self.checkpoint_every:
            self.next_checkpoint = state_dict.get("next_checkpoint")
