"""Test parts for Horizon and AxisLR: a TinyLM with validation and an AxisLR, a trace of every update, references."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from helpers import ListDataset, RankStridedSampler, TinyLM, make_trainer
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_accum import AxisLR, GroupRecord


class HorizonLM(TinyLM):
    """TinyLM with a validation step and an AxisLR in a step-interval config."""

    def __init__(
        self,
        lr_lambda: Callable[[int], float] | None = None,
        axis: str = "tokens",
        lr: float = 0.5,
        seed: int = 0,
        optimizer: str = "sgd",
        report: str = "tokens",
    ) -> None:
        super().__init__(lr=lr, seed=seed, optimizer=optimizer, report=report)
        self.lr_lambda = lr_lambda
        self.axis = axis
        self.validation_runs = 0

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.mean_loss(batch)

    def on_validation_epoch_start(self) -> None:
        if not self.trainer.sanity_checking:
            self.validation_runs += 1

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["validation_runs"] = self.validation_runs  # tells whether a checkpoint came before a validation

    def configure_optimizers(self) -> Any:
        optimizer = super().configure_optimizers()
        if self.lr_lambda is None:
            return optimizer
        scheduler = AxisLR(optimizer, axis=self.axis, lr_lambda=self.lr_lambda)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Trace(L.Callback):
    """Records, through the engine's group listener, every update's count before it and the rate it used, and the
    ledger's tokens at every validation run; writes them to `path` (JSON) at the end."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self.updates: list[dict[str, Any]] = []
        self.validations: list[int] = []
        self._trainer: L.Trainer | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._trainer = trainer
        trainer.strategy.add_group_listener(self._on_group)  # type: ignore[attr-defined]

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        trainer.strategy.remove_group_listener(self._on_group)  # type: ignore[attr-defined]

    def _on_group(self, record: GroupRecord, batch_samples: Sequence[int]) -> None:
        assert self._trainer is not None
        if record.dropped:
            return
        ledger = self._trainer.strategy.ledger  # type: ignore[attr-defined]
        # Listeners run after the update and before the schedules advance: this is the rate the update used.
        lr = float(self._trainer.optimizers[0].param_groups[0]["lr"])
        self.updates.append(
            {
                "tokens_before": ledger.tokens - record.tokens,
                "tokens": record.tokens,
                "lr": lr,
                "applied": record.applied,
            }
        )

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.validations.append(int(trainer.strategy.ledger.tokens))  # type: ignore[attr-defined]

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A path with "{rank}" is written by every rank, else by global rank zero only.
        if self.path is not None and (trainer.is_global_zero or "{rank}" in self.path):
            params = torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()]).tolist()
            data = {
                "updates": self.updates,
                "validations": self.validations,
                "ledger": trainer.strategy.ledger.state_dict(),  # type: ignore[attr-defined]
                "params": params,
            }
            Path(self.path.format(rank=trainer.global_rank)).write_text(json.dumps(data))


def loaders(
    examples: list[dict[str, Tensor]], batch_size: int, distributed: bool = False, loader_class: type = DataLoader
) -> tuple[DataLoader, DataLoader]:
    """Training loader (rank-strided under DDP, unshuffled) and a small validation loader."""
    sampler = RankStridedSampler(len(examples)) if distributed else None
    train = loader_class(ListDataset(examples), batch_size=batch_size, shuffle=False, sampler=sampler)
    val = DataLoader(ListDataset(examples[:4]), batch_size=4)
    return train, val


def trainer_for(
    accumulate: int, callbacks: list[L.Callback], devices: int = 1, strategy: str = "accum", **kwargs: Any
) -> L.Trainer:
    """A quiet CPU Trainer that validates only when the Horizon (or a stop) asks for it."""
    options: dict[str, Any] = {"max_epochs": -1, "check_val_every_n_epoch": None, "val_check_interval": 10**9}
    options.update(kwargs)
    return make_trainer(
        strategy=strategy, devices=devices, accumulate_grad_batches=accumulate, callbacks=callbacks, **options
    )


def reference_points(group_tokens: Sequence[int], stop_at: int, every: int | None) -> tuple[list[int], list[int]]:
    """From the tokens of each update (repeating epochs), the cumulative counts after each update up to the stop,
    and the counts at the first update reaching each multiple of `every` (the Horizon's points)."""
    counts: list[int] = []
    total = 0
    while total < stop_at:
        for tokens in group_tokens:
            total += tokens
            counts.append(total)
            if total >= stop_at:
                break
    points: list[int] = []
    if every is not None:
        next_point = every
        for count in counts:
            if count >= next_point:
                points.append(count)
                next_point = (count // every + 1) * every
    return counts, points


def load_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    return json.loads(Path(path).read_text())  # type: ignore[no-any-return]
