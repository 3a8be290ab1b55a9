"""TokenBatchSampler and its planner: each group holds the fixed-``m`` run's examples (GlobalOrderSampler's positions
[g·B, (g+1)·B), its tail), cut under the token budget, the same count on every replica; determinism; resumes at a
group boundary under another D and inside a group on the same D; lengths read once; its errors."""

from __future__ import annotations

import contextlib
import itertools
import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, IterableDataset

from lightning_accum import GlobalOrderSampler, TokenBatches, TokenBatchSampler
from lightning_accum.token_batches import COUNTS, _cost, even_cut, plan_group

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _samplers(lengths: list[int], replicas: int, **options: Any) -> list[TokenBatchSampler]:
    return [
        TokenBatchSampler(range(len(lengths)), lengths, num_replicas=replicas, rank=r, **options)
        for r in range(replicas)
    ]


def _groups(samplers: list[TokenBatchSampler], batches: list[list[list[int]]]) -> list[list[int]]:
    """Each group's examples, replica by replica, from every replica's micro-batches cut by its group sizes."""
    sizes = samplers[0].group_sizes()
    assert all(s.group_sizes() == sizes for s in samplers)  # every replica plans the same groups
    assert all(len(own) == sum(sizes) for own in batches)
    starts = np.cumsum([0, *sizes])
    return [[x for own in batches for batch in own[a:b] for x in batch] for a, b in itertools.pairwise(starts)]


def _fixed_m_groups(
    n: int, samples: int, replicas: int, seed: int, epoch: int, shuffle: bool, position: int = 0
) -> list[list[int]]:
    """Group g of a fixed-``m`` run with ``global_order=True``: ``B / D`` consecutive positions of every replica's
    share of GlobalOrderSampler's deal (from ``position``, where a resumed epoch continues)."""
    shares = []
    for rank in range(replicas):
        sampler = GlobalOrderSampler(range(n), replicas, rank, shuffle=shuffle, seed=seed)
        sampler.load_state_dict({"epoch": epoch, "position": position, "seed": seed, "shuffle": shuffle, "length": n})
        shares.append(list(sampler))
    per = samples // replicas
    return [sorted(x for share in shares for x in share[k : k + per]) for k in range(0, len(shares[0]), per)]


@st.composite
def _setups(draw: st.DrawFn, replicas_choices: tuple[int, ...] = (1, 2, 3, 4)) -> dict[str, Any]:
    replicas = draw(st.sampled_from(replicas_choices))
    n = draw(st.integers(replicas, 70))
    lengths = draw(st.lists(st.integers(1, 40), min_size=n, max_size=n))
    alone = draw(st.booleans())
    return {
        "lengths": lengths,
        "replicas": replicas,
        "max_tokens": draw(st.integers(1 if alone else max(lengths), 3 * max(lengths))),
        "samples_per_update": replicas * draw(st.integers(1, 6)),
        "count": draw(st.sampled_from(COUNTS)),
        "max_samples": draw(st.none() | st.integers(1, 5)),
        "long_rows": "alone" if alone else "error",
        "seed": draw(st.integers(0, 2**16)),
        "shuffle": draw(st.booleans()),
    }


def _made(setup: dict[str, Any], epoch: int = 0) -> tuple[list[TokenBatchSampler], list[list[list[int]]]]:
    options = {k: v for k, v in setup.items() if k not in ("lengths", "replicas")}
    samplers = _samplers(setup["lengths"], setup["replicas"], **options)
    for sampler in samplers:
        sampler.set_epoch(epoch)
    counts = [len(sampler) for sampler in samplers]  # before the epoch
    with _warned(setup):
        batches = [list(sampler) for sampler in samplers]
    assert counts == [len(own) for own in batches]
    return samplers, batches


def _warned(setup: dict[str, Any]) -> contextlib.AbstractContextManager[object]:
    """The warning of rows over the budget, expected where there are some (rank 0 gives it, once)."""
    over = max(setup["lengths"]) > setup["max_tokens"]
    return pytest.warns(UserWarning, match="over the budget") if over else contextlib.nullcontext()


@SETTINGS
@given(setup=_setups(), epoch=st.integers(0, 3))
def test_every_group_holds_the_fixed_m_groups_examples_once_within_the_budget_and_the_same_count_per_replica(
    setup: dict[str, Any], epoch: int
) -> None:
    samplers, batches = _made(setup, epoch)
    lengths, replicas, budget = np.array(setup["lengths"]), setup["replicas"], setup["max_tokens"]
    # Every replica runs the same number of micro-batches, which len() says before the epoch.
    assert {len(own) for own in batches} == {len(samplers[0])}
    groups = _groups(samplers, batches)
    fixed = _fixed_m_groups(len(lengths), setup["samples_per_update"], replicas, setup["seed"], epoch, setup["shuffle"])
    assert [sorted(group) for group in groups] == fixed  # the same examples in the same updates
    everything = [x for group in groups for x in group]
    assert len(everything) == len(set(everything)) == len(lengths) - len(lengths) % replicas  # the tail rule
    # Within the budget, a row over it alone (and counted), never empty, at most max_samples rows.
    over = 0
    for batch in (batch for own in batches for batch in own):
        cost = len(batch) * lengths[batch].max() if setup["count"] == "padded" else lengths[batch].sum()
        assert 1 <= len(batch) <= (setup["max_samples"] or len(batch))
        assert cost <= budget or (len(batch) == 1 and setup["long_rows"] == "alone"), (batch, cost)
        over += int(lengths[batch].max() > budget)
    stats = samplers[0].group_stats()
    assert sum(s["long_rows"] for s in stats) == over
    assert [s["samples"] for s in stats] == [len(group) for group in groups]
    assert [s["tokens"] for s in stats] == [int(lengths[group].sum()) for group in groups]
    # Deterministic: another instance (another process) plans the same.
    assert _made(setup, epoch)[1] == batches


@SETTINGS
@given(setup=_setups(replicas_choices=(1, 2, 4)), writer=st.sampled_from([1, 2, 4]), data=st.data())
def test_a_resume_at_a_group_boundary_under_another_d_continues_with_the_same_groups(
    setup: dict[str, Any], writer: int, data: st.DataObject
) -> None:
    reader = setup["replicas"]
    assume(len(setup["lengths"]) >= writer)
    setup["samples_per_update"] = math.lcm(writer, reader) * data.draw(st.integers(1, 3))
    written, written_batches = _made({**setup, "replicas": writer}, epoch=1)
    sizes = written[0].group_sizes()
    groups_done = data.draw(st.integers(0, len(sizes) - 1))
    state = written[0].state_dict(sum(sizes[:groups_done]))
    position = groups_done * setup["samples_per_update"]
    assert (state["epoch"], state["position"], state["done"], state["samples"]) == (1, position, 0, 0)
    assert state["microbatches"] == sum(sizes[:groups_done])
    samplers = _samplers(
        setup["lengths"], reader, **{k: v for k, v in setup.items() if k not in ("lengths", "replicas")}
    )
    for sampler in samplers:
        sampler.load_state_dict(state)
    lengths_before = [len(s) for s in samplers]
    with _warned(setup):
        batches = [list(sampler) for sampler in samplers]
    # len() counts the written run's micro-batches first: where Lightning's restored batch index continues.
    assert lengths_before == [state["microbatches"] + len(own) for own in batches]
    groups = [sorted(group) for group in _groups(samplers, batches)]
    n, seed, shuffle = len(setup["lengths"]), setup["seed"], setup["shuffle"]
    assert groups == _fixed_m_groups(n, setup["samples_per_update"], reader, seed, 1, shuffle, position)
    # The groups the written run had in full are the same examples.
    before = [sorted(g) for g in _groups(written, written_batches)[groups_done:]]
    full = [g for g in before if len(g) == setup["samples_per_update"]]
    assert groups[: len(full)] == full


@SETTINGS
@given(setup=_setups(), data=st.data())
def test_a_resume_inside_a_group_on_the_same_d_skips_what_was_done(setup: dict[str, Any], data: st.DataObject) -> None:
    samplers, batches = _made(setup)
    ran = data.draw(st.integers(0, len(batches[0])))
    state = samplers[0].state_dict(ran)
    resumed, _ = _made(setup)  # fresh instances, iterated once (their warning given)
    for sampler in resumed:
        sampler.load_state_dict(state)
    if state["epoch"] == 1:  # the epoch was done
        assert ran == len(batches[0]) and state["position"] == 0
        return
    assert [len(s) for s in resumed] == [len(own) for own in batches]  # the whole epoch's count, as before
    assert [list(s) for s in resumed] == [own[ran:] for own in batches]
    # A state written by the resumed iteration continues the same epoch again.
    more = data.draw(st.integers(0, len(batches[0]) - ran))
    again = resumed[0].state_dict(more)
    assert again == samplers[0].state_dict(ran + more)


def test_a_group_open_on_other_replicas_is_refused_and_a_state_outside_its_group_too() -> None:
    lengths = [3, 1, 4, 1, 5, 9, 2, 6]
    one = TokenBatchSampler(range(8), lengths, max_tokens=9, samples_per_update=4, shuffle=False)
    list(one)
    state = one.state_dict(1)
    assert state["done"] == 1 and state["samples"] == 4
    two = TokenBatchSampler(range(8), lengths, max_tokens=9, samples_per_update=4, num_replicas=2, shuffle=False)
    two.load_state_dict(state)
    with pytest.raises(
        ValueError, match=r"open after 1 micro-batches per replica on 1 replicas; this sampler deals to 2"
    ):
        list(two)
    again = TokenBatchSampler(range(8), lengths, max_tokens=9, samples_per_update=4, shuffle=False)
    again.load_state_dict({**state, "done": 7})
    with pytest.raises(ValueError, match=r"`done=7` is not inside its open group of 2 micro-batches"):
        len(again)


def test_a_schedules_function_is_asked_once_per_group_as_the_iteration_reaches_it() -> None:
    lengths = [int(x) for x in torch.randint(1, 30, (50,), generator=torch.Generator().manual_seed(0))]
    asked: list[tuple[int, int]] = []

    def samples(epoch: int, position: int) -> int:
        asked.append((epoch, position))
        return 4 if position < 12 else 8

    options = {"max_tokens": 60, "samples_per_update": samples, "num_replicas": 2, "seed": 5}
    lazy = TokenBatchSampler(range(50), lengths, plan_ahead=False, **options)
    lazy.set_epoch(2)
    with pytest.raises(TypeError, match=r"planned group by group \(`plan_ahead=False`\) is not known before the"):
        len(lazy)
    batches = iter(lazy)
    first = next(batches)
    assert asked == [(2, 0)] and len(lazy.group_sizes()) == 1
    rest = [first, *batches]
    assert asked == [(2, p) for p in (0, 4, 8, 12, 20, 28, 36, 44)]  # 50 // 2 * 2 = 50 positions, the last 6
    ahead = TokenBatchSampler(range(50), lengths, **options)
    ahead.set_epoch(2)
    assert list(ahead) == rest and ahead.group_sizes() == lazy.group_sizes()
    order = GlobalOrderSampler(range(50), seed=5).order(2)
    spans = [(0, 4), (4, 8), (8, 12), (12, 20), (20, 28), (28, 36), (36, 44), (44, 50)]
    assert [s["samples"] for s in ahead.group_stats()] == [b - a for a, b in spans]
    other = TokenBatchSampler(range(50), lengths, **{**options, "rank": 1})
    other.set_epoch(2)
    groups = _groups([ahead, other], [rest, list(other)])
    assert [sorted(group) for group in groups] == [sorted(order[a:b]) for a, b in spans]


def test_lengths_are_read_once_from_a_function_and_epochs_reshuffle_through_a_data_loader() -> None:
    calls: list[int] = []

    def length(index: int) -> int:
        calls.append(index)
        return 1 + index % 7

    data = [torch.full((length(i),), i) for i in range(30)]
    calls.clear()
    sampler = TokenBatchSampler(data, length, max_tokens=16, samples_per_update=10)
    loader = DataLoader(data, batch_sampler=sampler, collate_fn=lambda rows: [int(row[0]) for row in rows])
    epochs = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        epochs.append(list(loader))
        assert len(loader) == len(epochs[-1])
    assert calls == list(range(30))  # once per index, at construction
    assert all(sorted(x for batch in e for x in batch) == list(range(30)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]


def test_a_long_row_alone_is_warned_once_on_rank_zero_and_counted() -> None:
    lengths = [2, 30, 3, 4, 25, 1]
    rank_zero, rank_one = _samplers(lengths, 2, max_tokens=10, samples_per_update=6, long_rows="alone")
    assert rank_zero.long_row_count == 2
    with pytest.warns(UserWarning, match=r"2 rows of the data are longer than `max_tokens=10` \(the longest: 30\)"):
        list(rank_zero)
    list(rank_zero)  # once per run
    rank_one.set_epoch(1)
    list(rank_one)
    (stats,) = rank_zero.group_stats()
    assert stats["long_rows"] == 2 and max(stats["microbatch_padded_tokens"]) == 30


def test_group_stats_count_tokens_padding_loads_and_imbalance() -> None:
    # One group of 8 rows on 2 replicas; sorted: 9 8 7 6 5 4 3 2; budget 16 padded: [9] [8 7] [6 5] [4 3 2].
    samplers = _samplers([4, 9, 2, 7, 5, 3, 8, 6], 2, max_tokens=16, samples_per_update=8, shuffle=False)
    (stats,) = samplers[0].group_stats()
    assert stats["tokens"] == 44 and stats["padded_tokens"] == 9 + 16 + 12 + 12  # LPT: 16 + 9 and 12 + 12
    assert stats["samples"] == 8 and stats["microbatches"] == 2
    assert sorted(stats["replica_load"]) == [24, 25] and stats["imbalance"] == pytest.approx(25 / 24.5)
    assert sorted(stats["microbatch_samples"]) == [1, 2, 2, 3]
    assert sorted(sorted(b) for b in list(samplers[0]) + list(samplers[1])) == [[0, 2, 5], [1], [3, 6], [4, 7]]


def test_plan_group_halves_the_fullest_micro_batch_until_every_replica_has_the_same_count() -> None:
    # Sorted 10 9 2 1, budget 10: [10] [9] [2 1] is 3 pieces; on 4 replicas one more: the fullest splittable, [2 1].
    plan = plan_group([2, 10, 1, 9], replicas=4, max_tokens=10)
    assert sorted(p.tolist() for rank in plan for p in rank) == [[0], [1], [2], [3]]
    assert [len(rank) for rank in plan] == [1, 1, 1, 1]
    # Summed: 10 + 9 exceeds 10, so the same cut; max_samples caps rows.
    assert [len(b) for rank in plan_group([1] * 6, 2, 100, "sum", max_samples=2) for b in rank] == [2, 1, 2, 1]


@SETTINGS
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=40), budget=st.integers(1, 400), padded=st.booleans())
def test_even_cut_makes_the_fewest_pieces_under_the_budget_with_the_least_largest(
    lengths: list[int], budget: int, padded: bool
) -> None:
    rows = np.array(sorted(lengths, reverse=True))
    pieces = even_cut(rows, budget, padded)
    assert [a for a, _ in pieces] == [0, *[b for _, b in pieces[:-1]]] and pieces[-1][1] == len(rows)  # in order
    costs = [_cost(rows[a:b], padded) for a, b in pieces]
    assert all(c <= budget or b - a == 1 for c, (a, b) in zip(costs, pieces, strict=True))  # a longer row alone
    greedy = plan_group(rows, 1, budget, "padded" if padded else "sum")[0]  # the planner's greedy pieces
    assert len(pieces) == len(greedy) and max(costs) <= max(_cost(np.sort(rows[g])[::-1], padded) for g in greedy)


def test_rows_and_spans_name_each_micro_batch_and_group_of_the_epoch_a_state_continues() -> None:
    lengths = [5, 1, 3, 8, 2, 2, 7, 4, 6, 1, 2, 3]
    sampler = TokenBatchSampler(range(12), lengths, max_tokens=10, samples_per_update=5, shuffle=False)
    batches = list(sampler)
    assert [sampler.rows(k).tolist() for k in range(len(batches))] == batches
    assert sampler.rows(len(batches)).tolist() == sampler.rows(-1).tolist() == []  # outside the epoch
    assert sampler.group_spans() == [(0, 5, 5), (5, 5, 5), (10, 2, 5)]  # the epoch's last group, partial
    sizes = sampler.group_sizes()
    resumed = TokenBatchSampler(range(12), lengths, max_tokens=10, samples_per_update=5, shuffle=False)
    resumed.load_state_dict(sampler.state_dict(sizes[0] + 1))  # inside group 1
    assert [resumed.rows(k).tolist() for k in range(sizes[0] + 1, len(batches))] == batches[sizes[0] + 1 :]
    assert resumed.group_spans() == [(5, 5, 5), (10, 2, 5)]


def test_a_datasets_column_gives_the_lengths() -> None:
    datasets = pytest.importorskip("datasets")
    data = datasets.Dataset.from_dict({"input_ids": [[1] * n for n in (3, 1, 4, 1, 5, 9)]}).select([5, 4, 3, 2, 1, 0])
    sampler = TokenBatchSampler(data, "input_ids", max_tokens=9, samples_per_update=6)
    assert sampler.lengths.tolist() == [9, 5, 1, 4, 1, 3]


def test_a_column_of_examples_that_are_mappings_is_read_once_as_its_entries_lengths() -> None:
    reads: list[int] = []

    class Rows(list):  # type: ignore[type-arg]
        def __getitem__(self, index):  # type: ignore[no-untyped-def]
            reads.append(index)
            return super().__getitem__(index)

    data = Rows({"input_ids": [0] * n, "labels": [0] * n} for n in (3, 1, 4, 1, 5, 9))
    sampler = TokenBatchSampler(data, "input_ids", max_tokens=9, samples_per_update=6)
    assert sampler.lengths.tolist() == [3, 1, 4, 1, 5, 9] and reads == list(range(6))
    for epoch in (0, 1):  # the epochs plan from the lengths read once
        sampler.set_epoch(epoch)
        assert sorted(i for batch in sampler for i in batch) == list(range(6))
    assert reads == list(range(6))


class _Stream(IterableDataset):  # type: ignore[type-arg]
    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(3))

    def __len__(self) -> int:
        return 3


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        ({"dataset": _Stream()}, TypeError, r"`dataset` must be map-style .* got _Stream\. .* a `datasets\.Dataset`"),
        ({"dataset": iter(range(4))}, TypeError, r"`dataset` must be map-style \(positions and a length\), got"),
        ({"lengths": [1, 2, 3]}, ValueError, r"`lengths` has 3 entries but the dataset has 4 examples"),
        ({"lengths": [1, 2, 0, 3]}, ValueError, r"`lengths` must be positive, got 0 at index 2\. Drop empty rows"),
        ({"lengths": [1.0, 2.0, 3.0, 4.0]}, TypeError, r"`lengths` must give one int per example, got list of dtype"),
        (
            {"lengths": "input_ids"},
            TypeError,
            r"`lengths='input_ids'` names a column, but example 0 .* holds int\)\. Name",
        ),
        ({"max_tokens": 0}, ValueError, r"`max_tokens` must be an int >= 1, got 0\. Pass e\.g\. `max_tokens=1`"),
        ({"max_samples": 0}, ValueError, r"`max_samples` must be an int >= 1, got 0\. Pass e\.g\. `max_samples=1`"),
        ({"samples_per_update": True}, ValueError, r"`samples_per_update` must be an int >= 1, got True"),
        ({"samples_per_update": 3, "num_replicas": 2}, ValueError, r"multiple of `num_replicas=2`, got 3\. Pass"),
        ({"count": "tokens"}, ValueError, r"`count` must be one of 'padded', 'sum'; got 'tokens'"),
        ({"long_rows": "skip"}, ValueError, r"`long_rows` must be one of 'error', 'alone'; got 'skip'"),
        ({"max_tokens": 3}, ValueError, r"1 rows are longer than `max_tokens=3` \(the longest: 4 tokens, index 3\)"),
        ({"num_replicas": 5, "samples_per_update": 5}, ValueError, r"`num_replicas=5` exceeds the data's 4 examples"),
        ({"num_replicas": 2, "rank": 2}, ValueError, r"`rank` must be an int in \[0, 1\]"),
        ({"seed": "0"}, TypeError, r"`seed` must be an int, got '0'"),
    ],
)
def test_bad_arguments_are_refused_naming_the_fix(arguments: dict[str, Any], error: type, match: str) -> None:
    options: dict[str, Any] = {"dataset": range(4), "lengths": [1, 2, 3, 4], "max_tokens": 8, "samples_per_update": 2}
    with pytest.raises(error, match=match):
        TokenBatchSampler(**{**options, **arguments})


def test_a_schedules_bad_answer_and_an_unknown_length_are_refused() -> None:
    sampler = TokenBatchSampler(range(8), [1] * 8, max_tokens=8, samples_per_update=lambda e, p: 3, num_replicas=2)
    with pytest.raises(ValueError, match=r"multiple of `num_replicas=2`, got 3 \(returned for position 0 of epoch 0\)"):
        len(sampler)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            {"done": -1},
            r"The sampler state's 'done' must be an int >= 0, got -1 \(in \{.*\}\)\. Pass a state written by",
        ),
        ({"shuffle": 1}, r"The sampler state's 'shuffle' must be a bool, got 1"),
        ({"seed": 9}, r"continues an epoch of another order: written for length=8, shuffle=True, seed=9"),
        ({"position": 8}, r"position 8 is past the data's end \(8 examples\)"),
    ],
)
def test_a_bad_state_is_refused(change: dict[str, Any], match: str) -> None:
    sampler = TokenBatchSampler(range(8), [2] * 8, max_tokens=4, samples_per_update=4)
    state = {**sampler.state_dict(2), **change}
    with pytest.raises(ValueError, match=match):
        TokenBatchSampler(range(8), [2] * 8, max_tokens=4, samples_per_update=4).load_state_dict(state)


def test_lightnings_loop_sets_each_epochs_order_and_reads_every_micro_batch_of_it() -> None:
    import lightning as L
    from torch.nn.utils.rnn import pad_sequence

    lengths = [1 + i % 9 for i in range(40)]
    data = [torch.full((n,), float(i)) for i, n in enumerate(lengths)]
    options: dict[str, Any] = {"max_tokens": 20, "samples_per_update": 8, "seed": 3}
    seen: dict[int, list[list[int]]] = {0: [], 1: []}

    class Rows(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(()))

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            seen[self.current_epoch].append(batch[:, 0].long().tolist())  # every row's first value is its index
            return (self.weight * batch).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    loader = DataLoader(
        data,
        batch_sampler=TokenBatchSampler(data, lengths, **options),
        collate_fn=lambda rows: pad_sequence(rows, batch_first=True),
    )
    trainer = L.Trainer(
        max_epochs=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Rows(), loader)
    for epoch in (0, 1):  # Lightning set each epoch through the batch sampler's `sampler`
        planned = TokenBatchSampler(data, lengths, **options)
        planned.set_epoch(epoch)
        assert seen[epoch] == list(planned)
    assert seen[0] != seen[1]


def test_groups_cut_an_epoch_of_the_loader_where_the_plan_ends_each_group_a_resumed_one_short() -> None:
    lengths = [1 + (7 * i) % 9 for i in range(30)]
    sampler = TokenBatchSampler(range(30), lengths, max_tokens=12, samples_per_update=10, seed=4)
    loader = DataLoader(range(30), batch_sampler=sampler, collate_fn=list)
    sampler.set_epoch(1)
    groups = list(sampler.groups(loader))
    assert [size for size, _ in groups] == sampler.group_sizes() and [
        len(b) for _, b in groups
    ] == sampler.group_sizes()
    order = GlobalOrderSampler(range(30), seed=4).order(1)
    assert [sorted(x for batch in batches for x in batch) for _, batches in groups] == [
        sorted(order[s : s + 10]) for s in (0, 10, 20)
    ]
    state = sampler.state_dict(groups[0][0] + 1)  # inside the second group, one micro-batch done
    resumed = TokenBatchSampler(range(30), lengths, max_tokens=12, samples_per_update=10, seed=4)
    resumed.load_state_dict(state)
    assert resumed.resumed_microbatches == groups[0][0] + 1
    again = list(resumed.groups(DataLoader(range(30), batch_sampler=resumed, collate_fn=list)))
    assert [size for size, _ in again] == [g[0] for g in groups[1:]]
    assert [b for _, b in again] == [groups[1][1][1:], groups[2][1]]
    assert list(TokenBatchSampler(range(2), [1, 1], 4, 2).groups([])) == []  # an empty iteration: no group


def test_token_batches_recreate_a_shuffled_loader_and_leave_an_unshuffled_or_iterable_one_in_a_fabric_loop() -> None:
    options = TokenBatches(max_tokens=8, lengths=[1, 2, 3, 4, 5, 6, 7, 8], samples_per_update=4)
    data = [torch.tensor(i) for i in range(8)]
    shuffled = DataLoader(data, batch_size=2, shuffle=True, num_workers=0, collate_fn=torch.stack, pin_memory=False)
    ours = options.loader(shuffled, replicas=1, rank=0, seed=3, accumulate=None)
    assert ours is not None and isinstance(ours.batch_sampler, TokenBatchSampler)
    assert ours.collate_fn is torch.stack and ours.batch_sampler.seed == 3 and ours.batch_sampler.shuffle
    assert options.loader(DataLoader(data, batch_size=2), 1, 0, 3, accumulate=None) is None
    assert options.loader(DataLoader(_Stream(), batch_size=2), 1, 0, 3, accumulate=None) is None
    in_order = options.loader(DataLoader(data, batch_size=2), 1, 0, 3, accumulate=2)  # a Trainer's: B = 2 · 2 · 1
    assert in_order is not None and not in_order.batch_sampler.shuffle and in_order.batch_sampler.group_sizes()
    with pytest.raises(ValueError, match=r"`samples_per_update` must be an int >= 1, got 0"):
        TokenBatches(max_tokens=8, lengths="input_ids", samples_per_update=0)
