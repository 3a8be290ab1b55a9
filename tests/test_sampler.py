"""GlobalOrderSampler: group g holds the positions [g·B, (g+1)·B) of one seeded order at any m, A (fixed or changing
per group) and D; the tail; epochs; the state that resumes at a global position under another D; its errors."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler, WeightedRandomSampler

from lightning_accum import GlobalOrderSampler
from lightning_accum.sampler import global_order_for


def _microbatches(sampler: GlobalOrderSampler, m: int) -> list[list[int]]:
    """This replica's micro-batches as a DataLoader of batch size ``m`` cuts them (the last one may be short)."""
    return [batch.tolist() for batch in DataLoader(range(sampler.length), batch_size=m, sampler=sampler)]


def _groups(n: int, m: int, sizes: list[int], replicas: int, seed: int = 3, epoch: int = 0) -> list[set[int]]:
    """The examples of each group when group k takes the next ``sizes[k]`` micro-batches of every replica (the last
    size repeats), with every replica's share in one set."""
    samplers = [GlobalOrderSampler(range(n), replicas, r, shuffle=True, seed=seed) for r in range(replicas)]
    for sampler in samplers:
        sampler.set_epoch(epoch)
    per_replica = [_microbatches(s, m) for s in samplers]
    counts = {len(batches) for batches in per_replica}
    assert len(counts) == 1, counts  # every replica runs the same number of micro-batches (DDP pairs them up)
    (count,) = counts
    groups, slot = [], 0
    for k in itertools.count():
        if slot >= count:
            return groups
        size = sizes[min(k, len(sizes) - 1)]
        groups.append({x for batches in per_replica for batch in batches[slot : slot + size] for x in batch})
        slot += size


@pytest.mark.parametrize("n", [40, 45, 47])
@pytest.mark.parametrize(
    ("m", "a", "d"), [(8, 1, 1), (4, 2, 1), (2, 4, 1), (1, 8, 1), (4, 1, 2), (2, 2, 2), (1, 4, 2), (2, 1, 4), (1, 2, 4)]
)
def test_group_g_holds_positions_g_b_to_g_plus_one_b_of_one_order_at_every_split(
    n: int, m: int, a: int, d: int
) -> None:
    order = GlobalOrderSampler(range(n), seed=3).order()
    covered = d * (n // d)  # the tail rule: the last n mod d positions are left out, fewer than d
    b = m * a * d
    expected = [set(order[start : min(start + b, covered)]) for start in range(0, covered, b)]
    assert _groups(n, m, [a], d) == expected
    # The last group holds what is left (a partial group when covered is not a multiple of B: the policy's).
    assert sum(map(len, expected)) == covered and n - covered < d


@pytest.mark.parametrize(("m", "d"), [(4, 1), (2, 2), (1, 4)])
def test_groups_of_changing_size_hold_the_next_block_of_the_order_without_knowing_a(m: int, d: int) -> None:
    # A batch-size schedule changes A between groups (m and D fixed): 1, 2, 4 micro-batches, then 4 for ever.
    order = GlobalOrderSampler(range(64), seed=3).order()
    starts = [0, 4, 12, 28, 44, 60]  # in positions: m·D = 4 per micro-batch slot
    expected = [set(order[s:e]) for s, e in itertools.pairwise([*starts, 64])]
    assert _groups(64, m, [1, 2, 4], d) == expected


def test_the_order_and_the_deal_are_torchs_distributed_sampler_without_its_padding() -> None:
    data = range(23)
    for replicas, shuffle, epoch in itertools.product((1, 2, 3, 5), (True, False), (0, 4)):
        for rank in range(replicas):
            ours = GlobalOrderSampler(data, replicas, rank, shuffle=shuffle, seed=11)
            torchs = DistributedSampler(data, replicas, rank, shuffle=shuffle, seed=11, drop_last=True)
            ours.set_epoch(epoch)
            torchs.set_epoch(epoch)
            assert list(ours) == list(torchs) and len(ours) == len(torchs) == 23 // replicas
            assert ours.left_out == 23 % replicas
    # Torch's default pads with repeated examples instead: one of them is read twice in the epoch.
    padded = [list(DistributedSampler(data, 2, r, shuffle=True, seed=11)) for r in (0, 1)]
    assert len(padded[0] + padded[1]) == 24 and len(set(padded[0] + padded[1])) == 23


def test_epochs_are_shuffled_by_seed_plus_epoch_and_the_order_does_not_depend_on_d() -> None:
    one = GlobalOrderSampler(range(30), seed=5)
    orders = [one.order(epoch) for epoch in range(3)]
    assert len({tuple(o) for o in orders}) == 3 and all(sorted(o) == list(range(30)) for o in orders)
    generator = torch.Generator().manual_seed(5 + 2)
    assert orders[2] == torch.randperm(30, generator=generator).tolist()
    three = [GlobalOrderSampler(range(30), 3, r, seed=5) for r in range(3)]
    for sampler in [one, *three]:
        sampler.set_epoch(2)
    dealt = [list(s) for s in three]
    assert [x for row in zip(*dealt, strict=True) for x in row] == list(one) == orders[2]
    assert list(GlobalOrderSampler(range(5), shuffle=False)) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(("before", "after"), [(1, 1), (1, 2), (2, 1), (2, 4), (4, 3)])
def test_a_state_resumes_at_the_same_global_position_under_another_d(before: int, after: int) -> None:
    n, position = 50, 12
    order = GlobalOrderSampler(range(n), seed=9).order(epoch=1)
    writing = GlobalOrderSampler(range(n), before, 0, seed=9)
    writing.set_epoch(1)
    state = writing.state_dict(position)
    assert state == {"epoch": 1, "position": 12, "seed": 9, "shuffle": True, "length": 50}
    resumed = [GlobalOrderSampler(range(n), after, r, seed=9) for r in range(after)]
    for sampler in resumed:
        sampler.load_state_dict(state)  # also sets the epoch: a loader's workers may start before `set_epoch`
        assert sampler.epoch == 1
    rest = [list(s) for s in resumed]
    count = (n - position) // after
    assert {len(r) for r in rest} == {count}
    assert [x for row in zip(*rest, strict=True) for x in row] == order[position : position + after * count]
    assert resumed[0].left_out == (n - position) % after
    # The next epoch starts from its beginning, and `len` is the whole epoch's count on a replica throughout.
    resumed[0].set_epoch(2)
    assert len(list(resumed[0])) == len(resumed[0]) == n // after


def test_the_default_state_counts_what_this_replica_handed_out_and_the_epochs_end_is_the_next_epoch() -> None:
    sampler = GlobalOrderSampler(range(11), 2, 1, seed=1)
    sampler.set_epoch(3)
    iterator = iter(sampler)
    next(iterator), next(iterator)
    assert sampler.state_dict()["position"] == 4  # two positions on each of the 2 replicas
    list(iterator)
    assert sampler.state_dict() == {"epoch": 4, "position": 0, "seed": 1, "shuffle": True, "length": 11}
    assert sampler.state_dict(position=10)["epoch"] == 4  # 10 of the 11: the dealt part (10) is done


def test_which_samplers_a_loader_has_replaced() -> None:
    data = list(range(12))

    def chosen(loader: DataLoader, replicas: int = 1) -> GlobalOrderSampler | None:
        return global_order_for(loader, replicas, 0, seed=4)

    shuffled = chosen(DataLoader(data, batch_size=2, shuffle=True))
    assert shuffled is not None and (shuffled.shuffle, shuffled.seed, shuffled.num_replicas) == (True, 4, 1)
    in_order = chosen(DataLoader(data, batch_size=2))
    assert in_order is not None and not in_order.shuffle
    injected = chosen(DataLoader(data, sampler=DistributedSampler(data, 2, 1, shuffle=False, seed=8)), 2)
    assert injected is not None and (injected.shuffle, injected.seed, injected.num_replicas, injected.rank) == (
        False,
        8,
        2,
        1,
    )
    given = GlobalOrderSampler(data, seed=6)
    assert chosen(DataLoader(data, sampler=given), 2) is given and given.num_replicas == 2 and given.seed == 6
    kept = [
        DataLoader(data, sampler=RandomSampler(data, replacement=True)),
        DataLoader(data, sampler=WeightedRandomSampler([1.0] * 12, 12)),
        DataLoader(data, sampler=SequentialSampler(data)),  # on 2 replicas: the user turned Lightning's sampler off
        DataLoader(data, batch_sampler=[[0, 1], [2, 3]]),
    ]
    assert [chosen(loader, 2) for loader in kept] == [None] * 4
    assert chosen(DataLoader(data, batch_sampler=[[0, 1], [2, 3]])) is None


def test_bad_arguments_and_states_are_clear_errors() -> None:
    data = range(10)
    with pytest.raises(ValueError, match=r"`num_replicas` must be an int >= 1, got 0"):
        GlobalOrderSampler(data, num_replicas=0)
    with pytest.raises(ValueError, match=r"`rank` must be an int in \[0, 1\] \(`num_replicas=2`\), got 2"):
        GlobalOrderSampler(data, num_replicas=2, rank=2)
    with pytest.raises(TypeError, match=r"`shuffle` must be a bool, got 'yes'"):
        GlobalOrderSampler(data, shuffle="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"`seed` must be an int, got 1.5"):
        GlobalOrderSampler(data, seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"`dataset` must have a length .* got generator"):
        GlobalOrderSampler(x for x in data)  # type: ignore[arg-type]
    sampler = GlobalOrderSampler(data, seed=2)
    state = sampler.state_dict(4)
    with pytest.raises(ValueError, match=r"The sampler state's 'position' must be an int >= 0, got None"):
        sampler.load_state_dict({k: v for k, v in state.items() if k != "position"})
    with pytest.raises(ValueError, match=r"another order: written for length=10, shuffle=True, seed=2; this sampler"):
        GlobalOrderSampler(range(11), seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match=r"another order: .* seed=3\. Resume with the same data"):
        GlobalOrderSampler(data, seed=3).load_state_dict(state)
    GlobalOrderSampler(data, seed=3).load_state_dict({**state, "position": 0})  # an epoch's start: any order
    with pytest.raises(ValueError, match=r"position 11 is past the data's end \(10 examples\)"):
        sampler.load_state_dict({**state, "position": 11})
