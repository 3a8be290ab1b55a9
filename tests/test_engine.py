"""The arithmetic, without a Trainer: seed example, float64 references, split invariance, bad input."""

from __future__ import annotations

import copy
import math
import threading

import pytest
import torch
from helpers import IGNORE, SEQ, TinyLM, make_examples, relative_error, token_weighted_grad
from host_reads import HostReadProbe
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_accum.engine import AccumulationEngine, Replicas
from lightning_accum.gradients import scale_gradients
from lightning_accum.microbatch import infer_num_samples


def test_seed_example_gives_token_weighted_loss_not_mean_of_means() -> None:
    # Seed document: 512 supervised tokens with mean loss 2 and 1,536 with mean loss 4.
    engine = AccumulationEngine(normalize="tokens")
    for tokens, loss in [(512, 2.0), (1536, 4.0)]:
        engine.add_microbatch({"loss": torch.tensor(loss), "num_tokens": torch.tensor(tokens)}, None, accumulate=2)
    outcome = engine.close_group(accumulate=2)
    engine.finish_group(outcome, applied=True)
    assert outcome.record.loss == pytest.approx(3.5, abs=1e-12)
    assert (2.0 + 4.0) / 2 == 3.0 != outcome.record.loss
    assert engine.ledger.tokens == 2048
    assert engine.ledger.last_group is not None and engine.ledger.last_group.loss == pytest.approx(3.5)


class _ThreadAllReduce:
    """An in-process sum all-reduce between `n` threads: a stand-in for the collective, not for DDP's math."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.barrier = threading.Barrier(n)
        self.slots: list[torch.Tensor | None] = [None] * n
        self.local = threading.local()

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        rank = self.local.rank
        self.slots[rank] = tensor.clone()
        self.barrier.wait()
        total = torch.stack([s for s in self.slots if s is not None]).sum(0)
        self.barrier.wait()
        tensor.copy_(total)
        return tensor


def simulate_update(
    model: torch.nn.Module, examples: list[dict[str, torch.Tensor]], m: int, accumulate: int, replicas: int
) -> torch.Tensor:
    """The engine's update direction (the rescaled gradient) for one group of m x A x D examples.

    Replica r gets examples r, r + D, r + 2D, ... (DistributedSampler's layout); its micro-batch i is the
    i-th slice of m of those. Replicas run in threads; their gradients are averaged over replicas as DDP
    does, then rescaled by the factor the engine returns.
    """
    reduce = _ThreadAllReduce(replicas)
    replica_models = [copy.deepcopy(model) for _ in range(replicas)]
    engines = [AccumulationEngine(normalize="tokens") for _ in range(replicas)]
    for engine in engines:
        engine.bind(replicas=Replicas(replicas, reduce))
    factors: list[float] = [0.0] * replicas
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            reduce.local.rank = rank
            mine = examples[rank::replicas]
            net = replica_models[rank]
            for i in range(accumulate):
                chunk = mine[i * m : (i + 1) * m]
                batch = {k: torch.stack([e[k] for e in chunk]) for k in ("input_ids", "labels")}
                out = {"loss": net.mean_loss(batch), "num_tokens": (batch["labels"] != IGNORE).sum()}
                tensor = engines[rank].add_microbatch(out, batch, accumulate)
                assert tensor is not None
                tensor.backward()
            outcome = engines[rank].close_group(accumulate)
            factors[rank] = outcome.factor
        except BaseException as err:  # surfaced below
            errors.append(err)
            reduce.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(replicas)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    assert len(set(factors)) == 1, f"replicas computed different factors: {factors}"
    grads = []
    for params in zip(*(net.parameters() for net in replica_models), strict=True):
        averaged = torch.stack([p.grad.to(torch.float64) for p in params]).mean(0)  # DDP averages
        grads.append(averaged.reshape(-1) * factors[0])
    return torch.cat(grads)


SEED_TABLE = [(2, 8, 2), (1, 16, 2), (4, 4, 2), (2, 8, 1)]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(min_value=0, max_value=SEQ), min_size=32, max_size=32).filter(lambda x: sum(x) > 0),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_split_invariance_over_the_seed_table(lengths: list[int], seed: int) -> None:
    model = TinyLM(seed=seed)
    examples = make_examples(lengths, seed=seed)
    reference = token_weighted_grad(model, examples)
    for m, a, d in SEED_TABLE:
        # (2, 8, 1) sees 16 examples per update: compare it with the reference over its own 16.
        group = examples if m * a * d == 32 else examples[:16]
        expected = reference if group is examples else token_weighted_grad(model, group)
        update = simulate_update(model, group, m, a, d)
        assert relative_error(update, expected) < 1e-5, (m, a, d)


def test_same_examples_different_split_same_update() -> None:
    model = TinyLM(seed=3)
    examples = make_examples([1, 6, 2, 5, 3, 3, 6, 1, 4, 2, 2, 5, 6, 6, 1, 1], seed=3)
    updates = [simulate_update(model, examples, m, a, d) for m, a, d in [(2, 4, 2), (1, 8, 2), (4, 2, 2), (8, 2, 1)]]
    for other in updates[1:]:
        assert relative_error(other, updates[0]) < 1e-6


def test_first_group_scale_is_shared_between_replicas_with_unequal_tokens() -> None:
    # Replica 0 sees only long sequences, replica 1 only short ones: a c taken from each replica's own first
    # micro-batch would weight them wrongly. The shared c keeps the update exact.
    model = TinyLM(seed=5)
    examples = make_examples([6, 1] * 8, seed=5)
    update = simulate_update(model, examples, 2, 4, 2)
    assert relative_error(update, token_weighted_grad(model, examples)) < 1e-6


def test_backward_magnitude_stays_near_lightnings_loss_over_a() -> None:
    engine = AccumulationEngine(normalize="tokens")
    tensors = []
    for _ in range(2):  # two groups of four micro-batches of 100 tokens each
        for _ in range(4):
            out = {"loss": torch.tensor(2.0), "num_tokens": torch.tensor(100)}
            tensor = engine.add_microbatch(out, None, accumulate=4)
            assert tensor is not None
            tensors.append(float(tensor))
        engine.finish_group(engine.close_group(accumulate=4), applied=True)
    assert tensors == pytest.approx([2.0 / 4] * 8)


def test_zero_token_microbatch_contributes_nothing_and_no_nan() -> None:
    engine = AccumulationEngine(normalize="tokens")
    nan_loss = torch.tensor(float("nan"), requires_grad=True)
    first = engine.add_microbatch({"loss": nan_loss, "num_tokens": torch.tensor(0)}, None, accumulate=2)
    engine.add_microbatch({"loss": torch.tensor(3.0), "num_tokens": torch.tensor(10)}, None, accumulate=2)
    assert first is not None
    first.backward()
    assert nan_loss.grad is not None and float(nan_loss.grad) == 0.0
    outcome = engine.close_group(accumulate=2)
    assert outcome.action == "apply" and outcome.record.loss == pytest.approx(3.0)


def _closed_with_gradients(
    grads: list[torch.Tensor], check: bool, tokens: tuple[int, int] = (30, 10)
) -> tuple[AccumulationEngine, object]:
    """A second group of two micro-batches closed with `grads` handed to the engine; c = A · max(M, w_first) with
    M = 20 (the first group's mean micro-batch weight) and w_first = tokens[0]."""
    engine = AccumulationEngine(normalize="tokens")
    for _ in range(2):  # first group: two micro-batches of 20 tokens, M = 20
        engine.add_microbatch({"loss": torch.tensor(1.0), "num_tokens": 20}, None, accumulate=2)
    engine.finish_group(engine.close_group(accumulate=2), applied=True)
    for n in tokens:
        engine.add_microbatch({"loss": torch.tensor(1.0), "num_tokens": n}, None, accumulate=2)
    return engine, engine.close_group(accumulate=2, gradients=grads, check_gradients=check)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_close_rescales_given_gradients_on_the_device_like_the_host_factor(dtype: torch.dtype) -> None:
    # c · D / W with c = 2 · max(20, 30) = 60 and W = 30 + 15 = 45: the factor 60/45 rounds.
    grads = [torch.randn(7, dtype=dtype), torch.randn(3, 2, dtype=dtype)]
    expected = [g.clone() for g in grads]
    for check in (True, False):
        moved = [g.clone() for g in grads]
        _, outcome = _closed_with_gradients(moved, check, tokens=(30, 15))
        assert outcome.action == "apply" and outcome.scaled and outcome.factor == pytest.approx(60 / 45, rel=1e-15)
        # One rounding: float32 arithmetic with the float32 factor (float64 for float64 gradients).
        math_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        factor = torch.tensor(outcome.factor, dtype=torch.float64).to(math_dtype)
        for got, before in zip(moved, expected, strict=True):
            assert torch.equal(got, (before.to(math_dtype) * factor).to(dtype)), (dtype, check)
        params = [torch.nn.Parameter(torch.zeros_like(g)) for g in expected]  # the public helper rounds alike
        for p, g in zip(params, expected, strict=True):
            p.grad = g.clone()
        scale_gradients(params, outcome.factor)
        for p, got in zip(params, moved, strict=True):
            assert torch.equal(p.grad, got), (dtype, check)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
def test_close_finds_a_nonfinite_gradient_in_the_rescale_pass(dtype: torch.dtype, poison: float) -> None:
    grads = [torch.ones(4, dtype=dtype), torch.ones(5, dtype=dtype)]
    grads[1][3] = poison
    with pytest.warns(UserWarning, match="skipped update 2: its gradient is not finite"):
        engine, outcome = _closed_with_gradients(grads, check=True)
    assert outcome.action == "skip" and outcome.record.skip_reason == "nonfinite"
    engine.finish_group(outcome, applied=False)
    assert engine.ledger.updates_skipped["nonfinite"] == 1
    # Unchecked (on_nonfinite="ignore", or a GradScaler checks): applied, as Lightning would.
    _, unchecked = _closed_with_gradients([torch.ones(4, dtype=dtype), grads[1].clone()], check=False)
    assert unchecked.action == "apply"


def test_auto_unit_falls_back_to_samples_then_batches() -> None:
    engine = AccumulationEngine()
    engine.add_microbatch(torch.tensor(1.0), {"x": torch.zeros(5, 2)}, accumulate=1)
    assert engine.unit == "samples"
    engine = AccumulationEngine()
    engine.add_microbatch(torch.tensor(1.0), "not a tensor", accumulate=1)
    assert engine.unit == "batches"
    engine = AccumulationEngine(count_tokens=lambda b: (b["labels"] != IGNORE).sum())
    engine.add_microbatch(torch.tensor(1.0), {"labels": torch.tensor([[1, IGNORE]])}, accumulate=1)
    assert engine.unit == "tokens"
    engine.finish_group(engine.close_group(accumulate=1), applied=True)
    assert engine.ledger.tokens == 1


def test_token_counts_beyond_int32_are_exact() -> None:
    engine = AccumulationEngine(normalize="tokens")
    big = 3 * 10**12 + 7
    engine.add_microbatch({"loss": torch.tensor(1.0), "num_tokens": torch.tensor(big)}, None, accumulate=1)
    engine.finish_group(engine.close_group(accumulate=1), applied=True)
    engine.add_microbatch({"loss": torch.tensor(1.0), "num_tokens": big}, None, accumulate=1)
    engine.finish_group(engine.close_group(accumulate=1), applied=True)
    assert engine.ledger.tokens == 2 * big


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (3.5, TypeError, r"`num_tokens` must be an int or a 0-d integer tensor, got float"),
        (True, TypeError, r"`num_tokens` must be an integer count, got a boolean"),
        (-4, ValueError, r"`num_tokens` must be >= 0, got -4"),
        (torch.tensor(2.0), TypeError, r"got a tensor of dtype torch.float32"),
        (torch.tensor(float("nan")), TypeError, r"got a tensor of dtype torch.float32"),
        (torch.tensor([1, 2]), ValueError, r"got a tensor of shape \(2,\)"),
    ],
)
def test_bad_token_counts_are_clear_errors(value: object, error: type[Exception], match: str) -> None:
    engine = AccumulationEngine()
    with pytest.raises(error, match=match):
        engine.add_microbatch({"loss": torch.tensor(1.0), "num_tokens": value}, None, accumulate=1)


def test_negative_token_tensor_is_caught_at_the_close() -> None:
    engine = AccumulationEngine()
    engine.add_microbatch({"loss": torch.tensor(1.0), "num_tokens": torch.tensor(-3)}, None, accumulate=1)
    with pytest.raises(ValueError, match=r"A negative `num_tokens`, `num_samples` or `num_documents` was reported"):
        engine.close_group(accumulate=1)


def test_tokens_normalization_without_tokens_says_how_to_report_them() -> None:
    engine = AccumulationEngine(normalize="tokens")
    with pytest.raises(ValueError, match=r"reports no token count\. Return .*'num_tokens'.*count_tokens="):
        engine.add_microbatch(torch.tensor(1.0), None, accumulate=1)


def test_samples_normalization_without_inferable_size() -> None:
    engine = AccumulationEngine(normalize="samples")
    with pytest.raises(ValueError, match=r"cannot be inferred .* Return `\{'loss': loss, 'num_samples': n\}`"):
        engine.add_microbatch(torch.tensor(1.0), {"a": torch.zeros(2), "b": torch.zeros(3)}, accumulate=1)


def test_infer_num_samples() -> None:
    assert infer_num_samples([torch.zeros(3, 2), (torch.zeros(3),)]) == 3
    assert infer_num_samples({"scalar": torch.tensor(1.0)}) is None


def test_state_round_trip_restores_scale_reference() -> None:
    engine = AccumulationEngine(normalize="tokens")
    engine.add_microbatch({"loss": torch.tensor(1.0), "num_tokens": 40}, None, accumulate=2)
    engine.add_microbatch({"loss": torch.tensor(1.0), "num_tokens": 60}, None, accumulate=2)
    engine.finish_group(engine.close_group(accumulate=2), applied=True)
    restored = AccumulationEngine(normalize="tokens")
    restored.load_state_dict(engine.state_dict())
    assert restored.reference_weight == engine.reference_weight == 50.0  # M: the mean micro-batch weight of the group
    assert restored.ledger == engine.ledger


def test_a_group_is_inconsistent_between_a_training_step_and_the_end_of_its_backward() -> None:
    engine = AccumulationEngine()
    engine.add_microbatch(torch.tensor(1.0), None, accumulate=2)
    assert not engine.group_consistent  # recorded, not yet back-propagated
    engine.take_backward_tensor()
    assert not engine.group_consistent  # backward running
    engine.backward_finished()
    assert engine.group_consistent


def _backward_magnitudes(engine: AccumulationEngine, groups: list[list[int]], accumulate: int) -> list[float]:
    """For each micro-batch (unit loss), what the engine back-propagates relative to Lightning's loss / A."""
    ratios = []
    for group in groups:
        for n in group:
            out = engine.add_microbatch({"loss": torch.tensor(1.0), "num_tokens": torch.tensor(n)}, None, accumulate)
            assert out is not None
            ratios.append(float(out) * accumulate)
        engine.finish_group(engine.close_group(accumulate), applied=True)
    return ratios


def test_backward_magnitude_does_not_depend_on_the_previous_group() -> None:
    # Groups alternate between 1 supervised token and 2 × 64: before, c was the previous group's count, so the full
    # group after a 1-token group back-propagated 64 times Lightning's loss / A.
    groups = [[1, 0], [64, 64]] * 4
    ratios = _backward_magnitudes(AccumulationEngine(normalize="tokens"), groups, accumulate=2)
    assert max(ratios) <= 1.0 + 1e-12
    # On several replicas M comes only from closed groups (the same on every replica): a heavy group after a light
    # history is bounded by the run's first micro-batch weights, then by the heaviest group mean seen.
    engine = AccumulationEngine(normalize="tokens")
    engine.bind(replicas=Replicas(2, lambda t: t.mul_(2)))  # two identical replicas
    ratios = _backward_magnitudes(engine, [[64, 64], [1, 0], [64, 64], [1, 0], [64, 64]], accumulate=2)
    assert max(ratios) <= 1.0 + 1e-12


@pytest.mark.parametrize(
    "counts",
    [
        [torch.tensor(37)],  # A = 1, a token count on the device
        [torch.tensor(37), torch.tensor(0), torch.tensor(2**40 + 3)],  # an empty micro-batch; a count beyond 2^32
        [5],  # host counts
        [7, 5, 9, 3],
        [torch.tensor(c) for c in (7, 5, 9, 3)],
        [5, torch.tensor(0), 9],  # mixed, with an empty micro-batch
        [torch.tensor(6, dtype=torch.int32), torch.tensor(2**40 + 3)],  # an int32 count beside an int64 one
        [49, torch.tensor(49)],
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_group_closes_to_the_float64_reference_in_one_host_read(
    counts: list[int | torch.Tensor], dtype: torch.dtype
) -> None:
    # The group's gradient, record and counts against a float64 reference computed by hand, for counts on the host,
    # on the device, mixed, empty and large; the close reads the host once (the vector and the check's flag together).
    engine = AccumulationEngine(normalize="tokens")
    weight = torch.ones(3, dtype=dtype, requires_grad=True)
    x = torch.tensor([1.0, 2.0, 3.0], dtype=dtype)
    total = sum(int(c) for c in counts)
    for update in range(3):  # the first group's c is a device scalar, later ones follow M
        reference = torch.zeros(3, dtype=torch.float64)
        weighted = 0.0
        for index, count in enumerate(counts):
            scale = index + 1 + update
            tensor = engine.add_microbatch({"loss": (weight * x).sum() * scale, "num_tokens": count}, None, len(counts))
            assert tensor is not None and tensor.dtype == dtype
            tensor.backward()
            reference += x.double() * scale * int(count)
            weighted += int(count) * float((weight * x).sum().detach().double()) * scale
        assert weight.grad is not None
        with HostReadProbe() as close:
            outcome = engine.close_group(accumulate=len(counts), gradients=[weight.grad], check_gradients=True)
        engine.finish_group(outcome, applied=True)
        assert len(close.hits) == 1 and "tolist" in close.hits[0], close.hits
        assert outcome.action == "apply" and outcome.record.tokens == total
        assert outcome.record.microbatches == len(counts)
        assert outcome.record.loss == pytest.approx(weighted / total, rel=1e-12)
        tolerance = 1e-6 if dtype == torch.float32 else 1e-13
        assert relative_error(weight.grad.double(), reference / total) < tolerance
        weight.grad = None


def test_groups_of_varying_sizes_close_exactly() -> None:
    # Sliced batches give groups of varying numbers of micro-batches: each closes with its exact counts and loss.
    engine = AccumulationEngine(normalize="tokens")
    for size in range(1, 71):
        for index in range(size):
            engine.add_microbatch({"loss": torch.tensor(1.0), "num_tokens": torch.tensor(index + 1)}, None, size)
        outcome = engine.close_group(accumulate=size)
        engine.finish_group(outcome, applied=True)
        assert outcome.record.tokens == size * (size + 1) // 2 and outcome.record.loss == 1.0


@pytest.mark.parametrize("count", [torch.tensor(5), torch.tensor(5, dtype=torch.int32), 5])
@pytest.mark.parametrize("first_group", [True, False])
def test_the_backward_tensor_keeps_a_float64_loss_precision(count: int | torch.Tensor, first_group: bool) -> None:
    # loss · w / c of a float64 loss, and the factor back-propagated to the loss, are exact to float64 rounding
    # whatever form w and c take. Under several replicas after their first group (c a float, w an integer tensor),
    # the fused addcmul(0, loss, w, value=1/c) back-propagated w · (1/c) formed in float32 (an integer tensor times
    # a Python float): 0.7142857313 where 5/7 = 0.7142857143.
    engine = AccumulationEngine(normalize="tokens")
    engine.bind(replicas=Replicas(2, lambda t: t))  # several replicas: c = A · M as a float after the first group
    if not first_group:
        engine.reference_weight = 3.5  # c = 2 · 3.5 = 7
    loss = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
    tensor = engine.add_microbatch({"loss": loss, "num_tokens": count}, None, accumulate=2)
    assert tensor is not None and tensor.dtype == torch.float64
    c = 7.0 if not first_group else 2 * 5.0 / 2  # the first group: A · the replicas' mean first weight (5 + 5) / 2
    assert abs(tensor.item() - 5 / c) <= 1e-15 * (5 / c)
    tensor.backward()
    assert loss.grad is not None and abs(loss.grad.item() - 5 / c) <= 1e-15 * (5 / c), loss.grad.item()


def _sole_and_general(
    reports: list[tuple[float, object, str]], dtype: torch.dtype, normalize: str
) -> list[tuple[object, list[torch.Tensor]]]:
    """Each report (loss scale, count, key) as a one-micro-batch group, closed by an engine told the micro-batch is
    its group's only one (`sole=True`) and by one that is not: (action, factor, record, M) and the gradients."""
    runs = []
    for sole in (True, False):
        engine = AccumulationEngine(normalize=normalize)
        torch.manual_seed(1)
        weight = torch.randn(6, dtype=dtype, requires_grad=True)
        x = torch.randn(6, dtype=dtype)
        results = []
        for scale, count, key in reports:
            loss = (weight * x).sum() * scale  # NaN for an empty micro-batch's mean, as cross-entropy gives
            output = {"loss": loss} if key == "" else {"loss": loss, key: count}
            tensor = engine.add_microbatch(output, torch.zeros(3, 2), accumulate=1, sole=sole)
            assert tensor is not None
            tensor.backward()
            assert weight.grad is not None
            outcome = engine.close_group(accumulate=1, gradients=[weight.grad], check_gradients=True)
            engine.finish_group(outcome, applied=outcome.action == "apply")
            # The factor c·D/W differs by construction (c = w here, A·max(w, M) there): each close applies its own.
            factor = outcome.factor
            assert factor == 1.0 if sole else True
            results.append(((outcome.action, outcome.record, engine.reference_weight), weight.grad.clone()))
            weight.grad = None
        runs.append(results)
    return list(zip(*runs, strict=True))


@pytest.mark.filterwarnings("ignore:lightning_accum. (update .* is skipped|skipped update)")  # empty, non-finite
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(
    ("normalize", "reports"),
    [
        # Token counts on the device; an empty micro-batch (NaN mean); a count beyond float32's integers.
        (
            "tokens",
            [
                (1.0, torch.tensor(37), "num_tokens"),
                (float("nan"), torch.tensor(0), "num_tokens"),
                (0.5, torch.tensor(2**40 + 3), "num_tokens"),
                (2.0, torch.tensor(3), "num_tokens"),
            ],
        ),
        ("tokens", [(1.0, 37, "num_tokens"), (2.0, 5, "num_tokens"), (float("nan"), 0, "num_tokens")]),
        ("samples", [(1.0, torch.tensor(4), "num_samples"), (3.0, 2, "num_samples")]),
        ("samples", [(1.0, None, ""), (2.0, None, "")]),  # samples inferred from the batch (3)
        ("batches", [(1.0, None, ""), (float("inf"), None, "")]),  # a non-finite gradient: skipped
    ],
)
def test_a_sole_micro_batch_closes_as_the_general_group_does(
    normalize: str, reports: list[tuple[float, object, str]], dtype: torch.dtype
) -> None:
    # A = 1 in automatic optimization: c = w, the loss is back-propagated as it is and the close multiplies
    # nothing. Records and M are those of the general close bit for bit; the gradient is the loss's own
    # (what plain Lightning back-propagates at A = 1), equal to the general close's within its rounding.
    actions = []
    for (sole, sole_grad), (general, general_grad) in _sole_and_general(reports, dtype, normalize):
        assert sole == general
        actions.append(sole[0])
        if sole[0] == "apply":
            tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-6
            assert relative_error(sole_grad.double(), general_grad.double()) < tolerance
    assert actions.count("skip") == sum(not math.isfinite(scale) for scale, _, _ in reports)


def test_a_sole_micro_batch_back_propagates_its_loss_and_reads_once() -> None:
    engine = AccumulationEngine(normalize="tokens")
    weight = torch.ones(3, requires_grad=True)
    for check in (True, False):  # with the NaN/Inf check, and without (a GradScaler checks, or on_nonfinite="ignore")
        loss = (weight * torch.tensor([1.0, 2.0, 3.0])).sum()
        with HostReadProbe() as per_microbatch:
            tensor = engine.add_microbatch({"loss": loss, "num_tokens": torch.tensor(7)}, None, 1, sole=True)
        assert tensor is loss  # back-propagated as it is, as Lightning does at A = 1
        assert not per_microbatch.hits
        tensor.backward()
        assert weight.grad is not None
        expected = weight.grad.clone()
        with HostReadProbe() as close:
            outcome = engine.close_group(accumulate=1, gradients=[weight.grad], check_gradients=check)
        assert torch.equal(weight.grad, expected)  # the factor c · D / W = w / w is exactly 1: bit for bit
        assert len(close.hits) == 1 and "tolist" in close.hits[0]
        assert (outcome.action, outcome.factor, outcome.record.tokens, outcome.record.loss) == ("apply", 1.0, 7, 6.0)
        engine.finish_group(outcome, applied=True)
        weight.grad = None
    # A negative count on the device is the same error as in any close.
    engine.add_microbatch({"loss": torch.tensor(1.0), "num_tokens": torch.tensor(-2)}, None, accumulate=1, sole=True)
    with pytest.raises(ValueError, match="negative"):
        engine.close_group(accumulate=1)


def test_a_sole_micro_batch_stays_alone_and_closes_exactly_with_another_accumulate() -> None:
    engine = AccumulationEngine(normalize="tokens")
    weight = torch.ones(2, requires_grad=True)
    x = torch.tensor([1.0, 3.0])
    # A further micro-batch cannot join a group whose first one was back-propagated with c = w.
    engine.add_microbatch({"loss": (weight * x).sum(), "num_tokens": 4}, None, accumulate=1, sole=True)
    with pytest.raises(RuntimeError, match=r"sole=True.*Close the group first"):
        engine.add_microbatch({"loss": (weight * x).sum(), "num_tokens": 4}, None, accumulate=1)
    # Retracted (its backward never completed), the group is empty again and takes any micro-batch; c is formed anew.
    engine.retract_microbatch()
    engine.reference_weight = 10.0  # M from earlier groups
    tensor = engine.add_microbatch({"loss": (weight * x).sum(), "num_tokens": 2}, None, accumulate=1)
    assert tensor is not None
    assert torch.allclose(tensor, (weight * x).sum() * 2 / 10)  # c = A · max(w, M), not the retracted w
    tensor.backward()
    assert weight.grad is not None
    outcome = engine.close_group(accumulate=1, gradients=[weight.grad])
    assert outcome.action == "apply" and torch.allclose(weight.grad, x)
    # Closed with another A (a partial group of 1 of 4), a sole group takes the general close with c = w: exact.
    weight.grad = None
    tensor = engine.add_microbatch({"loss": (weight * x).sum(), "num_tokens": 3}, None, accumulate=1, sole=True)
    assert tensor is not None
    tensor.backward()
    outcome = engine.close_group(accumulate=4, gradients=[weight.grad])
    assert outcome.action == "apply" and engine.ledger.partial_groups == 1
    assert torch.allclose(weight.grad, x) and outcome.record.tokens == 3


# ---------------------------------------------------------------------------- the one-replica close

# Groups of three micro-batches as (loss scale, count, key) reports: token counts on the device (an empty micro-batch
# with its NaN mean, a count beyond float32's integers), as ints, mixed; samples; batches; a non-finite gradient.
_GROUPS = [
    ("tokens", [(1.0, torch.tensor(37), "num_tokens"), (float("nan"), torch.tensor(0), "num_tokens"),
                (0.5, torch.tensor(2**40 + 3), "num_tokens")]),
    ("tokens", [(1.0, 37, "num_tokens"), (2.0, 5, "num_tokens"), (float("nan"), 0, "num_tokens")]),
    ("tokens", [(1.0, 4, "num_tokens"), (2.0, torch.tensor(9), "num_tokens"), (3.0, 2, "num_tokens")]),
    ("samples", [(1.0, torch.tensor(4), "num_samples"), (3.0, 2, "num_samples"), (2.0, None, "")]),
    ("batches", [(1.0, None, ""), (2.0, None, ""), (0.5, None, "")]),
    ("batches", [(1.0, None, ""), (float("inf"), None, ""), (0.5, None, "")]),
]  # fmt: skip


def _closed_groups(normalize: str, reports: list[tuple[float, object, str]], dtype: torch.dtype, vector: bool) -> list:
    """Two groups of ``reports`` closed on one replica, by the one-replica close or (``vector``) by the general close
    (a mesh check that sums nothing routes it there): (action, factor, record, M, gradient) per group."""
    engine = AccumulationEngine(normalize=normalize)
    if vector:
        engine.bind(replicas=Replicas(1, check_sum=lambda t: t))
    torch.manual_seed(3)
    weight = torch.randn(5, dtype=dtype, requires_grad=True)
    x = torch.randn(5, dtype=dtype)
    closed = []
    for _ in range(2):  # the first group's c is a device scalar where counts are, the second's follows M too
        for scale, count, key in reports:
            output = {"loss": (weight * x).sum() * scale, **({key: count} if key else {})}
            tensor = engine.add_microbatch(output, torch.zeros(3, 2), accumulate=len(reports))
            assert tensor is not None
            tensor.backward()
        assert weight.grad is not None
        outcome = engine.close_group(accumulate=len(reports), gradients=[weight.grad], check_gradients=True)
        engine.finish_group(outcome, applied=outcome.action == "apply")
        closed.append((outcome.action, outcome.factor, outcome.record, engine.reference_weight, weight.grad.clone()))
        weight.grad = None
    return closed


@pytest.mark.filterwarnings("ignore:lightning_accum. (update .* is skipped|skipped update)")  # empty, non-finite
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("normalize", "reports"), _GROUPS)
def test_the_one_replica_close_gives_the_general_closes_group_bit_for_bit(
    normalize: str, reports: list[tuple[float, object, str]], dtype: torch.dtype
) -> None:
    # One replica reads the reported values as they are and forms the group's sums on the host; the general close forms
    # the vector on the device. Same decision, record (counts exact beyond 2^24, the NaN mean left out), factor, M and
    # rescaled gradient.
    for local, general in zip(
        _closed_groups(normalize, reports, dtype, vector=False),
        _closed_groups(normalize, reports, dtype, vector=True),
        strict=True,
    ):
        *values, gradient = local
        *expected, expected_gradient = general
        assert values == expected
        assert torch.equal(gradient, expected_gradient) or values[0] != "apply"


def test_a_one_replica_group_reads_the_host_once_at_its_close() -> None:
    # The behaviour that does not depend on how many operations a torch release dispatches for it: a group of 8
    # micro-batches with token counts on the device reads nothing on the host per micro-batch and once at the close
    # (one stack, read with `tolist`), and it has no collective to run on one replica.
    engine = AccumulationEngine(normalize="tokens")
    weight = torch.ones(4, requires_grad=True)
    for _ in range(2):
        for i in range(8):
            loss = (weight * (i + 1)).sum()
            with HostReadProbe() as probe:
                tensor = engine.add_microbatch({"loss": loss, "num_tokens": torch.tensor(i + 3)}, None, 8)
            assert tensor is not None and not probe.hits
            tensor.backward()
        assert weight.grad is not None
        with HostReadProbe() as close:
            outcome = engine.close_group(accumulate=8, gradients=[weight.grad], check_gradients=True)
        assert len(close.hits) == 1 and "tolist" in close.hits[0]
        assert outcome.action == "apply" and outcome.record.tokens == sum(range(3, 11))
        # Σ_i (i + 1) · w_i / W for every element, with w_i = i + 3 tokens: the token-weighted mean gradient.
        expected = sum((i + 1) * (i + 3) for i in range(8)) / sum(range(3, 11))
        assert torch.allclose(weight.grad, torch.full((4,), expected), rtol=1e-6, atol=0)
        engine.finish_group(outcome, applied=True)
        weight.grad = None


def test_a_sole_micro_batch_closes_with_one_host_read_and_its_gradient_unchanged() -> None:
    # A = 1 on one replica: the close checks the gradient (NaN/Inf) and reads the host once; nothing is rescaled.
    engine = AccumulationEngine(normalize="tokens")
    weight = torch.ones(4, requires_grad=True)
    for _ in range(3):
        engine.add_microbatch({"loss": weight.sum(), "num_tokens": torch.tensor(5)}, None, 1, sole=True).backward()
        assert weight.grad is not None
        with HostReadProbe() as close:
            outcome = engine.close_group(1, gradients=[weight.grad], check_gradients=True)
        assert len(close.hits) == 1
        assert outcome.action == "apply" and torch.equal(weight.grad, torch.ones(4))
        engine.finish_group(outcome, applied=True)
        weight.grad = None
