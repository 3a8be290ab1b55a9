"""One seeded order of the data dealt element-wise to the replicas: the same examples in an update at any m, A, D."""

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


def _check_state(state: object, keys: tuple[str, ...], writer: str) -> None:
    """Refuse a sampler ``state`` that lacks one of ``keys`` or holds a value other than an int >= 0 (``shuffle``: a
    bool) there, naming the key and ``writer``, the method that writes such states."""
    for key in keys:
        value = state.get(key) if isinstance(state, Mapping) else None
        expected = bool if key == "shuffle" else int
        if not isinstance(value, expected) or (expected is int and (isinstance(value, bool) or value < 0)):
            raise ValueError(
                f"The sampler state's {key!r} must be {'a bool' if expected is bool else 'an int >= 0'}, got"
                f" {value!r} (in {dict(state) if isinstance(state, Mapping) else state!r}). Pass a state written"
                f" by `{writer}`."
            )


class GlobalOrderSampler(DistributedSampler):  # type: ignore[type-arg]
    """One seeded order of ``dataset`` (``DistributedSampler``'s, without padding) dealt element-wise to the replicas;
    resumable at a global position under any ``D``.

    Args:
        dataset: The data (anything with a ``len``).
        num_replicas: ``D``, the data-parallel replicas (an accumulation strategy with ``global_order=True`` sets it).
        rank: This replica's data-parallel rank, ``0 <= rank < num_replicas``.
        shuffle: Shuffle per epoch by ``seed + epoch``; ``False`` reads ``0 .. N-1`` in order.
        seed: The seed of the order.

    Example:
        >>> data = list(range(10))
        >>> [list(GlobalOrderSampler(data, num_replicas=2, rank=r, shuffle=False)) for r in (0, 1)]
        [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]
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
        """Deal to ``num_replicas`` replicas, this one being ``rank``."""
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
        """The positions at the end of the order this epoch leaves out: ``(N - P) mod D``, ``P`` its start."""
        return (self.length - self._start) % self.num_replicas

    def order(self, epoch: int | None = None) -> list[int]:
        """The epoch's order of the data: position ``p`` holds example ``order()[p]``, at every ``D``."""
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
        """Where the epoch's order stands: ``{"epoch", "position", "seed", "shuffle", "length"}``.

        Args:
            position: The examples of all replicas consumed since the epoch's start; by default what this replica
                handed out times ``D`` (exact only without prefetching).
        """
        if position is None:
            position = self._start + self._dealt * self.num_replicas
        epoch = self.epoch
        if position >= self._start + self.num_replicas * ((self.length - self._start) // self.num_replicas):
            epoch, position = epoch + 1, 0
        return {"epoch": epoch, "position": position, "seed": self.seed, "shuffle": self.shuffle, "length": self.length}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the order where ``state`` stands, dealt to this sampler's ``D``."""
        _check_state(state, _STATE_KEYS, "GlobalOrderSampler.state_dict()")
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
    """The :class:`GlobalOrderSampler` replacing ``loader``'s ``DistributedSampler``, ``RandomSampler`` without
    replacement, ``SequentialSampler`` (unless ``in_order=False``) or ``GlobalOrderSampler``; else ``None``.
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
