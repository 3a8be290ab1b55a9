"""strategies/trainer_side: a group ends where Lightning's grouping ends it, by position or at the epoch's end."""

from __future__ import annotations

import lightning as L
from helpers import TinyLM, fit, make_examples

from lightning_accum.strategies.trainer_side import ends_group_by_position


class _Ends(L.Callback):
    """The batches whose backward the side says ends its group, and those Lightning steps the optimizer at."""

    def __init__(self) -> None:
        self.ends: list[int] = []
        self.steps: list[int] = []

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if ends_group_by_position(trainer):
            self.ends.append(trainer.fit_loop.epoch_loop.batch_idx)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: object) -> None:
        self.steps.append(trainer.fit_loop.epoch_loop.batch_idx)


def test_a_group_ends_at_every_a_th_micro_batch_and_at_the_epochs_last() -> None:
    # 7 batches with A = 3: Lightning's groups [0, 1, 2], [3, 4, 5] and the epoch's partial [6]. Where this says a
    # group ends, a sharded strategy's backward synchronises and DDP's side reads a failed collective as a lost peer.
    ends = _Ends()
    fit(TinyLM(), make_examples([3] * 7), batch_size=1, accumulate=3, callbacks=[ends], max_epochs=2)
    assert ends.ends == ends.steps == [2, 5, 6] * 2
