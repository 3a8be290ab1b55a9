"""Real 2-process DDP over gloo on CPU: exact updates with unequal token counts, identical ledgers, and the
proof that DDP averages (does not sum) gradients over replicas."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from helpers import (
    RecordOnRanks,
    TinyLM,
    fit,
    load_ranks,
    make_examples,
    params_vector,
    relative_error,
    run_ddp,
    sgd_reference,
)

from lightning_accum import AccumulationLedger, DDPAccumulationStrategy


def _same_ledger(a: dict[str, object], b: dict[str, object]) -> bool:
    """Equality of two ledger states, an empty group's NaN loss included."""
    left, right = AccumulationLedger(), AccumulationLedger()
    left.load_state_dict(a)
    right.load_state_dict(b)
    return left == right


pytestmark = [pytest.mark.ddp, pytest.mark.timeout(600)]

# Even positions go to rank 0, odd ones to rank 1 (DistributedSampler without shuffling): rank 0 holds the
# long sequences, rank 1 the short ones, so the replicas see very different token counts.
UNEQUAL = [6, 1, 5, 2, 6, 1, 4, 1, 6, 2, 5, 1, 6, 1, 3, 2]


def _ddp_kwargs(folder: Path, name: str) -> dict[str, object]:
    return {"devices": 2, "callbacks": [RecordOnRanks(str(folder), name)]}


def test_accum_ddp_spawn_matches_single_process_reference(tmp_path: Path) -> None:
    examples = make_examples(UNEQUAL, seed=21)
    model = TinyLM(lr=0.5, seed=21)
    # m = 2, A = 2, D = 2: each update sees 8 consecutive examples (4 per rank).
    expected = sgd_reference(model, [examples[:8], examples[8:]], lr=0.5)
    trainer = fit(
        model, examples, batch_size=2, accumulate=2, strategy="accum_ddp_spawn", **_ddp_kwargs(tmp_path, "accum")
    )
    ranks = load_ranks(str(tmp_path), "accum")

    for rank in ranks:
        assert relative_error(rank["params"], expected) < 1e-5
    assert _same_ledger(ranks[0]["ledger"], ranks[1]["ledger"])
    ledger = ranks[0]["ledger"]
    assert ledger["tokens"] == sum(UNEQUAL) and ledger["samples"] == 16 and ledger["microbatches"] == 8
    assert ledger["updates_attempted"] == ledger["updates_applied"] == 2
    tokens_last = sum(UNEQUAL[8:])
    assert ledger["last_group"]["tokens"] == tokens_last
    # The spawn launcher brings rank zero's ledger back to the main process.
    assert isinstance(trainer.strategy, DDPAccumulationStrategy)
    assert trainer.strategy.ledger.state_dict() == ledger

    # Plain Lightning DDP on the same data: each rank's mean over its own tokens, averaged over ranks and
    # micro-batches, is not the token-weighted objective when ranks see different token counts.
    plain = TinyLM(lr=0.5, seed=21)
    fit(plain, examples, batch_size=2, accumulate=2, strategy="ddp_spawn", **_ddp_kwargs(tmp_path, "plain"))
    plain_params = load_ranks(str(tmp_path), "plain")[0]["params"]
    assert relative_error(plain_params, expected) > 1e-3


def _local_mean_grad(model: TinyLM, examples: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    ref = copy.deepcopy(model).double()
    batch = {k: torch.stack([e[k] for e in examples]) for k in ("input_ids", "labels")}
    ref.mean_loss(batch).backward()
    return torch.cat([p.grad.reshape(-1) for p in ref.parameters()])


def test_plain_ddp_averages_gradients_over_replicas(tmp_path: Path) -> None:
    # The second seed document quotes answers claiming DDP *sums* gradients. One SGD(lr=1) update with one
    # micro-batch per rank tells: the parameter change is -(g0 + g1) / 2, not -(g0 + g1).
    examples = make_examples([3, 5, 2, 6], seed=4)
    model = TinyLM(lr=1.0, seed=4)
    g0 = _local_mean_grad(model, [examples[0], examples[2]])  # rank 0 gets indices 0 and 2
    g1 = _local_mean_grad(model, [examples[1], examples[3]])
    before = params_vector(model)
    fit(model, examples, batch_size=2, accumulate=1, strategy="ddp_spawn", **_ddp_kwargs(tmp_path, "plain"))
    change = before - load_ranks(str(tmp_path), "plain")[0]["params"]
    err_mean = relative_error(change, (g0 + g1) / 2)
    err_sum = relative_error(change, g0 + g1)
    ratio = float(change.norm() / (g0 + g1).norm())
    assert err_mean < 1e-5 and err_sum > 0.4, (
        f"DDP update vs mean of replica gradients: rel. error {err_mean:.2e}; vs their sum: {err_sum:.2e};"
        f" |update| / |g0 + g1| = {ratio:.4f} (0.5 means averaged, 1.0 summed)"
    )


def _zero_token_runs(rank: int, folder: str) -> None:
    # Micro-batches of 2 with A = 2 (D = 2): group 1 = examples 0..7; rank 1's first micro-batch (examples 1, 3)
    # has no supervised token. Group 2 = examples 8..15 has no supervised token on any replica.
    lengths = [4, 0, 2, 0, 5, 3, 1, 6] + [0] * 8
    examples = make_examples(lengths, seed=31)
    model = TinyLM(lr=0.5, seed=31)
    expected = sgd_reference(model, [examples[:8]], lr=0.5)
    fit(model, examples, batch_size=2, accumulate=2, strategy="accum_ddp", devices=2)
    torch.save(
        {"params": params_vector(model), "expected": expected, "ledger": model.trainer.strategy.ledger.state_dict()},
        f"{folder}/zero-rank{rank}.pt",
    )
    # Drop policy under DDP: 3 micro-batches per rank with A = 2 -> one full group, one dropped partial group.
    drop_examples = make_examples([2, 3, 4, 5, 6, 1, 2, 2, 3, 3, 6, 6], seed=32)
    drop_model = TinyLM(lr=0.5, seed=32)
    expected_drop = sgd_reference(drop_model, [drop_examples[:8]], lr=0.5)
    fit(
        drop_model,
        drop_examples,
        batch_size=2,
        accumulate=2,
        strategy=DDPAccumulationStrategy(partial_group="drop"),
        devices=2,
    )
    torch.save(
        {
            "params": params_vector(drop_model),
            "expected": expected_drop,
            "ledger": drop_model.trainer.strategy.ledger.state_dict(),
        },
        f"{folder}/drop-rank{rank}.pt",
    )


def test_zero_token_microbatch_group_and_drop_under_ddp(tmp_path: Path) -> None:
    run_ddp(_zero_token_runs, str(tmp_path))
    zero = load_ranks(str(tmp_path), "zero")
    for rank in zero:
        assert torch.isfinite(rank["params"]).all()
        assert relative_error(rank["params"], rank["expected"]) < 1e-5
    assert _same_ledger(zero[0]["ledger"], zero[1]["ledger"])
    ledger = zero[0]["ledger"]
    assert (ledger["updates_attempted"], ledger["updates_applied"], ledger["updates_skipped"]["empty"]) == (2, 1, 1)
    assert ledger["tokens"] == 21 and ledger["samples"] == 16

    drop = load_ranks(str(tmp_path), "drop")
    for rank in drop:
        assert relative_error(rank["params"], rank["expected"]) < 1e-5
    assert _same_ledger(drop[0]["ledger"], drop[1]["ledger"])
    ledger = drop[0]["ledger"]
    assert (ledger["updates_applied"], ledger["partial_groups"], ledger["dropped_microbatches"]) == (1, 1, 2)
    assert (ledger["dropped_samples"], ledger["dropped_tokens"]) == (4, 3 + 3 + 6 + 6)


SEED_TABLE_D2 = [(2, 8), (1, 16), (4, 4)]  # (m, A) with D = 2: 32 examples per update


def _seed_table_runs(rank: int, folder: str) -> None:
    examples = make_examples([1, 6, 2, 6, 3, 5, 1, 4, 6, 2, 2, 6, 5, 1, 3, 6] * 2, seed=41)
    for m, a in SEED_TABLE_D2:
        model = TinyLM(lr=1.0, seed=41)
        fit(model, examples, batch_size=m, accumulate=a, strategy="accum_ddp", devices=2)
        torch.save({"params": params_vector(model)}, f"{folder}/m{m}a{a}-rank{rank}.pt")


def test_seed_table_splits_give_the_same_update_under_real_ddp(tmp_path: Path) -> None:
    # The seed table: (2, 8, 2), (1, 16, 2) and (4, 4, 2) see 32 examples per update and must all give the
    # float64 update over those 32; (2, 8, 1) sees 16, so its reference is the update over the first 16.
    examples = make_examples([1, 6, 2, 6, 3, 5, 1, 4, 6, 2, 2, 6, 5, 1, 3, 6] * 2, seed=41)
    reference_model = TinyLM(lr=1.0, seed=41)
    expected = sgd_reference(reference_model, [examples])
    run_ddp(_seed_table_runs, str(tmp_path))
    results = {(m, a): load_ranks(str(tmp_path), f"m{m}a{a}") for m, a in SEED_TABLE_D2}
    for (m, a), ranks in results.items():
        for rank in ranks:
            assert relative_error(rank["params"], expected) < 1e-5, (m, a, 2)
    one_device = TinyLM(lr=1.0, seed=41)
    fit(one_device, examples, batch_size=2, accumulate=8, max_steps=1)
    assert relative_error(params_vector(one_device), sgd_reference(reference_model, [examples[:16]])) < 1e-5
