"""Real `Trainer.fit` runs on one device: exact updates, partial groups, empty groups, errors, no host syncs."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from helpers import (
    IGNORE,
    ListDataset,
    TinyLM,
    fit,
    make_examples,
    make_trainer,
    params_vector,
    random_lengths,
    relative_error,
    sgd_reference,
)
from host_reads import HostReadProbe, MicroBatchSyncCounter
from torch.utils.data import DataLoader, IterableDataset

import lightning_accum
from lightning_accum import AccumulationReport, AccumulationStrategy
from strategies.test_automatic import _Recorder


@pytest.mark.parametrize("accumulate", [1, 3, 4])
def test_one_update_equals_float64_token_weighted_gradient(accumulate: int) -> None:
    examples = make_examples(random_lengths(2 * accumulate, seed=accumulate), seed=accumulate)
    model = TinyLM()
    expected = sgd_reference(model, [examples])  # SGD(lr=1): change = -gradient

    trainer = fit(model, examples, batch_size=2, accumulate=accumulate)
    assert relative_error(params_vector(model), expected) < 1e-5
    assert trainer.strategy.ledger.updates_applied == 1

    plain = TinyLM()
    fit(plain, examples, batch_size=2, accumulate=accumulate, strategy="auto")
    plain_error = relative_error(params_vector(plain), expected)
    if accumulate == 1:
        assert plain_error < 1e-5  # one micro-batch: its mean is the token-weighted mean
    else:
        # Lightning divides each micro-batch mean by A: the mean of means, a different objective.
        assert plain_error > 1e-3, f"plain Lightning unexpectedly exact: relative error {plain_error:.2e}"


def test_several_updates_match_reference_and_ledger_counts() -> None:
    lengths = random_lengths(24, seed=7)
    examples = make_examples(lengths, seed=7)
    model = TinyLM(lr=0.5)
    groups = [examples[i : i + 6] for i in range(0, 24, 6)]
    expected = sgd_reference(model, groups, lr=0.5)
    trainer = fit(model, examples, batch_size=2, accumulate=3)
    assert relative_error(params_vector(model), expected) < 1e-5
    ledger = trainer.strategy.ledger
    assert ledger.updates_attempted == ledger.updates_applied == 4
    assert ledger.microbatches == 12 and ledger.samples == 24 and ledger.tokens == sum(lengths)
    assert ledger.normalization == "tokens" and ledger.partial_groups == 0
    group = groups[-1]
    assert ledger.last_group is not None and ledger.last_group.tokens == sum(
        int((e["labels"] != IGNORE).sum()) for e in group
    )
    assert ledger.last_group.applied and ledger.last_group.samples == 6


@pytest.mark.parametrize(("m", "accumulate"), [(2, 3), (1, 4)])
def test_precision_64_true_is_float64_exact_with_the_default_dtype_at_float32(m: int, accumulate: int) -> None:
    # A float32-built module that the precision plugin converts; the close's factor in the gradients' float64.
    assert torch.get_default_dtype() == torch.float32
    examples = make_examples(random_lengths(24, seed=5), seed=5)
    model = TinyLM(lr=0.5, seed=5)
    groups = [examples[i : i + m * accumulate] for i in range(0, 24, m * accumulate)]
    expected = sgd_reference(model, groups, lr=0.5)
    fit(model, examples, batch_size=m, accumulate=accumulate, precision="64-true")
    assert relative_error(params_vector(model), expected) < 1e-12


def test_partial_final_group_rescale_uses_its_real_denominator() -> None:
    # 7 micro-batches with A = 3: updates of 3, 3 and 1 micro-batches.
    examples = make_examples(random_lengths(14, seed=11), seed=11)
    model = TinyLM(lr=0.5)
    groups = [examples[0:6], examples[6:12], examples[12:14]]
    expected = sgd_reference(model, groups, lr=0.5)
    trainer = fit(model, examples, batch_size=2, accumulate=3, strategy=AccumulationStrategy(partial_group="rescale"))
    assert relative_error(params_vector(model), expected) < 1e-5
    ledger = trainer.strategy.ledger
    assert (ledger.updates_applied, ledger.partial_groups, ledger.microbatches, ledger.dropped_microbatches) == (
        3,
        1,
        7,
        0,
    )
    assert ledger.last_group is not None and ledger.last_group.microbatches == 1

    lightning = TinyLM(lr=0.5)
    fit(lightning, examples, batch_size=2, accumulate=3, strategy="auto")
    assert relative_error(params_vector(lightning), expected) > 1e-3  # under-weights the partial group (k/A)


def test_partial_final_group_drop_records_and_leaves_state_untouched() -> None:
    lengths = random_lengths(14, seed=12)
    examples = make_examples(lengths, seed=12)
    model = TinyLM(lr=0.5, optimizer="adamw")
    reference = TinyLM(lr=0.5, optimizer="adamw")
    ref_trainer = fit(reference, examples[:12], batch_size=2, accumulate=3)  # the same run without the last batch
    trainer = fit(model, examples, batch_size=2, accumulate=3, strategy=AccumulationStrategy(partial_group="drop"))
    assert torch.equal(params_vector(model), params_vector(reference))
    state, ref_state = trainer.optimizers[0].state_dict(), ref_trainer.optimizers[0].state_dict()
    for key in state["state"]:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state["state"][key][name], ref_state["state"][key][name])
    ledger = trainer.strategy.ledger
    assert (ledger.updates_attempted, ledger.updates_applied, ledger.partial_groups) == (2, 2, 1)
    assert (ledger.dropped_microbatches, ledger.dropped_samples, ledger.dropped_tokens) == (1, 2, sum(lengths[12:]))
    assert ledger.tokens == sum(lengths[:12]) and ledger.samples == 12


def test_epoch_shorter_than_a_group_warns_once_and_drop_raises() -> None:
    # One warning for one short epoch: the package's, which says what the strategy does of it (Lightning 2.6 has none;
    # its PR #21811 adds one, shown beside it: docs/internals.md, "Lightning versions"). `estimated_stepping_batches`
    # read in `configure_optimizers` sets up the training data before the fit loop does.
    class ReadsSteppingBatches(TinyLM):
        def configure_optimizers(self) -> Any:
            assert self.trainer.estimated_stepping_batches == 1
            return super().configure_optimizers()

    examples = make_examples([3, 4, 5, 6], seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(ReadsSteppingBatches(), examples, batch_size=2, accumulate=4)
    said = [str(w.message) for w in caught if str(w.message).startswith("An epoch has")]
    assert len(said) == 1 and said[0].startswith("An epoch has 2 training batches but `accumulate_grad_batches=4`")
    assert trainer.strategy.ledger.updates_applied == 1 and trainer.strategy.ledger.partial_groups == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match=r"with `partial_group='drop'` no update would ever happen.*at most 2"):
            fit(TinyLM(), examples, batch_size=2, accumulate=4, strategy=AccumulationStrategy(partial_group="drop"))
    assert not [w for w in caught if str(w.message).startswith("An epoch has")]  # the error alone


def test_zero_token_microbatch_and_zero_token_group() -> None:
    # Group 1: a micro-batch with no supervised token next to a normal one. Group 2: no token at all.
    lengths = [0, 0, 3, 5, 0, 0, 0, 0]
    examples = make_examples(lengths, seed=2)
    model = TinyLM(lr=0.5)
    expected = sgd_reference(model, [examples[:4]], lr=0.5)
    with pytest.warns(UserWarning, match=r"update 2 is skipped: its group holds no tokens at all"):
        trainer = fit(model, examples, batch_size=2, accumulate=2)
    params = params_vector(model)
    assert torch.isfinite(params).all()
    assert relative_error(params, expected) < 1e-5  # the empty group left the parameters unchanged
    ledger = trainer.strategy.ledger
    assert (ledger.updates_attempted, ledger.updates_applied, ledger.updates_skipped["empty"]) == (2, 1, 1)
    assert ledger.tokens == 8 and ledger.last_group is not None and ledger.last_group.skip_reason == "empty"


class _OptimizerSteps:
    """Counts every optimizer step taken while it is open (torch's global step hook)."""

    def __enter__(self) -> _OptimizerSteps:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.count = 0
        self._handle = register_optimizer_step_post_hook(lambda *_: setattr(self, "count", self.count + 1))
        return self

    def __exit__(self, *_: object) -> None:
        self._handle.remove()


def test_a_fit_whose_every_micro_batch_reports_zero_tokens_is_an_error(tmp_path: Path) -> None:
    examples = make_examples([0] * 8, seed=2)  # every label is the ignore index
    model = TinyLM(lr=0.5)
    before = params_vector(model)
    report = AccumulationReport(path=tmp_path)
    with (
        _OptimizerSteps() as steps,
        pytest.warns(UserWarning, match=r"update 1 is skipped: its group holds no tokens"),
        pytest.raises(
            RuntimeError,
            match=r"^The fit attempted 2 update\(s\) and applied none: every micro-batch reported zero tokens on every"
            r" replica.*`training_step` should return `num_tokens`, the tokens its mean loss averages over.*"
            r"supervised_tokens\(labels, shift=\.\.\.\)",
        ),
    ):
        fit(model, examples, batch_size=2, accumulate=2, callbacks=[report])
    assert steps.count == 0 and torch.equal(params_vector(model), before)
    assert report.record is not None and report.record["status"] == "failed"  # the run record says why
    assert "applied none" in report.record["error"]


class _NaNLoss(TinyLM):
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        return {**out, "loss": out["loss"] * float("nan")}


def test_a_fit_whose_every_update_is_skipped_is_an_error_with_the_counts() -> None:
    examples = make_examples([3, 4, 5, 6, 2, 1, 4, 4], seed=2)
    with (
        _OptimizerSteps() as steps,
        pytest.warns(UserWarning, match=r"skipped update \d: its gradient is not finite"),
        pytest.raises(RuntimeError, match=r"attempted 2 update\(s\) and applied none: every update was skipped"
                      r" \(nonfinite 2\): 'overflow' by the GradScaler"),
    ):  # fmt: skip
        fit(_NaNLoss(), examples, batch_size=2, accumulate=2)
    assert steps.count == 0


def test_a_fit_stopped_before_its_first_update_is_not_an_error() -> None:
    # No attempt at all (stopped inside the first group): nothing to say beyond the open group's warning.
    class StopAtOnce(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *_: Any) -> None:
            trainer.should_stop = True

    with pytest.warns(UserWarning, match=r"the fit stopped"):
        trainer = fit(
            TinyLM(), make_examples([3, 4, 5, 6], seed=2), batch_size=1, accumulate=4, callbacks=[StopAtOnce()]
        )
    assert trainer.strategy.ledger.updates_attempted == 0


def test_a_fit_whose_every_training_step_returns_none_ends_as_in_lightning() -> None:
    # Returning None is Lightning's way to skip a batch; every batch skipped is no error there, nor here (no unit was
    # ever reported, so nothing miscounted): the parameters are unchanged and the fit ends (Lightning's own tests).
    class SkipAll(TinyLM):
        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
            return None

    model = SkipAll()
    before = params_vector(model)
    with _OptimizerSteps() as steps, pytest.warns(UserWarning, match=r"`training_step` returned `None`"):
        trainer = fit(model, make_examples([3, 4, 5, 6], seed=2), batch_size=1, accumulate=2)
    assert steps.count == 0 and torch.equal(params_vector(model), before)
    ledger = trainer.strategy.ledger
    assert (ledger.updates_attempted, ledger.updates_applied, ledger.normalization) == (2, 0, None)


class _Stream(IterableDataset):
    def __init__(self, examples: list[dict[str, torch.Tensor]], batch_size: int) -> None:
        self.examples, self.batch_size = examples, batch_size

    def __iter__(self) -> Any:
        for i in range(0, len(self.examples), self.batch_size):
            chunk = self.examples[i : i + self.batch_size]
            yield {k: torch.stack([e[k] for e in chunk]) for k in ("input_ids", "labels")}


def test_iterable_dataset_streams_with_exact_partial_group() -> None:
    examples = make_examples(random_lengths(10, seed=4), seed=4)
    model = TinyLM(lr=0.5)
    expected = sgd_reference(model, [examples[0:6], examples[6:10]], lr=0.5)
    trainer = make_trainer(accumulate_grad_batches=3)
    trainer.fit(model, DataLoader(_Stream(examples, 2), batch_size=None))
    assert relative_error(params_vector(model), expected) < 1e-5
    assert trainer.strategy.ledger.partial_groups == 1 and trainer.strategy.ledger.updates_applied == 2


def test_normalize_samples_and_batches() -> None:
    examples = make_examples(random_lengths(8, seed=9), seed=9)
    # Micro-batches of 3, 3 and 2 samples in one group: "samples" weights 3:3:2, "batches" 1:1:1.
    for normalize in ("samples", "batches"):
        model = TinyLM(lr=1.0, report="loss")
        before = copy.deepcopy(model)
        trainer = fit(model, examples, batch_size=3, accumulate=3, strategy=AccumulationStrategy(normalize=normalize))
        weights = [3.0, 3.0, 2.0] if normalize == "samples" else [1.0, 1.0, 1.0]
        ref = copy.deepcopy(before).double()
        total = sum(
            w * ref.mean_loss({k: torch.stack([e[k] for e in examples[i : i + 3]]) for k in ("input_ids", "labels")})
            for w, i in zip(weights, (0, 3, 6), strict=True)
        ) / sum(weights)
        total.backward()
        expected = params_vector(before) - torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
        assert relative_error(params_vector(model), expected) < 1e-5, normalize
        assert trainer.strategy.ledger.normalization == normalize and trainer.strategy.ledger.samples == 8


def test_training_step_must_report_tokens_when_normalizing_by_tokens() -> None:
    examples = make_examples([3, 4], seed=0)
    with pytest.raises(ValueError, match=r"reports no token count"):
        fit(
            TinyLM(report="loss"),
            examples,
            batch_size=1,
            accumulate=2,
            strategy=AccumulationStrategy(normalize="tokens"),
        )


def test_checkpoint_round_trip_with_weights_only(tmp_path: Any) -> None:
    examples = make_examples(random_lengths(12, seed=6), seed=6)
    model = TinyLM(lr=0.5)
    trainer = fit(model, examples, batch_size=2, accumulate=4)
    path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["lightning_accum"]["ledger"]["tokens"] == trainer.strategy.ledger.tokens

    resumed = make_trainer(accumulate_grad_batches=4)
    # Loading a finished run's checkpoint restores the ledger before fit returns (max_epochs is reached).
    resumed.fit(TinyLM(lr=0.5), DataLoader(ListDataset(examples), batch_size=2), ckpt_path=path)
    assert resumed.strategy.ledger == trainer.strategy.ledger
    assert resumed.strategy.engine.reference_weight == trainer.strategy.engine.reference_weight


# ---------------------------------------------------------------------------- host syncs


def test_non_final_microbatches_make_no_host_sync_in_lightning_accum() -> None:
    counter = MicroBatchSyncCounter()
    examples = make_examples(random_lengths(16, seed=8), seed=8)
    trainer = fit(TinyLM(), examples, batch_size=2, accumulate=4, callbacks=[counter])
    assert counter.non_final_batches == 6  # 8 micro-batches in 2 groups of 4: 3 non-final each
    assert counter.non_final.package_ops >= 6 * 2  # the engine's per-micro-batch work (detach, w / c) was seen
    assert counter.non_final.hits == []
    # The group close reads the reduced counters once per update (and nothing else, without a scaler).
    assert len(counter.final.hits) == 2 and all("tolist" in hit for hit in counter.final.hits)
    assert trainer.strategy.ledger.updates_applied == 2


def test_host_sync_detector_catches_a_sync_in_the_package() -> None:
    # A function that the detector attributes to the package (its globals name it lightning_accum.*).
    namespace: dict[str, Any] = {"__name__": "lightning_accum._probe"}
    exec("def read(t):\n    return t.sum().item(), t.tolist()\n", namespace)
    with HostReadProbe() as detector:
        namespace["read"](torch.ones(3))
    assert len(detector.hits) == 2, detector.hits


# ---------------------------------------------------------------------- Lightning's own checks and hook order


class _Returns(TinyLM):
    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output = output

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        loss = self.mean_loss(batch)
        return self.output(loss) if callable(self.output) else self.output


@pytest.mark.parametrize(
    "output",
    [
        1.0,  # not a tensor, a mapping or None
        "loss",
        lambda loss: [loss],
        lambda loss: (loss, 3),
        lambda loss: {"num_tokens": 3},  # a mapping without "loss"
        lambda loss: {"loss": None, "num_tokens": 3},
    ],
    ids=["float", "str", "list", "tuple", "dict-without-loss", "dict-with-none-loss"],
)
def test_an_invalid_training_step_output_gets_lightnings_error(output: Any) -> None:
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    examples = make_examples([3, 4])
    messages = []
    for strategy in ("auto", "accum"):
        with pytest.raises(MisconfigurationException) as raised:
            fit(_Returns(output), examples, batch_size=1, accumulate=2, strategy=strategy)
        messages.append(str(raised.value))
    assert messages[0] == messages[1]


def test_hook_order_under_a_schedule_is_lightnings_group_by_group() -> None:
    # Groups of 1, 1, 3 and 3 micro-batches (a schedule on samples, m = 1; the groups of 3 start at batches 2 and 5):
    # each group's hooks in the order Lightning's own loop gives a group of its size.
    def lightnings(size: int) -> list[str]:
        model = _Recorder()
        fit(model, make_examples([3] * size), batch_size=1, accumulate=size, strategy="auto")
        return model.events

    model = _Recorder()
    schedule = lightning_accum.BatchSchedule({0: 1, 2: 3}, axis="samples")
    fit(model, make_examples([3, 4, 5, 2, 6, 1, 3, 4]), 1, 1, strategy=AccumulationStrategy(batch_schedule=schedule))
    assert model.events == 2 * lightnings(1) + 2 * lightnings(3)


def test_at_one_micro_batch_per_update_the_parameters_are_lightnings_bit_for_bit() -> None:
    # A = 1: the group's token-weighted mean is its one micro-batch's mean, so the strategy back-propagates the loss
    # as it is (c = w) and multiplies the gradient by nothing (w / w = 1); it only checks it for NaN/Inf. Over
    # AdamW updates of micro-batches of varied token counts, the parameters are plain Lightning's exactly, and the
    # ledger counts every token. (With c = A·max(w, M) and the factor c / w, a lighter micro-batch than the
    # heaviest so far rounds twice, and the parameters drift from Lightning's in the last bits.)
    lengths = random_lengths(16, seed=5)
    examples = make_examples(lengths, seed=5)
    ours, plain = TinyLM(lr=0.05, optimizer="adamw", seed=3), TinyLM(lr=0.05, optimizer="adamw", seed=3)
    trainer = fit(ours, examples, batch_size=2, accumulate=1)
    fit(plain, examples, batch_size=2, accumulate=1, strategy="auto")
    assert torch.equal(params_vector(ours), params_vector(plain))
    ledger = trainer.strategy.ledger
    assert (ledger.updates_applied, ledger.tokens) == (8, sum(int((e["labels"] != IGNORE).sum()) for e in examples))
