"""One seeded order of the data, dealt to the replicas so that every update holds the same examples at any m, A, D.

Group ``g`` of a run with ``m`` examples per micro-batch, ``A`` micro-batches per group and ``D`` replicas should hold
the global positions ``[g·B, (g+1)·B)`` of one order of the data, ``B = m·A·D``, whatever the split. Deal the order
element by element, as torch's ``DistributedSampler`` does: replica ``r`` reads positions ``r, r + D, r + 2D, ...``, so
its ``j``-th micro-batch holds ``{(j·m + i)·D + r : i < m}``. The micro-batches of slot ``j`` on all ``D`` replicas
hold ``[j·m·D, (j+1)·m·D)``, and any ``A`` consecutive slots ``j0 .. j0+A-1`` hold ``[j0·m·D, (j0+A)·m·D)``: a
contiguous block of ``m·A·D`` positions. Group ``g`` starts at slot ``g·A`` (or, under a schedule that changes ``A``
between groups, at the sum of the earlier groups' sizes), so it holds the next ``B`` positions — the sampler needs to
know neither ``m`` nor ``A``, only ``D`` and this replica's rank. The order itself (``torch.randperm`` of a generator
seeded ``seed + epoch``, or ``0 .. N-1``) does not depend on ``D``.

The tail: every replica must run the same number of micro-batches (DDP's collectives pair up by count; map-style data
is not checked by the data-end agreement). Replica ``r`` reads ``⌊(N - P)/D⌋`` positions from the epoch's start
position ``P`` (0, or where a resume continues), so the last ``(N - P) mod D`` positions of the order — fewer than
``D``, none on one replica — are left out of that epoch (:attr:`GlobalOrderSampler.left_out`); with shuffling they are
other examples each epoch. Nothing is padded, so no example is counted twice. The last micro-batch may be short (the
same length on every replica), and the last group of the epoch may hold fewer than ``B`` positions: that is the
partial final group, which the strategy's ``partial_group=`` policy decides on every ``D`` alike.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sized
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

__all__ = ["GlobalOrderSampler", "global_order_for"]

_STATE_KEYS = ("epoch", "position", "seed", "shuffle", "length")


def _positive_int(argument: str, value: object, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"`{argument}` must be an int >= {least}, got {value!r}. Pass e.g. `{argument}={least}`.")
    return value


class GlobalOrderSampler(DistributedSampler):  # type: ignore[type-arg]
    """The positions of one seeded order of ``dataset``, dealt element-wise to ``num_replicas`` replicas.

    Its order and deal are torch's ``DistributedSampler``'s without the padding (see the module's docstring). It
    subclasses ``DistributedSampler`` so that Lightning and Fabric recognise it as a distributed sampler and leave it in
    place.

    Args:
        dataset: The data (anything with a ``len``).
        num_replicas: ``D``, the data-parallel replicas (an accumulation strategy with ``global_order=True`` sets it).
        rank: This replica's data-parallel rank, ``0 <= rank < num_replicas``.
        shuffle: Shuffle per epoch by ``seed + epoch``; ``False`` reads ``0 .. N-1`` in order.
        seed: The seed of the order (the same on every replica and in every run that should see the same order).

    Mid-epoch resume: :meth:`state_dict` says where the epoch's order stands (a global position, the same meaning at
    any ``D``); after :meth:`load_state_dict` the next iteration of that epoch continues there, with this sampler's
    ``D``. ``len()`` is the whole epoch's count on this replica also when an iteration resumes (Lightning counts a
    resumed epoch's batches from its start).

    Example:
        >>> data = list(range(10))
        >>> [list(GlobalOrderSampler(data, num_replicas=2, rank=r, shuffle=False)) for r in (0, 1)]
        [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]
        >>> sampler = GlobalOrderSampler(data, num_replicas=3, rank=0, shuffle=False)
        >>> list(sampler), sampler.left_out
        ([0, 3, 6], 1)
        >>> one = GlobalOrderSampler(data, seed=7)
        >>> two = [GlobalOrderSampler(data, num_replicas=2, rank=r, seed=7) for r in (0, 1)]
        >>> sorted(list(one)[:4]) == sorted(list(two[0])[:2] + list(two[1])[:2])  # the first 4 positions
        True
    """

    def __init__(
        self, dataset: Sized, num_replicas: int = 1, rank: int = 0, shuffle: bool = True, seed: int = 0
    ) -> None:
        if not isinstance(dataset, Sized):
            raise TypeError(
                f"`dataset` must have a length (a map-style dataset), got {type(dataset).__name__}. An iterable"
                " dataset has no positions to deal: shard it yourself."
            )
        if not isinstance(shuffle, bool):
            raise TypeError(f"`shuffle` must be a bool, got {shuffle!r}. Pass True or False.")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"`seed` must be an int, got {seed!r}. Pass e.g. `seed=0`.")
        super().__init__(dataset, num_replicas=1, rank=0, shuffle=shuffle, seed=seed, drop_last=True)  # type: ignore[arg-type]
        self.set_replicas(num_replicas, rank)
        self._start = 0  # the global position the running (or next) iteration starts at
        self._dealt = 0  # positions this replica has handed out in the running iteration
        self._resume: tuple[int, int] | None = None  # (epoch, position) a loaded state continues

    def set_replicas(self, num_replicas: int, rank: int) -> None:
        """Deal to ``num_replicas`` replicas, this one being ``rank`` (an accumulation strategy calls it at set-up)."""
        _positive_int("num_replicas", num_replicas, 1)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise ValueError(
                f"`rank` must be an int in [0, {num_replicas - 1}] (`num_replicas={num_replicas}`), got {rank!r}."
                " Pass this replica's data-parallel rank."
            )
        self.num_replicas, self.rank = num_replicas, rank
        self.num_samples = len(self)  # DistributedSampler's attributes, kept true for code that reads them
        self.total_size = self.num_samples * num_replicas

    @property
    def length(self) -> int:
        """``N``, the number of examples of the data."""
        return len(self.dataset)  # type: ignore[arg-type]

    @property
    def left_out(self) -> int:
        """The positions at the end of the order this epoch leaves out (fewer than ``D``): ``(N - P) mod D``."""
        return (self.length - self._start) % self.num_replicas

    def order(self, epoch: int | None = None) -> list[int]:
        """The epoch's order of the data (``epoch``: this sampler's by default): position ``p`` holds example
        ``order()[p]``, the same on every replica and at every ``D``."""
        epoch = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return list(range(self.length))
        generator = torch.Generator()
        generator.manual_seed(self.seed + epoch)  # torch's DistributedSampler seeds the same way
        return torch.randperm(self.length, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        start = 0
        if self._resume is not None and self._resume[0] == self.epoch:
            start = self._resume[1]
        self._resume = None
        self._start, self._dealt = start, 0
        return self._deal(start)

    def _deal(self, start: int) -> Iterator[int]:
        order, replicas = self.order(), self.num_replicas
        for position in range(start + self.rank, start + replicas * ((self.length - start) // replicas), replicas):
            self._dealt += 1
            yield order[position]

    def __len__(self) -> int:
        return self.length // self.num_replicas

    def state_dict(self, position: int | None = None) -> dict[str, Any]:
        """Where the epoch's order stands: ``{"epoch", "position", "seed", "shuffle", "length"}`` (ints, a bool).

        Args:
            position: The global position the epoch has consumed up to (examples of all replicas from the epoch's
                start), as the training loop counts it; by default what this replica has handed out, times ``D``
                (exact only where nothing is fetched ahead: no loader workers, no prefetching). An accumulation
                strategy passes the micro-batches its loop has processed times ``m·D``.

        A position at or past the end of the epoch's dealt positions is saved as the start of the next epoch.
        """
        if position is None:
            position = self._start + self._dealt * self.num_replicas
        epoch = self.epoch
        if position >= self._start + self.num_replicas * ((self.length - self._start) // self.num_replicas):
            epoch, position = epoch + 1, 0
        return {"epoch": epoch, "position": position, "seed": self.seed, "shuffle": self.shuffle, "length": self.length}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the order where ``state`` (a :meth:`state_dict`) stands: the next iteration of its epoch starts at
        its position, dealt to this sampler's ``D`` (another ``D`` than the writing run's included)."""
        for key in _STATE_KEYS:
            value = state.get(key) if isinstance(state, Mapping) else None
            expected = bool if key == "shuffle" else int
            if not isinstance(value, expected) or (expected is int and (isinstance(value, bool) or value < 0)):
                raise ValueError(
                    f"The sampler state's {key!r} must be {'a bool' if expected is bool else 'an int >= 0'}, got"
                    f" {value!r} (in {dict(state) if isinstance(state, Mapping) else state!r}). Pass a state written"
                    " by `GlobalOrderSampler.state_dict()`."
                )
        written = (state["length"], state["shuffle"], state["seed"])
        if state["position"] and written != (self.length, self.shuffle, self.seed):
            raise ValueError(
                f"The sampler state continues an epoch of another order: written for length={written[0]},"
                f" shuffle={written[1]}, seed={written[2]}; this sampler has length={self.length},"
                f" shuffle={self.shuffle}, seed={self.seed}. Resume with the same data, shuffling and seed, or from a"
                " checkpoint written at the end of an epoch."
            )
        if state["position"] > self.length:
            raise ValueError(
                f"The sampler state's position {state['position']} is past the data's end ({self.length} examples)."
                " Pass a state written by `GlobalOrderSampler.state_dict()` for this data."
            )
        self.epoch = state["epoch"]
        self._resume = (state["epoch"], state["position"])


def global_order_for(
    loader: DataLoader,  # type: ignore[type-arg]
    num_replicas: int,
    rank: int,
    seed: int,
    in_order: bool = True,
) -> GlobalOrderSampler | None:
    """The :class:`GlobalOrderSampler` to read ``loader``'s data with, or ``None`` where ``loader`` keeps its own.

    Replaced: torch's ``DistributedSampler`` itself (the one Lightning or Fabric puts in; its ``shuffle`` and ``seed``
    kept), and on one replica a ``RandomSampler`` over the whole data without replacement (shuffled by ``seed``) or a
    ``SequentialSampler`` (in order). A ``GlobalOrderSampler`` already there is dealt to ``num_replicas`` (its own
    ``shuffle`` and ``seed`` kept). Everything else keeps its order: an iterable dataset, a batch sampler of the
    user's, another sampler (a weighted one, a sampler with replacement, Lightning's wrapper of a custom sampler).
    ``in_order=False`` keeps the unshuffled ones too (a Fabric loop's evaluation loaders: their tail must not be left
    out).
    """
    sampler = getattr(loader, "sampler", None)
    dataset = getattr(loader, "dataset", None)
    if isinstance(dataset, IterableDataset) or type(getattr(loader, "batch_sampler", None)) is not BatchSampler:
        return None
    if isinstance(sampler, GlobalOrderSampler):
        sampler.set_replicas(num_replicas, rank)
        return sampler
    if not in_order and not isinstance(sampler, RandomSampler | DistributedSampler):
        return None
    if type(sampler) is DistributedSampler and (in_order or sampler.shuffle):
        # Its layout is the strategy's (Lightning and Fabric build it from the data-parallel ranks) or the user's.
        replicas, own_rank = int(sampler.num_replicas), int(sampler.rank)
        shuffle, seed = bool(sampler.shuffle), int(sampler.seed)
        return GlobalOrderSampler(dataset, replicas, own_rank, shuffle=shuffle, seed=seed)  # type: ignore[arg-type]
    if num_replicas == 1 and isinstance(sampler, RandomSampler):
        if sampler.replacement or sampler.num_samples != len(dataset):  # type: ignore[arg-type]
            return None
        return GlobalOrderSampler(dataset, 1, 0, shuffle=True, seed=seed)  # type: ignore[arg-type]
    if num_replicas == 1 and type(sampler) is SequentialSampler:
        return GlobalOrderSampler(dataset, 1, 0, shuffle=False, seed=seed)  # type: ignore[arg-type]
    return None
