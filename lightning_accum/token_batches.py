"""Micro-batches cut by tokens inside the groups of a fixed-``m`` run with ``global_order=True``: group ``g`` holds
the positions ``[g·B, (g+1)·B)`` of :class:`~lightning_accum.GlobalOrderSampler`'s order (its tail rule), at any
``max_tokens`` and ``D``. Every rank plans the same from the seed, the epoch and the lengths. Numpy and torch only.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Sized
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, Sampler

from lightning_accum.options import validate_choice
from lightning_accum.sampler import GlobalOrderSampler, _check_state, _positive_int, global_order_for

__all__ = ["COUNTS", "LONG_ROWS", "TokenBatchSampler", "TokenBatches", "even_cut", "plan_group"]

#: How a micro-batch's tokens are counted against ``max_tokens``: rows × its longest row, or the sum of lengths.
COUNTS: tuple[str, ...] = ("padded", "sum")
#: What a row longer than ``max_tokens`` does: refused when the sampler is made, or a micro-batch of its own.
LONG_ROWS: tuple[str, ...] = ("error", "alone")

Indices = npt.NDArray[np.int64]
_STATE_KEYS = ("epoch", "position", "done", "microbatches", "samples", "replicas", "seed", "shuffle", "length")


def _cost(lengths: Indices, padded: bool) -> int:
    """The tokens of one micro-batch of ``lengths`` (longest first) as the budget counts them."""
    return int(len(lengths) * lengths[0]) if padded else int(lengths.sum())


def _cut(lengths: Indices, max_tokens: int, padded: bool, max_samples: int) -> list[tuple[int, int]]:
    """Greedy micro-batches ``[a, b)`` of ``lengths`` (longest first) under the budget; a row over it alone."""
    pieces, start, total = [], 0, len(lengths)
    ends = np.cumsum(lengths)
    while start < total:
        if padded:  # every row after ``start`` is at most as long as it
            fits = max_tokens // int(lengths[start])
        else:
            fits = int(np.searchsorted(ends, ends[start] - lengths[start] + max_tokens, side="right")) - start
        stop = start + max(1, min(fits, max_samples, total - start))
        pieces.append((start, stop))
        start = stop
    return pieces


def even_cut(lengths: Indices, max_tokens: int, padded: bool) -> list[tuple[int, int]]:
    """The fewest micro-batches ``[a, b)`` of ``lengths`` (longest first) under the budget (a longer row alone), as even
    as their number allows: :func:`_cut` under the least budget that keeps that number."""
    count, low, high = len(_cut(lengths, max_tokens, padded, len(lengths))), 1, max_tokens
    while low < high:  # the number of pieces only falls as the budget grows
        middle = (low + high) // 2
        low, high = (low, middle) if len(_cut(lengths, middle, padded, len(lengths))) <= count else (middle + 1, high)
    return _cut(lengths, low, padded, len(lengths))


def _deal(costs: list[int], replicas: int) -> list[list[int]]:
    """LPT with equal counts: the largest cost first, to the least-loaded replica that still has room."""
    room = len(costs) // replicas
    heap = [(0, rank) for rank in range(replicas)]
    dealt: list[list[int]] = [[] for _ in range(replicas)]
    for piece in sorted(range(len(costs)), key=lambda k: (-costs[k], k)):
        load, rank = heapq.heappop(heap)
        dealt[rank].append(piece)
        if len(dealt[rank]) < room:
            heapq.heappush(heap, (load + costs[piece], rank))
    return dealt


def plan_group(
    lengths: Sequence[int] | Indices,
    replicas: int,
    max_tokens: int,
    count: str = "padded",
    max_samples: int | None = None,
    seed: Sequence[int] = (0,),
) -> list[list[Indices]]:
    """One group's micro-batches per replica, as positions into ``lengths`` (a positive multiple of ``replicas`` rows):
    sorted longest first, cut greedily under the budget (a longer row alone), the fullest halved until their number is
    a multiple of ``replicas``, dealt largest first to the least-loaded replica with room, slots shuffled by ``seed``.

    Example:
        >>> [[p.tolist() for p in rank] for rank in plan_group([5, 1, 3, 8, 2, 2], replicas=2, max_tokens=9)]
        [[[2, 4, 5], [1]], [[3], [0]]]
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(-lengths, kind="stable")
    ordered, padded = lengths[order], count == "padded"
    pieces = _cut(ordered, max_tokens, padded, len(lengths) if max_samples is None else max_samples)
    while len(pieces) % replicas:  # halve the fullest splittable piece: possible while pieces < rows
        k = max(
            (k for k, (a, b) in enumerate(pieces) if b - a > 1), key=lambda k: _cost(ordered[slice(*pieces[k])], padded)
        )
        a, b = pieces[k]
        pieces[k : k + 1] = [(a, (a + b + 1) // 2), ((a + b + 1) // 2, b)]
    dealt = _deal([_cost(ordered[a:b], padded) for a, b in pieces], replicas)
    slots = np.random.default_rng(list(seed)).permutation(len(pieces) // replicas)
    return [[order[slice(*pieces[rank_pieces[s]])] for s in slots] for rank_pieces in dealt]


def _read_lengths(dataset: Sized, lengths: Sequence[int] | str | Callable[[int], int]) -> Indices:
    """One int per example, read once: a sequence, a column (a ``datasets.Dataset``'s as one Arrow column; else the
    length of each example's entry), or a function of the index."""
    if isinstance(lengths, str) and hasattr(dataset, "with_format"):
        import pyarrow.compute  # a dependency of `datasets`

        values: Any = pyarrow.compute.list_value_length(dataset.with_format("arrow")[lengths]).to_numpy()
    elif isinstance(lengths, str):
        values = [len(_entry(dataset, index, lengths)) for index in range(len(dataset))]
    elif callable(lengths):
        values = [lengths(index) for index in range(len(dataset))]
    else:
        values = lengths
    array = np.asarray(values)
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise TypeError(
            f"`lengths` must give one int per example, got {type(values).__name__} of dtype {array.dtype} and shape"
            f" {array.shape}. Pass e.g. `[len(row['input_ids']) for row in data]`."
        )
    if len(array) != len(dataset):
        raise ValueError(
            f"`lengths` has {len(array)} entries but the dataset has {len(dataset)} examples. Pass one length per"
            " example, in the dataset's order."
        )
    if (array < 1).any():
        index = int(np.argmax(array < 1))
        raise ValueError(f"`lengths` must be positive, got {int(array[index])} at index {index}. Drop empty rows.")
    return array.astype(np.int64)


def _entry(dataset: Any, index: int, column: str) -> Any:
    example = dataset[index]
    if not isinstance(example, Mapping) or column not in example:
        found = sorted(example) if isinstance(example, Mapping) else type(example).__name__
        raise TypeError(
            f"`lengths={column!r}` names a column, but example {index} of the dataset has none (it holds {found})."
            " Name one of its entries, or pass one int per example or a function of the index."
        )
    return example[column]


class _Origin(NamedTuple):
    """Where an iteration starts: the group at ``start`` (``samples``: its ``B`` if open), ``skip`` of its micro-batches
    per replica done on ``replicas``, ``offset`` micro-batches per replica of the epoch run before."""

    start: int = 0
    skip: int = 0
    offset: int = 0
    samples: int = 0
    replicas: int = 0


class _Group(NamedTuple):
    start: int  # its first global position
    rows: int  # its positions: ``samples``, fewer for the epoch's last group
    samples: int
    ranks: list[list[Indices]]  # per replica, its micro-batches in order (dataset indices)


class TokenBatchSampler(Sampler[list[int]]):
    """A batch sampler: each update holds the ``B`` examples of a fixed-``m`` run's group, cut by tokens. Its
    ``sampler`` is the order (a :class:`~lightning_accum.GlobalOrderSampler`), whose ``set_epoch`` Lightning calls.

    Args:
        dataset: The map-style data (an ``IterableDataset`` is refused: the lengths need positions).
        lengths: The tokens of each example, read once: a sequence of ints, the name of a list column of a Hugging
            Face ``datasets.Dataset`` (its lengths read as one Arrow column), or a function of the index.
        max_tokens: The tokens of one micro-batch on one device, counted as ``count`` says.
        samples_per_update: ``B``, a multiple of ``num_replicas``, or a function ``(epoch, position) -> B`` asked at
            each group's start (``position``: the group's first global position in the epoch's order).
        count: ``"padded"`` (rows × the longest row) or ``"sum"`` (the sum of lengths: packed rows).
        max_samples: At most this many rows per micro-batch.
        long_rows: A row over ``max_tokens``: ``"error"``, or ``"alone"`` (a micro-batch of its own, warned once).
        num_replicas, rank: ``D`` and this replica's rank (settable later by :meth:`set_replicas`).
        shuffle, seed: The order's, as :class:`~lightning_accum.GlobalOrderSampler`'s.
        plan_ahead: Plan each epoch whole on its first use (``len()`` exact); ``False`` asks a function
            ``samples_per_update`` group by group as the iteration reaches each group, and ``len()`` is unknown.

    Raises:
        TypeError: An iterable dataset, lengths that are not ints, ``len()`` when not planned ahead.
        ValueError: A bad argument, a row over the budget (``long_rows="error"``), ``N < D``, ``D`` not dividing ``B``.

    Example:
        >>> sampler = TokenBatchSampler(range(8), [5, 1, 3, 8, 2, 2, 7, 4], max_tokens=10, samples_per_update=4,
        ...                             shuffle=False)
        >>> list(sampler), sampler.group_sizes()  # groups: indices 0-3 and 4-7, each sorted and cut by tokens
        ([[1], [0, 2], [3], [5], [7, 4], [6]], [3, 3])
    """

    def __init__(
        self,
        dataset: Sized,
        lengths: Sequence[int] | str | Callable[[int], int],
        max_tokens: int,
        samples_per_update: int | Callable[[int, int], int],
        count: str = "padded",
        max_samples: int | None = None,
        long_rows: str = "error",
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        plan_ahead: bool = True,
    ) -> None:
        super().__init__()
        _map_style(dataset)
        _check_options(max_tokens, samples_per_update, count, max_samples, long_rows)
        self.count, self.long_rows = count, long_rows
        self.dataset, self.max_tokens, self.max_samples = dataset, max_tokens, max_samples
        self.samples_per_update, self.plan_ahead = samples_per_update, bool(plan_ahead)
        # The order (it checks both), where Lightning's loops look for a batch sampler's `set_epoch`.
        self.sampler = GlobalOrderSampler(range(len(dataset)), shuffle=shuffle, seed=seed)
        self.shuffle, self.seed = shuffle, seed
        self.set_replicas(num_replicas, rank)
        self.lengths = _read_lengths(dataset, lengths)
        over = np.flatnonzero(self.lengths > max_tokens)
        self.long_row_count = len(over)  # rows over the budget in the data: with "alone", a micro-batch each
        if len(over) and long_rows == "error":
            longest = int(over[np.argmax(self.lengths[over])])
            raise ValueError(
                f"{len(over)} rows are longer than `max_tokens={max_tokens}` (the longest: {self.lengths[longest]}"
                f" tokens, index {longest}). Raise `max_tokens` to {self.lengths[longest]}, pass `long_rows='alone'`"
                " to run each as a micro-batch of its own, or filter them out."
            )
        self._warned, self._yielded = False, 0
        self._resume: tuple[int, _Origin] | None = None  # (epoch, origin) a loaded state continues
        self._iteration: tuple[int, _Origin] | None = None
        self._key: tuple[int, ...] = ()
        self._planned: list[_Group] = []
        self._order_of: tuple[int, Indices] = (-1, np.empty(0, dtype=np.int64))  # (epoch, its order)
        self._rows: tuple[tuple[int, ...], list[Indices]] = ((), [])  # this replica's micro-batches, for a plan
        self._loop: list[int] | None = None  # a Fabric loader's count of iterations: [the epoch of its 0, its next]

    def set_replicas(self, num_replicas: int, rank: int) -> None:
        """Deal to ``num_replicas`` replicas, this one being ``rank`` (an accumulation strategy calls it at set-up)."""
        self.sampler.set_replicas(num_replicas, rank)
        if self.length < num_replicas:
            raise ValueError(
                f"`num_replicas={num_replicas}` exceeds the data's {self.length} examples: every replica needs a row"
                " in every group. Use fewer replicas or more data."
            )
        if isinstance(self.samples_per_update, int) and self.samples_per_update % num_replicas:
            raise _not_a_multiple(self.samples_per_update, num_replicas)
        self.num_replicas, self.rank = num_replicas, rank

    def set_epoch(self, epoch: int) -> None:
        """Plan epoch ``epoch`` (its order: ``seed + epoch``), as ``self.sampler.set_epoch`` does."""
        self.sampler.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        """The epoch planned: the order's."""
        return int(self.sampler.epoch)

    @property
    def length(self) -> int:
        """``N``, the number of examples of the data."""
        return self.sampler.length

    @property
    def resumed_microbatches(self) -> int:
        """The micro-batches per replica of this epoch run before its iteration (by the run a loaded state left)."""
        return self._origin().offset

    def _origin(self) -> _Origin:
        """Where this epoch's iteration starts (a loaded state's place, or the epoch's start)."""
        if self._resume is not None and self._resume[0] == self.epoch:
            origin = self._resume[1]
            if origin.skip and origin.replicas != self.num_replicas:
                raise ValueError(
                    f"The sampler state continues a group open after {origin.skip} micro-batches per replica on"
                    f" {origin.replicas} replicas; this sampler deals to {self.num_replicas}. Resume inside a group"
                    " on the same number of replicas, or from a checkpoint written at a group's end."
                )
            return origin
        return self._iteration[1] if self._iteration is not None and self._iteration[0] == self.epoch else _Origin()

    def _groups(self) -> Iterator[_Group]:
        """The epoch's groups from its iteration's start, planned on first need and kept."""
        origin = self._origin()
        key = (self.epoch, self.num_replicas, origin.start, origin.samples)
        if key != self._key:
            self._key, self._planned = key, []
        k = 0
        while k < len(self._planned) or self._plan_next(origin):
            yield self._planned[k]
            k += 1

    def _plan_next(self, origin: _Origin) -> bool:
        """Plan the group after the last one planned; ``False`` at the epoch's end."""
        replicas, planned = self.num_replicas, self._planned
        end = origin.start + replicas * ((self.length - origin.start) // replicas)  # the tail rule
        start = planned[-1].start + planned[-1].rows if planned else origin.start
        if start >= end:
            return False
        if self._order_of[0] != self.epoch:
            self._order_of = (self.epoch, np.asarray(self.sampler.order(self.epoch), dtype=np.int64))
        samples = origin.samples if not planned and origin.samples else self._samples_at(start)
        rows = self._order_of[1][start : min(start + samples, end)]
        seed = (self.seed, self.epoch, start)
        plan = plan_group(self.lengths[rows], replicas, self.max_tokens, self.count, self.max_samples, seed)
        if not planned and origin.skip >= len(plan[0]):
            raise ValueError(
                f"The sampler state's `done={origin.skip}` is not inside its open group of {len(plan[0])}"
                " micro-batches per replica. Pass a state written by `TokenBatchSampler.state_dict()`."
            )
        planned.append(_Group(start, len(rows), samples, [[rows[p] for p in rank] for rank in plan]))
        return True

    def _samples_at(self, start: int) -> int:
        """``B`` of the group starting at ``start``."""
        if not callable(self.samples_per_update):
            return self.samples_per_update
        samples = self.samples_per_update(self.epoch, start)
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1 or samples % self.num_replicas:
            raise _not_a_multiple(samples, self.num_replicas, f" (returned for position {start} of epoch {self.epoch})")
        return samples

    def _plan(self) -> list[_Group]:
        """The epoch's groups: all of them when planned ahead, else those planned so far."""
        if self.plan_ahead:
            return list(self._groups())
        origin = self._origin()
        return self._planned if self._key == (self.epoch, self.num_replicas, origin.start, origin.samples) else []

    def __iter__(self) -> Iterator[list[int]]:
        origin = self._origin()
        self._resume, self._iteration, self._yielded = None, (self.epoch, origin), 0
        if self.long_row_count and self.rank == 0 and not self._warned:
            self._warned = True
            warnings.warn(
                f"{self.long_row_count} rows of the data are longer than `max_tokens={self.max_tokens}` (the"
                f" longest: {self.lengths.max()}); each runs as a micro-batch of its own, over the budget"
                " (`long_rows='alone'`).",
                UserWarning,
                stacklevel=2,
            )
        return self._deal(origin.skip)

    def _deal(self, skip: int) -> Iterator[list[int]]:
        for group in self._groups():
            for batch in group.ranks[self.rank][skip:]:
                self._yielded += 1
                yield batch.tolist()
            skip = 0

    def __len__(self) -> int:
        if not self.plan_ahead:
            raise TypeError(
                "`len()` of a TokenBatchSampler planned group by group (`plan_ahead=False`) is not known before the"
                " epoch's groups start (`group_sizes()`: those so far). Pass `plan_ahead=True` where"
                " `samples_per_update` depends on the epoch and position alone."
            )
        origin = self._origin()
        return origin.offset - origin.skip + sum(self.group_sizes())

    def group_sizes(self) -> list[int]:
        """Micro-batches per replica of each group of this epoch from the iteration's start (the open group whole)."""
        return [len(group.ranks[0]) for group in self._plan()]

    def groups(self, loader: Iterable[Any]) -> Iterator[tuple[int, list[Any]]]:
        """One epoch of ``loader`` (batched by this sampler) cut into its groups: each group's micro-batches per
        replica, and the batches of it this replica runs (fewer in a group a loaded state continues)."""
        batches = iter(loader)
        first = next(batches, None)  # a Fabric loader sets the sampler's epoch as it starts
        batches, skip = itertools.chain([first], batches), self._origin().skip
        for size in self.group_sizes() if first is not None else []:
            yield size, list(itertools.islice(batches, size - skip))
            skip = 0

    def group_spans(self) -> list[tuple[int, int, int]]:
        """Per group planned (as :meth:`group_sizes`): its first position, its rows and ``B`` (more: it is partial)."""
        return [(group.start, group.rows, group.samples) for group in self._plan()]

    def rows(self, batch: int) -> Indices:
        """The dataset indices of this replica's micro-batch ``batch`` of the epoch (counted as ``len()`` counts; none
        outside it)."""
        origin = self._origin()
        key = (self.epoch, self.num_replicas, origin.start, origin.samples)
        if self._rows[0] != (*key, len(self._planned)):
            flat = [rows for group in self._plan() for rows in group.ranks[self.rank]]
            self._rows = ((*key, len(self._planned)), flat)
        k = batch - origin.offset + origin.skip
        return self._rows[1][k] if 0 <= k < len(self._rows[1]) else np.empty(0, dtype=np.int64)

    def group_index(self, microbatch: int) -> int:
        """The group holding micro-batch ``microbatch`` of the epoch (counted as ``len()`` counts), an index into
        :meth:`group_sizes`, :meth:`group_stats` and :meth:`group_examples`."""
        origin = self._origin()
        starts = itertools.accumulate(self.group_sizes()[:-1], initial=origin.offset - origin.skip)
        return max(0, bisect.bisect_right(list(starts), microbatch) - 1)

    def group_examples(self, group: int) -> list[int]:
        """The dataset indices of group ``group``, replica by replica, micro-batch by micro-batch."""
        return [int(i) for rank in self._plan()[group].ranks for batch in rank for i in batch]

    def group_stats(self, groups: slice = slice(None)) -> list[dict[str, Any]]:
        """Per group planned (as :meth:`group_sizes`; those of ``groups``): ``position``, ``samples``, ``tokens``,
        ``padded_tokens``, ``microbatches`` per replica, ``replica_load`` (tokens as ``count`` counts them) and
        ``imbalance`` (max / mean of it), ``microbatch_samples`` and ``microbatch_padded_tokens`` (replica by
        replica), ``long_rows``."""
        stats = []
        for group in self._plan()[groups]:
            batches = [batch for rank in group.ranks for batch in rank]  # replica by replica
            longest = [int(self.lengths[batch].max()) for batch in batches]
            tokens = [int(self.lengths[batch].sum()) for batch in batches]
            padded = [len(batch) * n for batch, n in zip(batches, longest, strict=True)]
            per, counted = len(group.ranks[0]), padded if self.count == "padded" else tokens
            load = [sum(counted[r * per : (r + 1) * per]) for r in range(len(group.ranks))]
            stats.append(
                dict(
                    position=group.start,
                    samples=group.rows,
                    tokens=sum(tokens),
                    padded_tokens=sum(padded),
                    microbatches=per,
                    replica_load=load,
                    imbalance=max(load) * len(load) / sum(load),
                    microbatch_samples=[len(batch) for batch in batches],
                    microbatch_padded_tokens=padded,
                    long_rows=sum(n > self.max_tokens for n in longest),
                )
            )
        return stats

    def state_dict(self, microbatches: int | None = None) -> dict[str, Any]:
        """Where the epoch stands after ``microbatches`` of this iteration (default: those handed out): the group at
        ``position`` with ``done`` of its micro-batches per replica run and its ``samples`` (both 0 at a boundary, where
        any ``D`` continues), the epoch's ``microbatches`` per replica, ``replicas``, ``seed``, ``shuffle``, ``length``.
        """
        origin = self._origin()
        ran = microbatches
        if ran is None:  # handed out by this epoch's iteration
            ran = self._yielded if self._iteration is not None and self._iteration[0] == self.epoch else 0
        position, done, samples = origin.start, origin.skip + ran, 0
        for group in self._plan():
            if done < len(group.ranks[0]):
                samples = group.samples if done else 0
                break
            done, position = done - len(group.ranks[0]), group.start + group.rows
        epoch, ran = self.epoch, origin.offset + ran
        if position >= origin.start + self.num_replicas * ((self.length - origin.start) // self.num_replicas):
            epoch, position, done, ran = epoch + 1, 0, 0, 0
        values = (epoch, position, done, ran, samples, self.num_replicas, self.seed, self.shuffle, self.length)
        return dict(zip(_STATE_KEYS, values, strict=True))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue where ``state`` (a :meth:`state_dict`) stands: at its group boundary under this sampler's ``D``,
        or inside its open group on the same ``D``; ``len()`` of that epoch counts its ``microbatches`` first."""
        _check_state(state, _STATE_KEYS, "TokenBatchSampler.state_dict()")
        written = (state["length"], state["shuffle"], state["seed"])
        if (state["position"] or state["done"]) and written != (self.length, self.shuffle, self.seed):
            raise ValueError(
                f"The sampler state continues an epoch of another order: written for length={written[0]},"
                f" shuffle={written[1]}, seed={written[2]}; this sampler has length={self.length},"
                f" shuffle={self.shuffle}, seed={self.seed}. Resume with the same data, shuffling and seed."
            )
        if state["position"] and state["position"] >= self.length:
            raise ValueError(
                f"The sampler state's position {state['position']} is past the data's end ({self.length} examples)."
                " Pass a state written by `TokenBatchSampler.state_dict()` for this data."
            )
        fields = (state["position"], state["done"], state["microbatches"], state["samples"], state["replicas"])
        self._yielded, self._resume = 0, (state["epoch"], _Origin(*fields))
        if self._loop is not None:  # a Fabric loader's next iteration continues this epoch
            self._loop[0] = state["epoch"] - self._loop[1]
            GlobalOrderSampler.set_epoch(self.sampler, state["epoch"])
        else:
            self.sampler.set_epoch(state["epoch"])

    def _loop_epoch(self, epoch: int) -> None:
        """The order's ``set_epoch`` under a Fabric loader, which counts its iterations from 0 in each process."""
        assert self._loop is not None
        self._loop[1] = epoch + 1
        GlobalOrderSampler.set_epoch(self.sampler, self._loop[0] + epoch)


@dataclass(frozen=True)
class TokenBatches:
    """``token_batches=`` of an accumulation strategy: the training loader's micro-batches cut by tokens
    (docs/howto.md, "Micro-batches cut by tokens"). Fields as :class:`TokenBatchSampler`'s; ``samples_per_update``
    (``B``): ``None`` in a Trainer is ``m·A·D`` (a value contradicting it is an error), a Fabric loop must pass it.

    Example:
        >>> TokenBatches(max_tokens=4096, lengths="input_ids").count
        'padded'
    """

    max_tokens: int
    lengths: str | Sequence[int] | Callable[[int], int]
    count: str = "padded"
    max_samples: int | None = None
    long_rows: str = "error"
    samples_per_update: int | Callable[[int, int], int] | None = None

    def __post_init__(self) -> None:
        samples = 1 if self.samples_per_update is None else self.samples_per_update
        _check_options(self.max_tokens, samples, self.count, self.max_samples, self.long_rows)

    def loader(self, loader: Any, replicas: int, rank: int, seed: int, accumulate: int | None) -> DataLoader | None:
        """``loader`` re-created (its dataset, collation, workers) around a :class:`TokenBatchSampler` in
        ``global_order=True``'s order; ``None`` for an unshuffled or iterable one in a Fabric loop (no ``accumulate``).

        Raises:
            TypeError, ValueError: An iterable dataset in a Trainer, an order it cannot read, ``B`` not ``m·A·D``."""
        if accumulate is not None:
            _map_style(getattr(loader, "dataset", None))
        order, sampler = global_order_for(loader, replicas, rank, seed, accumulate is not None), loader.sampler
        shuffled = isinstance(sampler, RandomSampler) or getattr(sampler, "shuffle", False) is True
        if order is None and accumulate is None and not shuffled:
            return None
        if order is None:
            raise ValueError(
                f"`token_batches=` reads a training loader in one seeded order: torch's `BatchSampler` over a"
                f" `DistributedSampler`, `RandomSampler` or `SequentialSampler`; got {type(sampler).__name__} and"
                f" {type(loader.batch_sampler).__name__} on {replicas} replica(s). Pass `DataLoader(data, batch_size=m,"
                " shuffle=True)` (under DDP with `use_distributed_sampler=True`), or a `TokenBatchSampler` yourself."
            )
        o, samples = order, self._samples(int(loader.batch_size), accumulate, order.num_replicas)
        options = (self.count, self.max_samples, self.long_rows, o.num_replicas, o.rank, o.shuffle, o.seed)
        tokens = TokenBatchSampler(loader.dataset, self.lengths, self.max_tokens, samples, *options)
        if accumulate is None:  # a Fabric loader sets the order's epoch from its own count of iterations
            tokens._loop, tokens.sampler.set_epoch = [0, 0], tokens._loop_epoch  # type: ignore[method-assign]
        keep = "num_workers collate_fn pin_memory timeout worker_init_fn multiprocessing_context generator"
        kept = {name: getattr(loader, name) for name in (keep + " prefetch_factor persistent_workers").split()}
        return DataLoader(loader.dataset, batch_sampler=tokens, pin_memory_device=loader.pin_memory_device, **kept)

    def _samples(self, m: int, accumulate: int | None, replicas: int) -> int | Callable[[int, int], int]:
        given, fixed = self.samples_per_update, m * (accumulate or 1) * replicas
        if given is not None and (accumulate is None or given == fixed or (callable(given) and accumulate == 1)):
            return given
        if accumulate is not None and given is None:
            return fixed
        a, fix = f"accumulate_grad_batches {accumulate}", "Drop it, or change the loader's batch_size or A"
        if accumulate is None:
            a, fix = "the loop's A", "Pass it: the strategy cannot see a Fabric loop's A"
        raise ValueError(
            f"`TokenBatches(samples_per_update={given!r})`: B must be the fixed-`m` run's samples per update, the"
            f" loader's batch_size {m} × {a} × {replicas} replica(s){f' = {fixed}' if accumulate else ''}. {fix} (a"
            " function of the position needs accumulate_grad_batches=1)."
        )


def _map_style(dataset: object) -> None:
    if isinstance(dataset, IterableDataset) or not isinstance(dataset, Sized):
        raise TypeError(
            f"`dataset` must be map-style (positions and a length), got {type(dataset).__name__}. Token batches"
            " need each example's length by position: use a map-style dataset (e.g. a `datasets.Dataset`, not a"
            " streamed one), or bucket a stream yourself."
        )


def _check_options(tokens: int, samples: object, count: str, max_samples: int | None, long_rows: str) -> None:
    _positive_int("max_tokens", tokens, 1)
    if max_samples is not None:
        _positive_int("max_samples", max_samples, 1)
    if not callable(samples):
        _positive_int("samples_per_update", samples, 1)
    validate_choice("count", count, COUNTS)
    validate_choice("long_rows", long_rows, LONG_ROWS)


def _not_a_multiple(samples: object, replicas: int, where: str = "") -> ValueError:
    return ValueError(
        f"`samples_per_update` must be a positive multiple of `num_replicas={replicas}`, got {samples!r}{where}."
        " Pass the fixed-`m` run's m·A·D."
    )
