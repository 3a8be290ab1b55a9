"""AxisLR: the rate of every update is base × lr_lambda(count the applied updates before it consumed)."""

from __future__ import annotations

import io
import math
import pickle
from typing import Any

import pytest
import torch
from helpers import make_examples, random_lengths
from horizon_helpers import HorizonLM, Trace, loaders, trainer_for

from lightning_accum import AxisLR, warmup_cosine, warmup_linear
from lightning_accum.axis_lr import WarmupCosine

LENGTHS = random_lengths(48, seed=11)
EXAMPLES = make_examples(LENGTHS, seed=11)
BASE_LR = 0.4
SCHEDULE = warmup_linear(warmup=80, total=340, min_ratio=0.05)


def test_the_helpers_follow_their_formulas_and_travel_to_other_processes() -> None:
    cosine = warmup_cosine(warmup=100, total=1100, min_ratio=0.2)
    linear = warmup_linear(warmup=100, total=1100, min_ratio=0.2)
    for n in (0, 1, 37, 99, 100, 101, 350, 600, 1099, 1100, 10**12):
        ramp = min(n, 100) / 100
        p = min(1.0, max(0, n - 100) / 1000)
        if n < 100:
            assert cosine(n) == pytest.approx(ramp) and linear(n) == pytest.approx(ramp)
        else:
            assert cosine(n) == pytest.approx(0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * p)))
            assert linear(n) == pytest.approx(0.2 + 0.8 * (1 - p))
    assert warmup_cosine(0, 10)(0) == 1.0  # no warm-up
    assert pickle.loads(pickle.dumps(cosine)) == cosine and isinstance(cosine, WarmupCosine)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((-1, 10), r"`warmup` must be an int >= 0 .* got -1"),
        ((0, 0), r"`total` must be a positive int >= `warmup` \(0\), .* got 0"),
        ((20, 10), r"`total` must be a positive int >= `warmup` \(20\), .* got 10"),
        ((1, 10, 1.5), r"`min_ratio` must be in \[0, 1\] .* got 1.5"),
    ],
)
def test_helper_arguments_are_checked(args: tuple[Any, ...], match: str) -> None:
    for helper in (warmup_cosine, warmup_linear):
        with pytest.raises(ValueError, match=match):
            helper(*args)


def run(m: int, accumulate: int, max_epochs: int = 2, **model_kwargs: Any) -> tuple[Any, Trace]:
    trace = Trace()
    trainer = trainer_for(accumulate, [trace], max_epochs=max_epochs)
    options = {"lr_lambda": SCHEDULE, "lr": BASE_LR, "seed": 2, **model_kwargs}
    trainer.fit(HorizonLM(**options), *loaders(EXAMPLES, m))
    return trainer, trace


def test_effective_batches_of_8_and_16_examples_lie_on_the_same_curve_of_rate_against_tokens() -> None:
    curves, by_index = {}, {}
    for m, accumulate in ((4, 2), (4, 4)):
        trainer, trace = run(m, accumulate)
        per_update = m * accumulate
        tokens = [sum(LENGTHS[i : i + per_update]) for i in range(0, len(LENGTHS), per_update)] * 2
        before = [sum(tokens[:i]) for i in range(len(tokens))]
        assert [u["tokens_before"] for u in trace.updates] == before
        rates = [u["lr"] for u in trace.updates]
        torch.testing.assert_close(rates, [BASE_LR * SCHEDULE(n) for n in before], rtol=1e-12, atol=0.0)
        curves[per_update] = dict(zip(before, rates, strict=True))
        by_index[per_update] = rates
        scheduler = trainer.lr_scheduler_configs[0].scheduler
        assert scheduler.consumed == trainer.strategy.ledger.tokens == sum(LENGTHS) * 2
    # Update i of the two runs comes at different token counts, so a schedule on update indices would differ;
    # on tokens, the points of both runs are samples of one curve (shared counts: the epoch starts, the same rate).
    assert len(curves[8]) == 2 * len(curves[16])
    shared = curves[8].keys() & curves[16].keys()
    assert len(shared) >= 3 and all(curves[8][n] == curves[16][n] for n in shared)
    assert by_index[8][1] < by_index[16][1]  # in the warm-up, update 1 of the larger batch comes later on the curve


class PoisonOnce(HorizonLM):
    """The loss of micro-batch `bad` of the first epoch is NaN: that update is skipped (on_nonfinite='skip')."""

    def __init__(self, bad: int = 3, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.bad = bad

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        if self.current_epoch == 0 and batch_idx == self.bad:
            out["loss"] = out["loss"] * float("nan")
        return out


def test_a_skipped_update_does_not_advance_the_schedule() -> None:
    trace = Trace()
    trainer = trainer_for(2, [trace], max_epochs=1)
    with pytest.warns(UserWarning, match=r"skipped update 2"):
        trainer.fit(PoisonOnce(lr_lambda=SCHEDULE, lr=BASE_LR, seed=2), *loaders(EXAMPLES, 4))
    applied = [u["applied"] for u in trace.updates]
    assert applied.count(False) == 1 and not applied[1]
    # The count before each update: what the *applied* updates before it consumed.
    consumed, expected = 0, []
    for update in trace.updates:
        expected.append(BASE_LR * SCHEDULE(consumed))
        consumed += update["tokens"] if update["applied"] else 0
    torch.testing.assert_close([u["lr"] for u in trace.updates], expected, rtol=1e-12, atol=0.0)
    assert trace.updates[2]["lr"] == trace.updates[1]["lr"]  # the skipped update moved nothing
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.consumed == consumed == trainer.strategy.ledger.tokens - trace.updates[1]["tokens"]


@pytest.mark.parametrize("axis", ["samples", "updates"])
def test_samples_and_updates_axes(axis: str) -> None:
    schedule = warmup_cosine(warmup=2, total=6) if axis == "updates" else warmup_cosine(warmup=16, total=48)
    _, trace = run(4, 2, max_epochs=1, axis=axis, lr_lambda=schedule, report="samples")
    per_update = 8 if axis == "samples" else 1
    expected = [BASE_LR * schedule(i * per_update) for i in range(len(trace.updates))]
    torch.testing.assert_close([u["lr"] for u in trace.updates], expected, rtol=1e-12, atol=0.0)


def test_state_is_plain_and_restores_the_count() -> None:
    trainer, _ = run(4, 2, max_epochs=1)
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    buffer = io.BytesIO()
    torch.save(scheduler.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert state["consumed"] == trainer.strategy.ledger.tokens and state["axis"] == "tokens"

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=BASE_LR)
    restored = AxisLR(optimizer, axis="tokens", lr_lambda=SCHEDULE)
    restored.load_state_dict(state)
    assert restored.state_dict() == scheduler.state_dict()
    other = AxisLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), axis="samples", lr_lambda=SCHEDULE)
    with pytest.raises(ValueError, match=r"runs on axis='samples', but the checkpoint's was saved on axis='tokens'"):
        other.load_state_dict(state)


def test_errors() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(
        ValueError,
        match=r"`axis` must be one of 'tokens', 'samples', 'updates',"
        r" 'documents'; got 'steps'",
    ):
        AxisLR(optimizer, axis="steps", lr_lambda=SCHEDULE)
    with pytest.raises(TypeError, match=r"`lr_lambda` must be callable .* got float"):
        AxisLR(optimizer, lr_lambda=0.5)  # type: ignore[arg-type]

    # Under a plain Lightning strategy nothing counts the tokens: the first step says so.
    trainer = trainer_for(2, [], strategy="auto", max_epochs=1)
    with pytest.raises(RuntimeError, match=r"AxisLR needs an accumulation strategy .* stepped without one"):
        trainer.fit(HorizonLM(lr_lambda=SCHEDULE), *loaders(EXAMPLES, 4))

    trainer = trainer_for(2, [], max_epochs=1)
    with pytest.raises(RuntimeError, match=r"AxisLR\(axis='tokens'\) needs token counts, but the run reports none"):
        trainer.fit(HorizonLM(lr_lambda=SCHEDULE, report="samples"), *loaders(EXAMPLES, 4))
