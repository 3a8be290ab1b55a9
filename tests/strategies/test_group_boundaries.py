"""Where groups start and end: under a schedule Lightning's loop is told (the Trainer's `accumulate_grad_batches` a
plain int, the running group's size); a writer of that attribute inside an epoch is refused; what Lightning computes
from a fixed size (`estimated_stepping_batches`) is refused in `configure_optimizers`."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from helpers import TinyLM, fit, make_examples
from lightning.pytorch.callbacks import StochasticWeightAveraging

from lightning_accum import AccumulationStrategy, BatchSchedule

EXAMPLES = make_examples([3, 4, 5, 2, 6, 1, 3, 4], seed=5)
#: On samples with m = 1: groups of 1 until 2 samples are consumed, then of 3: [0], [1], [2, 3, 4], [5, 6, 7]. The
#: groups of 3 start at batches 2 and 5, not multiples of 3.
RAMP = {0: 1, 2: 3}


class Where(L.Callback):
    """The batches where Lightning zeroes the gradient and steps the optimizer, and the attribute each batch reads."""

    def __init__(self) -> None:
        self.zeroed: list[int] = []
        self.stepped: list[int] = []
        self.read: list[Any] = []
        self.patched: list[bool] = []

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        loop = trainer.fit_loop.epoch_loop
        told = "_accumulated_batches_reached" in vars(loop), "_make_zero_grad_fn" in vars(loop.automatic_optimization)
        self.patched.append(all(told) if any(told) else False)

    def on_before_backward(self, trainer: L.Trainer, *args: Any) -> None:
        self.read.append(trainer.accumulate_grad_batches)

    def on_before_zero_grad(self, trainer: L.Trainer, *args: Any) -> None:
        self.zeroed.append(trainer.fit_loop.epoch_loop.batch_idx)

    def on_before_optimizer_step(self, trainer: L.Trainer, *args: Any) -> None:
        self.stepped.append(trainer.fit_loop.epoch_loop.batch_idx)


def _scheduled(stages: dict[int, int] = RAMP) -> AccumulationStrategy:
    return AccumulationStrategy(batch_schedule=BatchSchedule(stages, axis="samples"))


def test_lightning_starts_and_ends_each_scheduled_group_where_it_is_and_reads_its_size_as_a_plain_int() -> None:
    where = Where()
    trainer = fit(TinyLM(lr=0.5), EXAMPLES, batch_size=1, accumulate=1, strategy=_scheduled(), callbacks=[where])
    assert (where.zeroed, where.stepped) == ([0, 1, 2, 5], [0, 1, 4, 7])
    assert where.read == [1, 1, 3, 3, 3, 3, 3, 3] and {type(a) for a in where.read} == {int}
    assert [divmod(7, a) for a in where.read[2:3]] == [(7 // 3, 7 % 3)]  # a plain int: every operator agrees
    assert all(where.patched)  # the loop was told, for the fit
    loop = trainer.fit_loop.epoch_loop
    assert "_accumulated_batches_reached" not in vars(loop)
    assert "_make_zero_grad_fn" not in vars(loop.automatic_optimization)
    assert type(trainer.accumulate_grad_batches) is int and trainer.accumulate_grad_batches == 1  # given back
    assert trainer.strategy.ledger.updates_applied == 4


def test_without_a_schedule_nothing_is_patched_and_after_an_exception_the_loop_is_given_back() -> None:
    where = Where()
    fit(TinyLM(), EXAMPLES, batch_size=1, accumulate=3, callbacks=[where])
    assert (where.zeroed, where.stepped, where.patched) == ([0, 3, 6], [2, 5, 7], [False] * 8)

    class Fails(TinyLM):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if batch_idx == 3:
                raise ValueError("planted")
            return super().training_step(batch, batch_idx)

    trainer = L.Trainer(strategy=_scheduled(), accelerator="cpu", max_epochs=1, logger=False, barebones=True)
    with pytest.raises(ValueError, match="planted"):
        trainer.fit(Fails(), torch.utils.data.DataLoader(EXAMPLES, batch_size=1))
    loop = trainer.fit_loop.epoch_loop
    assert "_accumulated_batches_reached" not in vars(loop)
    assert "_make_zero_grad_fn" not in vars(loop.automatic_optimization)
    assert trainer.accumulate_grad_batches == 1


class StepModeAccumulation(L.Callback):
    """What Lightning's open PR #21583 adds (`GradientAccumulationScheduler(mode="step")`): the factor read from
    `trainer.global_step` and set in `on_train_batch_start`, at every batch."""

    def __init__(self, scheduling: dict[int, int]) -> None:
        self.scheduling = scheduling

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        keys = [step for step in sorted(self.scheduling) if step <= trainer.global_step]
        trainer.accumulate_grad_batches = self.scheduling[keys[-1]]


def test_a_step_mode_accumulation_scheduler_cuts_a_group_in_lightning_and_is_refused_here() -> None:
    # From the first update on, groups of 3 are asked for: Lightning's own strategy ends the group at batch 2 alone,
    # where 3 divides the batches ready (a group of one micro-batch, silently).
    where = Where()
    steps = StepModeAccumulation({0: 2, 1: 3})
    fit(TinyLM(), EXAMPLES, batch_size=1, accumulate=1, strategy="auto", callbacks=[steps, where])
    sizes = [b - a for a, b in zip([-1, *where.stepped], where.stepped, strict=False)]
    assert sizes == [2, 1, 3, 2]
    inside = r"changed from 2 to 3 before batch 2 of epoch 0, inside the epoch: .*PR #21583.*at an epoch's start"
    with pytest.raises(RuntimeError, match=inside):
        fit(TinyLM(), EXAMPLES, batch_size=1, accumulate=1, callbacks=[steps])
    scheduled = r"from 1 to 2 before batch 0 of epoch 0, which the strategy sets at each group.s start.*as `batch_sch"
    with pytest.raises(RuntimeError, match=scheduled):
        fit(TinyLM(), EXAMPLES, batch_size=1, accumulate=1, strategy=_scheduled(), callbacks=[steps])


class NormedLM(TinyLM):
    """TinyLM with a BatchNorm over the embedding: StochasticWeightAveraging adds its batch-norm epoch."""

    def __init__(self) -> None:
        super().__init__(lr=0.5)
        self.norm = torch.nn.BatchNorm1d(8)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(torch.tanh(self.embed(input_ids)).transpose(1, 2)).transpose(1, 2)
        return self.head(hidden)  # type: ignore[no-any-return]


def test_swa_writes_at_its_batch_norm_epochs_start_allowed_alone_and_refused_under_a_schedule() -> None:
    def swa() -> StochasticWeightAveraging:
        return StochasticWeightAveraging(swa_lrs=0.1, swa_epoch_start=1)

    plain = fit(NormedLM(), EXAMPLES, batch_size=2, accumulate=2, strategy="auto", callbacks=[swa()], max_epochs=2)
    ours = fit(NormedLM(), EXAMPLES, batch_size=2, accumulate=2, callbacks=[swa()], max_epochs=2)
    assert ours.global_step == plain.global_step == 5 and ours.current_epoch == 3  # the batch-norm epoch ran
    refused = r"changed from 2 to 5 before batch 0 of epoch 2, which the strategy sets.*`StochasticWeightAveraging`'s"
    with pytest.raises(RuntimeError, match=refused):
        fit(NormedLM(), EXAMPLES, 2, accumulate=1, strategy=_scheduled({0: 4}), callbacks=[swa()], max_epochs=2)


class OneCycle(TinyLM):
    """Sizes a step-interval `OneCycleLR` by `trainer.estimated_stepping_batches`, as Lightning's docs show."""

    def configure_optimizers(self) -> Any:
        optimizer = super().configure_optimizers()
        total = self.trainer.estimated_stepping_batches
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.5, total_steps=int(total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def test_estimated_stepping_batches_is_refused_in_configure_optimizers_under_a_schedule() -> None:
    trainer = fit(OneCycle(), EXAMPLES, batch_size=1, accumulate=2)  # without a schedule: Lightning's count
    assert trainer.estimated_stepping_batches == 4 == trainer.lr_scheduler_configs[0].scheduler.total_steps
    trainer = L.Trainer(strategy=_scheduled(), accelerator="cpu", max_epochs=1, logger=False, barebones=True)
    refused = r"read in `configure_optimizers` under `batch_schedule=`: .* not known before the groups run\. .*`AxisLR`"
    with pytest.raises(RuntimeError, match=refused):
        trainer.fit(OneCycle(), torch.utils.data.DataLoader(EXAMPLES, batch_size=1))
    assert type(trainer.accumulate_grad_batches) is int and trainer.accumulate_grad_batches == 1


def test_slices_of_scheduled_groups_give_the_unsliced_updates() -> None:
    # m = 2 samples per batch: groups of 1 batch until 4 samples are consumed, then of 3 (starting at batch 2, which 3
    # does not divide). `microbatch_size=1` cuts each batch in two: the same updates.
    examples = make_examples([3, 4, 5, 2, 6, 1, 3, 4, 2, 5, 6, 3], seed=8)
    params = []
    for microbatch_size in (None, 1):
        model = TinyLM(lr=0.5, seed=8)
        strategy = AccumulationStrategy(
            batch_schedule=BatchSchedule({0: 2, 4: 6}, axis="samples"), microbatch_size=microbatch_size
        )
        trainer = fit(model, examples, batch_size=2, accumulate=1, strategy=strategy)
        assert [s["accumulate_grad_batches"] for s in trainer.strategy.batch_stages] == [1, 3]
        params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert trainer.strategy.ledger.updates_applied == 4
    torch.testing.assert_close(params[1], params[0], rtol=1e-6, atol=1e-7)
