"""Skipped updates under GradScaler (fp16), the non-finite guard without one, and schedules on applied updates."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from helpers import (
    ListDataset,
    RecordOnRanks,
    TinyLM,
    fit,
    load_ranks,
    make_examples,
    make_trainer,
    params_vector,
    run_ddp,
)
from lightning.pytorch.plugins import MixedPrecision
from torch.utils.data import DataLoader

from lightning_accum import AccumulationLedger, AccumulationStrategy, DDPAccumulationStrategy

A = 2
M = 2
LENGTH = 5  # equal lengths: every group has the same token count, so runs with and without a group share c


class PoisonedLM(TinyLM):
    """TinyLM whose loss becomes `poison` (inf or nan) in the chosen groups of the first epoch, on chosen ranks."""

    def __init__(
        self,
        bad_groups: tuple[int, ...] = (),
        poison: float = float("inf"),
        ranks: tuple[int, ...] = (0,),
        scheduler: bool = True,
        frequency: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.bad_groups, self.poison, self.ranks = bad_groups, poison, ranks
        self.use_scheduler, self.frequency = scheduler, frequency

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        group = batch_idx // self.trainer.accumulate_grad_batches
        if self.current_epoch == 0 and group in self.bad_groups and self.global_rank in self.ranks:
            out["loss"] = out["loss"] * self.poison
        return out

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "adamw_fused":
            optimizer: torch.optim.Optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, fused=True)
        elif self.optimizer_name == "adamw":
            optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        else:
            optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        if not self.use_scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": self.frequency},
        }


def fit_without_scheduler_order_warning(*args: Any, **kwargs: Any) -> L.Trainer:
    """`fit`, failing if torch warns that the scheduler stepped before the optimizer."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(*args, **kwargs)
    order = [str(w.message) for w in caught if "lr_scheduler.step()" in str(w.message)]
    assert not order, order
    return trainer


def fp16() -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))


def examples_without(
    groups: tuple[int, ...], count: int
) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    examples = make_examples([LENGTH] * count, seed=13)
    per_group = M * A
    kept = [e for i, e in enumerate(examples) if i // per_group not in groups]
    return examples, kept


@pytest.mark.parametrize("optimizer", ["sgd", "adamw", "adamw_fused"])
def test_fp16_overflow_is_a_skipped_update_and_the_schedule_does_not_advance(optimizer: str) -> None:
    examples, kept = examples_without((1,), 16)  # 4 groups; group 1 overflows
    model = PoisonedLM(bad_groups=(1,), lr=0.1, optimizer=optimizer)
    trainer = fit_without_scheduler_order_warning(model, examples, batch_size=M, accumulate=A, plugins=[fp16()])
    ledger = trainer.strategy.ledger
    assert (ledger.updates_attempted, ledger.updates_applied, ledger.updates_skipped["overflow"]) == (4, 3, 1)
    assert ledger.skipped_total == 1 and trainer.global_step == 4  # global_step counts attempts, as in Lightning
    assert ledger.last_group is not None and ledger.last_group.applied and ledger.last_group.grad_scale is not None
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    assert lr == pytest.approx(0.1 * 0.5**ledger.updates_applied)

    reference = PoisonedLM(lr=0.1, optimizer=optimizer)
    ref_trainer = fit(reference, kept, batch_size=M, accumulate=A, plugins=[fp16()])
    assert ref_trainer.strategy.ledger.updates_applied == 3
    torch.testing.assert_close(params_vector(model), params_vector(reference), rtol=1e-6, atol=1e-7)
    state = trainer.optimizers[0].state_dict()["state"]
    ref_state = ref_trainer.optimizers[0].state_dict()["state"]
    for key in state:
        for name, value in state[key].items():
            torch.testing.assert_close(value, ref_state[key][name], rtol=1e-6, atol=1e-7)


def test_first_update_skipped_keeps_schedule_at_its_start_without_torch_warning() -> None:
    examples, _ = examples_without((), 8)
    model = PoisonedLM(bad_groups=(0,), lr=0.1)
    trainer = fit_without_scheduler_order_warning(model, examples, batch_size=M, accumulate=A, plugins=[fp16()])
    ledger = trainer.strategy.ledger
    assert (ledger.updates_attempted, ledger.updates_applied) == (2, 1)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05)


def test_schedule_on_attempted_restores_one_advance_per_attempt() -> None:
    examples, _ = examples_without((), 16)
    model = PoisonedLM(bad_groups=(1,), lr=0.1)
    strategy = AccumulationStrategy(schedule_on="attempted")
    trainer = fit(model, examples, batch_size=M, accumulate=A, strategy=strategy, plugins=[fp16()])
    assert trainer.strategy.ledger.updates_applied == 3
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**4)


@pytest.mark.parametrize("frequency", [2, 3])
def test_schedule_frequency_counts_applied_updates_not_batches(frequency: int) -> None:
    # 6 groups of A = 2, group 2 skipped: 5 applied updates. Lightning would compare the frequency with
    # the batch index (every micro-batch); here it advances on every `frequency`-th applied update.
    examples, _ = examples_without((), 24)
    model = PoisonedLM(bad_groups=(2,), lr=0.1, frequency=frequency)
    trainer = fit(model, examples, batch_size=M, accumulate=A, plugins=[fp16()])
    assert trainer.strategy.ledger.updates_applied == 5
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** (5 // frequency))


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_nonfinite_skip_without_scaler(precision: str) -> None:
    examples, kept = examples_without((1,), 12)
    model = PoisonedLM(bad_groups=(1,), poison=float("nan"), lr=0.1)
    with pytest.warns(
        UserWarning, match=r"skipped update 2: its gradient is not finite \(first non-finite gradient: `embed.weight`"
    ):
        trainer = fit(model, examples, batch_size=M, accumulate=A, precision=precision)
    ledger = trainer.strategy.ledger
    assert (ledger.updates_attempted, ledger.updates_applied, ledger.updates_skipped["nonfinite"]) == (3, 2, 1)
    assert ledger.last_group is not None and ledger.last_group.grad_scale is None
    reference = PoisonedLM(lr=0.1)
    fit(reference, kept, batch_size=M, accumulate=A, precision=precision)
    assert torch.isfinite(params_vector(model)).all()
    torch.testing.assert_close(params_vector(model), params_vector(reference), rtol=1e-6, atol=1e-7)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_nonfinite_raise_names_update_and_parameter(precision: str) -> None:
    examples, _ = examples_without((), 8)
    model = PoisonedLM(bad_groups=(1,), poison=float("nan"))
    strategy = AccumulationStrategy(on_nonfinite="raise")
    with pytest.raises(
        RuntimeError, match=r"The gradient of update 2 is not finite \(first non-finite gradient: `embed.weight`"
    ):
        fit(model, examples, batch_size=M, accumulate=A, strategy=strategy, precision=precision)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_nonfinite_ignore_keeps_lightnings_behaviour(precision: str) -> None:
    examples, _ = examples_without((), 8)
    model = PoisonedLM(bad_groups=(1,), poison=float("nan"))
    strategy = AccumulationStrategy(on_nonfinite="ignore")
    trainer = fit(model, examples, batch_size=M, accumulate=A, strategy=strategy, precision=precision)
    assert trainer.strategy.ledger.updates_applied == 2
    assert not torch.isfinite(params_vector(model)).all()  # the NaN update went through, as Lightning does


def test_invalid_mixed_precision_arguments() -> None:
    with pytest.raises(ValueError, match=r"`schedule_on` must be one of 'applied', 'attempted'; got 'always'"):
        AccumulationStrategy(schedule_on="always")
    with pytest.raises(ValueError, match=r"`on_nonfinite` must be one of 'skip', 'raise', 'ignore'; got 'zero'"):
        DDPAccumulationStrategy(on_nonfinite="zero")


def test_scheduler_objects_are_restored_and_checkpoints_load_in_plain_lightning(tmp_path: Path) -> None:
    examples, _ = examples_without((), 8)
    model = PoisonedLM(bad_groups=(0,), lr=0.1)
    trainer = fit(model, examples, batch_size=M, accumulate=A, plugins=[fp16()])
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert type(scheduler) is torch.optim.lr_scheduler.StepLR
    path = tmp_path / "skip.ckpt"
    trainer.save_checkpoint(path)
    assert torch.load(path, weights_only=True)["lr_schedulers"][0]["last_epoch"] == 1

    plain = make_trainer(strategy="auto", max_epochs=2)
    resumed = PoisonedLM(lr=0.1)
    plain.fit(resumed, DataLoader(ListDataset(examples), batch_size=M), ckpt_path=path)
    assert plain.lr_scheduler_configs[0].scheduler.last_epoch == 1 + 4  # plain Lightning steps per batch


def test_resume_after_a_skipped_update_continues_counters_and_lr(tmp_path: Path) -> None:
    examples, _ = examples_without((), 8)  # 2 groups per epoch; group 1 of epoch 0 overflows

    def trainer(epochs: int) -> L.Trainer:
        return make_trainer(accumulate_grad_batches=A, max_epochs=epochs, plugins=[fp16()])

    loader = DataLoader(ListDataset(examples), batch_size=M)
    whole = trainer(3)
    whole_model = PoisonedLM(bad_groups=(1,), lr=0.1)
    whole.fit(whole_model, loader)

    first = trainer(1)
    first.fit(PoisonedLM(bad_groups=(1,), lr=0.1), loader)
    assert first.strategy.ledger.updates_skipped["overflow"] == 1
    path = tmp_path / "after-skip.ckpt"
    first.save_checkpoint(path)
    second = trainer(3)
    resumed_model = PoisonedLM(bad_groups=(1,), lr=0.1)
    second.fit(resumed_model, loader, ckpt_path=path)

    assert second.strategy.ledger == whole.strategy.ledger
    assert (second.strategy.ledger.updates_attempted, second.strategy.ledger.updates_applied) == (6, 5)
    assert (
        second.optimizers[0].param_groups[0]["lr"]
        == whole.optimizers[0].param_groups[0]["lr"]
        == pytest.approx(0.1 * 0.5**5)
    )
    torch.testing.assert_close(params_vector(resumed_model), params_vector(whole_model), rtol=1e-6, atol=1e-7)


def _poisoned_on_rank_one(rank: int, folder: str, reason: str) -> None:
    examples = make_examples([LENGTH] * 16, seed=17)
    # fp16 with a GradScaler: an Inf loss overflows; fp32 without one: a NaN loss trips the non-finite guard.
    model = PoisonedLM(bad_groups=(1,), ranks=(1,), lr=0.1, poison=float("inf" if reason == "overflow" else "nan"))
    fit(
        model,
        examples,
        batch_size=M,
        accumulate=A,
        strategy="accum_ddp",
        devices=2,
        plugins=[fp16()] if reason == "overflow" else [],
        callbacks=[RecordOnRanks(folder, reason)],
    )


@pytest.mark.ddp
@pytest.mark.timeout(600)
@pytest.mark.parametrize("reason", ["overflow", "nonfinite"])
def test_a_nonfinite_gradient_on_one_rank_skips_on_both(tmp_path: Path, reason: str) -> None:
    run_ddp(_poisoned_on_rank_one, str(tmp_path), reason)
    ranks = load_ranks(str(tmp_path), reason)
    ledgers = []
    for rank in ranks:
        ledger = AccumulationLedger()
        ledger.load_state_dict(rank["ledger"])
        ledgers.append(ledger)
    assert ledgers[0] == ledgers[1]
    assert (ledgers[0].updates_attempted, ledgers[0].updates_applied, ledgers[0].updates_skipped[reason]) == (2, 1, 1)
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])
    assert torch.isfinite(ranks[0]["params"]).all()


def test_the_scheduler_order_warning_is_real_with_attempted_schedules() -> None:
    # The check used above can fail: advancing on a skipped first update (schedule_on="attempted", Lightning's
    # behaviour) makes torch warn that the scheduler stepped before the optimizer.
    examples, _ = examples_without((), 8)
    strategy = AccumulationStrategy(schedule_on="attempted")
    with pytest.raises(AssertionError, match=r"lr_scheduler\.step\(\)"):
        fit_without_scheduler_order_warning(
            PoisonedLM(bad_groups=(0,), lr=0.1),
            examples,
            batch_size=M,
            accumulate=A,
            strategy=strategy,
            plugins=[fp16()],
        )


def _lengths_to_examples(lengths: list[int], seq: int, seed: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    examples = []
    for n in lengths:
        ids = torch.randint(0, 11, (seq,), generator=gen)
        labels = torch.randint(0, 11, (seq,), generator=gen)
        labels[n:] = -100
        examples.append({"input_ids": ids, "labels": labels})
    return examples


class _ScaleTrace(L.Callback):
    """The GradScaler's scale before each zero_grad (after each optimizer step): a drop is a skipped update."""

    def __init__(self) -> None:
        self.scales: list[float] = []

    def on_before_zero_grad(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.scales.append(trainer.precision_plugin.scaler.get_scale())  # type: ignore[attr-defined]

    def skips(self) -> int:
        return sum(1 for a, b in zip(self.scales, self.scales[1:], strict=False) if b < a)


def _fp16_overflow_skips(strategy: str, examples: list[dict[str, torch.Tensor]]) -> int:
    trace = _ScaleTrace()
    trainer = fit(TinyLM(lr=0.1), examples, 2, 2, strategy=strategy, plugins=[fp16()], callbacks=[trace])
    if strategy == "accum":
        assert trainer.strategy.ledger.updates_skipped["overflow"] == trace.skips()  # type: ignore[attr-defined]
    return trace.skips()


@pytest.mark.parametrize("distribution", ["bimodal", "lognormal"])
def test_fp16_overflow_skips_no_more_than_plain_lightning_whatever_the_group_sizes(distribution: str) -> None:
    if distribution == "bimodal":
        # Groups (m = 2, A = 2) alternate between 1 supervised token and 4 × 32: with c taken from the previous
        # group alone, every full group after a 1-token group back-propagated 128 × Lightning's loss / A and
        # overflowed (3 of 8 updates skipped before; plain Lightning skips none).
        lengths = [n for g in range(8) for n in ([1, 0, 0, 0] if g % 2 == 0 else [32] * 4)]
        examples = _lengths_to_examples(lengths, seq=32, seed=0)
    else:  # heavy-tailed: groups of a few to a few thousand tokens
        gen = torch.Generator().manual_seed(3)
        draws = torch.exp(3.0 + 1.5 * torch.randn(64, generator=gen))
        examples = _lengths_to_examples(draws.clamp(1, 1024).round().int().tolist(), seq=1024, seed=1)
    plain = _fp16_overflow_skips("auto", examples)
    ours = _fp16_overflow_skips("accum", examples)
    assert ours <= plain


# ------------------------------------------------------------ the non-finite guard
# Without a scaler, a run stops after `max_consecutive_skips` skipped updates in a row.


class _AlwaysNaN(TinyLM):
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        out["loss"] = out["loss"] * float("nan")
        return out


def test_nan_in_every_group_stops_after_max_consecutive_skips() -> None:
    strategy = AccumulationStrategy(max_consecutive_skips=3)
    with (
        pytest.warns(UserWarning, match=r"skipped update \d"),
        pytest.raises(RuntimeError, match=r"3 consecutive updates were skipped \(the last for 'nonfinite'"),
    ):
        fit(_AlwaysNaN(), make_examples([4] * 20), batch_size=2, accumulate=2, strategy=strategy)
    ledger = strategy.ledger
    assert (ledger.updates_attempted, ledger.updates_applied, ledger.updates_skipped["nonfinite"]) == (3, 0, 3)
    with pytest.raises(ValueError, match=r"`max_consecutive_skips` must be a positive int or None, got 0"):
        AccumulationStrategy(max_consecutive_skips=0)


def test_an_applied_update_resets_the_consecutive_count() -> None:
    class _NaNEveryOther(TinyLM):
        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
            out = super().training_step(batch, batch_idx)
            if (batch_idx // 2) % 2 == 0:
                out["loss"] = out["loss"] * float("nan")
            return out

    strategy = AccumulationStrategy(max_consecutive_skips=2)
    with pytest.warns(UserWarning, match=r"skipped update"):
        fit(_NaNEveryOther(), make_examples([4] * 16), batch_size=2, accumulate=2, strategy=strategy)
    assert (strategy.ledger.updates_applied, strategy.ledger.updates_skipped["nonfinite"]) == (2, 2)
