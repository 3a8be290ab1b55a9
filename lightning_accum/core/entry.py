"""The package's checkpoint entry as it is read back, checked before anything is installed.

:func:`validated_state` checks the entry under :data:`CHECKPOINT_KEY` against one table of its fields (:data:`FIELDS`:
where the field is, the form it must have, and that form in words, as the error names it), then against a short list
of rules between fields that a table cannot say (:data:`RULES`); :func:`checked_gradients` checks the carried gradient
against the parameters it is added to, when they are known. Anything wrong is :func:`malformed`'s ``ValueError``,
naming the key, the expected form and what was found. The file itself is read by
:mod:`~lightning_accum.core.reading`. See ``docs/reliability.md``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from lightning_accum.group import CARRIED, COUNT_SPLIT, UNIT_CODES
from lightning_accum.ledger import COUNTERS, SKIP_REASONS, GroupRecord

__all__ = [
    "CHECKPOINT_KEY",
    "DISTRIBUTED_KEY",
    "FIELDS",
    "FORMAT",
    "RULES",
    "Field",
    "checked_distributed_gradients",
    "checked_gradients",
    "malformed",
    "refuse_a_lost_group",
    "refuse_unknown_meaning",
    "validated_state",
]

#: Key of the strategy's state in checkpoints written through the strategy.
CHECKPOINT_KEY = "lightning_accum"
#: The entry's format: 2 since the carried gradient is the replicas' sum whatever the strategy
#: (:mod:`~lightning_accum.strategies.checkpoint`).
FORMAT = 2
#: Key, in a distributed checkpoint's sharded state, of the open group's gradient (name -> shard); the entry then
#: says ``open_group.gradients_stored == "distributed"`` and lists ``open_group.gradient_names``.
DISTRIBUTED_KEY = "lightning_accum_open_group"

_UNITS = tuple(UNIT_CODES)  # the units a run can be weighted by
_LARGEST_COUNT = 2**53  # counts are exact below it in the float64 sums
_SUMS = [slot.name.lower() for slot in CARRIED]  # the carried sums, by name
_COUNT_SUMS = [name for name in _SUMS if name != "weighted_loss"]
_RECORD_FIELDS = {field.name for field in dataclasses.fields(GroupRecord)}  # a closed group's record, as written
#: What entries hold since documents are counted: an entry written before lacks them, and they are read as 0.
_SINCE_DOCUMENTS = {"documents", "dropped_documents", "documents_hi", "documents_lo"}


def malformed(key: str, expected: str, found: Any) -> ValueError:
    """The error for a damaged entry: ``key`` should be ``expected`` but is ``found``, and what to do."""
    shown = repr(found)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return ValueError(
        f"The checkpoint's {CHECKPOINT_KEY!r} entry is damaged: `{key}` should be {expected}, but it is {shown}."
        f" Resume from another checkpoint, or remove the {CHECKPOINT_KEY!r} entry to start the ledger again at 0"
        " (announced when loading)."
    )


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


def _positive(value: Any) -> bool:
    return _count(value) and value > 0


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _float(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is(kind: type | tuple[type, ...]) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, kind)


def _none_or(test: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or test(value)


def _names(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(name, str) for name in value)


def _dict_of(keys: Callable[[Any], bool], values: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, Mapping) and all(keys(k) and values(v) for k, v in value.items())


def _record(value: Any) -> bool:
    return isinstance(value, Mapping) and _RECORD_FIELDS - _SINCE_DOCUMENTS <= set(value) <= _RECORD_FIELDS


def _sums(value: Any) -> bool:
    """The carried sums: finite numbers, but ``Σ w·loss``, which is whatever the losses were."""
    return (
        isinstance(value, Mapping)
        and set(_SUMS) - _SINCE_DOCUMENTS <= set(value) <= set(_SUMS)
        and all((_float if k == "weighted_loss" else _number)(x) for k, x in value.items())
    )


#: A record entry of a stage reached under ``batch_schedule=`` (a Trainer strategy's ``batch_stages``): the keys it
#: always holds, and the one it holds for a batch stated in tokens.
_STAGE_KEYS = {
    "stage",
    "threshold",
    "samples_per_update",
    "accumulate_grad_batches",
    "updates",
    "attempts",
    "samples",
    "tokens",
}
_STAGE_OPTIONAL = {"tokens_per_update"}


def _stage_record(value: Any) -> bool:
    return (
        isinstance(value, Mapping)
        and _STAGE_KEYS <= set(value) <= _STAGE_KEYS | _STAGE_OPTIONAL
        and all(_count(count) for count in value.values())
    )


_WHOLE = "a whole number in [0, 2**53) (a count)"


@dataclass(frozen=True)
class Field:
    """One field of the entry: where it is, the form it must have, and that form in words.

    ``path`` is dotted from the entry's top (``"open_group.sums.units"``); a part ``*`` is every item of the dict or
    list before it (named ``open_group.gradients['name']``, ``slicing.per_rank[0]``). A field inside a dict that is
    absent or ``None`` is not looked at (the row of that dict says whether it may be). ``required``: every entry the
    package writes holds the field where its dict is (a missing one is an error; the others may be absent). ``shown``
    gives what the error says was found.
    """

    path: str
    test: Callable[[Any], bool]
    expected: str
    required: bool = False
    shown: Callable[[Any], Any] = lambda value: value


def _slicing_rows(where: str) -> tuple[Field, ...]:
    """The rows of one record of ``microbatch_size=`` (:meth:`SlicingLog.state_dict
    <lightning_accum.slicing.SlicingLog.state_dict>`): the entry's own, and each rank's."""
    return (
        Field(f"{where}.size", _none_or(_positive), "None or an int >= 1", required=True),
        Field(f"{where}.slice_sizes", _dict_of(_positive, _count), "a dict of size -> int >= 0", required=True),
        Field(f"{where}.retries", _is(list), "a list", required=True),
    )


_NORMALIZE = ("auto", *_UNITS)
#: Every field of the entry, in the order they are checked (a dict before what it holds).
FIELDS: tuple[Field, ...] = (
    Field("ledger", _is(Mapping), "a dict of the ledger's counters", required=True),
    *(Field(f"ledger.{name}", _count, "an int >= 0", required=name not in _SINCE_DOCUMENTS) for name in COUNTERS),
    Field(
        "ledger.updates_skipped",
        lambda v: _dict_of(_is(str), _count)(v) and set(SKIP_REASONS) <= set(v),
        f"a dict of reason -> int >= 0 for each of {SKIP_REASONS}",
        required=True,
    ),
    Field("ledger.normalization", _none_or(lambda v: v in _UNITS), f"None or one of {_UNITS}", required=True),
    Field("ledger.last_group", _none_or(_record), f"None or a dict with {sorted(_RECORD_FIELDS)}", required=True),
    Field("ledger.last_group.loss", _float, "a number (NaN or inf where the group had no weight or a non-finite loss)"),
    *(
        Field(f"ledger.last_group.{name}", _count, "an int >= 0")
        for name in ("tokens", "samples", "microbatches", "documents")
    ),
    Field("ledger.last_group.applied", _is(bool), "True or False"),
    Field("ledger.last_group.dropped", _is(bool), "True or False"),
    Field("ledger.last_group.skip_reason", _none_or(lambda v: v in SKIP_REASONS), f"None or one of {SKIP_REASONS}"),
    Field("ledger.last_group.grad_scale", _none_or(_number), "None or a number"),
    Field("scale_ref", _none_or(lambda v: _number(v) and v > 0), "None or a number > 0", required=True),
    Field("consecutive_skips", _count, "an int >= 0", required=True),
    Field("open_group_microbatches", _count, "an int >= 0", required=True),
    Field("config", _none_or(_is(Mapping)), "a dict", required=True),
    Field("config.strategy", _is(str), "the name of the strategy's class", required=True),
    Field("config.accumulate", _positive, "an int >= 1"),  # absent where no Trainer ran the strategy
    Field("config.replicas", _positive, "an int >= 1", required=True),
    Field("config.normalize", lambda v: v in _NORMALIZE, f"one of {_NORMALIZE}", required=True),
    Field("config.partial_group", lambda v: v in ("rescale", "drop"), "'rescale' or 'drop'", required=True),
    Field("format", lambda v: v == FORMAT, f"{FORMAT} (a later format is written by a later version)"),
    Field("open_group", _none_or(_is(Mapping)), "None or a dict"),
    Field("open_group.microbatches", _count, "an int >= 0", required=True),
    Field("open_group.consistent", _is(bool), "True or False", required=True),
    Field("open_group.carried", _is(bool), "True or False (whether the entry carries the gradient)", required=True),
    Field("open_group.replicas", _positive, "an int >= 1", required=True),
    Field("open_group.accumulate", _positive, "an int >= 1"),
    Field("open_group.total_microbatches", _count, "an int >= 0", required=True),
    Field("open_group.carried_microbatches", _count, "an int >= 0"),  # written since it is checked
    Field("open_group.rerun", lambda v: _count(v) and v <= 1, "0 or 1", required=True),
    Field("open_group.reason", _is(str), "a string (why the group's gradient is not carried)"),
    Field("open_group.scale_ref", _none_or(lambda v: _number(v) and v > 0), "None or a number > 0"),
    Field("open_group.scale_ref_is_tensor", _is(bool), "True or False"),
    Field(
        "open_group.sums",
        _sums,
        f"a dict of finite numbers with keys {_SUMS} (`weighted_loss` may be NaN or inf: a loss may be; the"
        " documents' keys are absent from an entry written before they were counted)",
    ),
    *(
        Field(f"open_group.sums.{name}", lambda v: float(v).is_integer() and 0 <= v < _LARGEST_COUNT, _WHOLE)
        for name in _COUNT_SUMS
    ),
    *(
        Field(f"open_group.sums.{name}", lambda v: v < COUNT_SPLIT, f"below {COUNT_SPLIT} (the low part of a count)")
        for name in ("tokens_lo", "samples_lo", "documents_lo")
    ),
    Field("open_group.gradients_stored", lambda v: v in ("inline", "distributed"), "'inline' or 'distributed'"),
    Field("open_group.gradient_names", _names, "a list of parameter names"),
    Field("open_group.gradients", _dict_of(_is(str), _is(Tensor)), "a dict of parameter name -> tensor"),
    Field(
        "open_group.gradients.*", lambda v: v.is_floating_point(), "a floating-point tensor", shown=lambda v: v.dtype
    ),
    Field("open_group.no_gradient", _names, "a list of parameter names"),
    Field("slicing", _none_or(_is(Mapping)), "a dict"),
    *_slicing_rows("slicing"),
    Field("slicing.per_rank", _is(list), "a list of each rank's record", required=True),
    Field("slicing.per_rank.*", _is(Mapping), "a dict of `size`, `slice_sizes` and `retries` (one rank's record)"),
    *_slicing_rows("slicing.per_rank.*"),
    # Under `batch_schedule=` (absent in entries written before it was saved, and without a schedule).
    Field("batch_stages", _is(list), "a list of the stages reached (a dict each)"),
    Field(
        "batch_stages.*",
        _stage_record,
        f"a dict of ints >= 0 with the keys {sorted(_STAGE_KEYS)} (and optionally {sorted(_STAGE_OPTIONAL)})",
    ),
)
_EXPECTED = {row.path: row.expected for row in FIELDS}
#: The rows of the carried gradient, checked again once a sharded folder's gradient is read.
_GRADIENT_FIELDS = tuple(row for row in FIELDS if row.path.startswith("open_group.gradients"))

Finding = tuple[str, str, Any]  # a rule's finding: the key, what it should be, what it is


def _group(state: Mapping[str, Any]) -> Mapping[str, Any] | None:
    group = state.get("open_group")
    return group if isinstance(group, Mapping) else None


def _carried(state: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The open group where the entry carries its gradient (its sums and ``c`` are there: see the rules above)."""
    group = _group(state)
    return group if group is not None and group["carried"] else None


def _updates_add_up(state: Mapping[str, Any]) -> Finding | None:
    """An attempted update is applied or skipped, never both."""
    ledger = state["ledger"]
    attempted, applied = ledger["updates_attempted"], ledger["updates_applied"]
    skipped = sum(ledger["updates_skipped"].values())
    if applied + skipped <= attempted:
        return None
    return "ledger.updates_attempted", f"at least the applied and skipped updates ({applied} + {skipped})", attempted


def _open_group_present(state: Mapping[str, Any]) -> Finding | None:
    """The entry's count of the open group's micro-batches and the group itself agree that one was open."""
    count = state["open_group_microbatches"]
    if not count or state.get("open_group"):
        return None
    expected = f"the group open at the checkpoint (`open_group_microbatches` is {count})"
    return "open_group", expected, state.get("open_group", "missing")


def _group_count_agrees(state: Mapping[str, Any]) -> Finding | None:
    group, written = _group(state), state["open_group_microbatches"]
    if group is None or group["microbatches"] == written:
        return None
    return "open_group.microbatches", f"{written} (as `open_group_microbatches` says)", group["microbatches"]


def _total_adds_up(state: Mapping[str, Any]) -> Finding | None:
    """The group's micro-batches over all replicas are this run's on each replica, plus those carried into the group
    from an earlier checkpoint (recorded as ``carried_microbatches`` since it is checked)."""
    group = _group(state)
    if group is None:
        return None
    per_replica, replicas, total = group["microbatches"], group["replicas"], group["total_microbatches"]
    own = per_replica * replicas
    if total < max(1, own):
        expected = (
            f"at least {max(1, own)} (the group holds {per_replica} micro-batch(es) on each of {replicas} replica(s),"
            " and a group is written only once it holds one)"
        )
        return "open_group.total_microbatches", expected, total
    carried_in = group.get("carried_microbatches")
    if carried_in is None or total == carried_in + own:
        return None
    expected = (
        f"{carried_in + own} (`open_group.carried_microbatches` {carried_in}, carried into the group from an earlier"
        f" checkpoint, + {per_replica} micro-batch(es) on each of {replicas} replica(s))"
    )
    return "open_group.total_microbatches", expected, total


def _gradient_where_carried(state: Mapping[str, Any]) -> Finding | None:
    """A group that says it carries its gradient holds it (inline, or named for the distributed checkpoint), with its
    counters, its ``c`` and the parameters without a gradient; one that does not carry it says why."""
    group = _group(state)
    if group is None:
        return None
    distributed = group.get("gradients_stored") == "distributed"
    if not group["carried"]:
        if "gradients" in group or distributed:
            return "open_group.carried", "True (the entry holds the group's gradient)", False
        if "reason" not in group:
            return "open_group.reason", _EXPECTED["open_group.reason"] + " (`open_group.carried` is False)", "missing"
        return None
    needed = ["gradient_names" if distributed else "gradients", "sums", "scale_ref", "no_gradient"]
    for key in needed:
        if key not in group:
            expected = f"{_EXPECTED[f'open_group.{key}']}: the group's (`open_group.carried` is True)"
            return f"open_group.{key}", expected, "missing"
    return None


def _scale_where_weighted(state: Mapping[str, Any]) -> Finding | None:
    """On one replica a group whose micro-batches have a weight has its ``c`` (the first loss of the group formed it):
    without it the resumed run would form another and mis-weigh the carried gradient."""
    group = _carried(state)
    if group is None or group["replicas"] != 1 or group["scale_ref"] is not None:
        return None
    units = group["sums"]["units"]
    if not units:
        return None
    return "open_group.scale_ref", f"a number > 0 (the group's c: its micro-batches have a weight of {units:g})", None


def _no_negative_count(state: Mapping[str, Any]) -> Finding | None:
    group = _carried(state)
    if group is None or not group["sums"]["negative"]:
        return None
    expected = (
        "0 (a micro-batch of the open group reported a negative count before the checkpoint; such a group stops at"
        " its close and cannot be resumed)"
    )
    return "open_group.sums.negative", expected, group["sums"]["negative"]


def _units_are_the_unit(state: Mapping[str, Any]) -> Finding | None:
    """Under token (sample, document) weighting a group's weight is its tokens (samples, documents)."""
    group, unit = _carried(state), state["ledger"]["normalization"]
    if group is None or unit not in ("tokens", "samples", "documents"):
        return None
    sums = group["sums"]
    count = sums.get(f"{unit}_hi", 0) * COUNT_SPLIT + sums.get(f"{unit}_lo", 0)
    if sums["units"] == count:
        return None
    return (
        "open_group.sums.units",
        f"{count:g} (the group's {unit}: the run weighs micro-batches by them)",
        sums["units"],
    )


#: The rules between fields, in the order they are checked (after every field has its form).
RULES: tuple[Callable[[Mapping[str, Any]], Finding | None], ...] = (
    _updates_add_up,
    _open_group_present,
    _group_count_agrees,
    _total_adds_up,
    _gradient_where_carried,
    _scale_where_weighted,
    _no_negative_count,
    _units_are_the_unit,
)


_MISSING = object()  # a key the dict that should hold it does not hold


def _places(holder: Any, parts: list[str], named: str = "") -> Iterator[tuple[str, Any]]:
    """Every place of the field ``parts`` (a row's path, split) under ``holder``: the key as the error names it, and
    the value there (:data:`_MISSING` where its dict lacks it). Nothing inside a value that is not a dict."""
    part, rest = parts[0], parts[1:]
    if part == "*":
        items = holder.items() if isinstance(holder, Mapping) else enumerate(holder) if isinstance(holder, list) else ()
        found = [(f"{named}[{key!r}]", value) for key, value in items]
    elif isinstance(holder, Mapping):
        found = [(f"{named}.{part}" if named else part, holder.get(part, _MISSING))]
    else:
        return
    for name, value in found:
        if not rest:
            yield name, value
        elif value is not _MISSING:
            yield from _places(value, rest, name)


def _check_fields(state: Mapping[str, Any], fields: tuple[Field, ...]) -> None:
    """The one check of the table: every field present where required, and of its form."""
    for row in fields:
        for key, value in _places(state, row.path.split(".")):
            if value is _MISSING:
                if row.required:
                    raise malformed(key, row.expected, "missing")
            elif not row.test(value):
                raise malformed(key, row.expected, row.shown(value))


def validated_state(state: Any) -> dict[str, Any]:
    """The package's checkpoint entry after checking every field (:data:`FIELDS`) and every rule between fields
    (:data:`RULES`): a ``ValueError`` naming the key, the expected form and what was found, never a silent change."""
    if not isinstance(state, Mapping):
        raise malformed(CHECKPOINT_KEY, "a dict", state)
    _check_fields(state, FIELDS)
    for rule in RULES:
        finding = rule(state)
        if finding is not None:
            raise malformed(*finding)
    return dict(state)


def checked_distributed_gradients(group: Mapping[str, Any]) -> None:
    """The carried gradient read from a sharded folder's shards, checked by the table's rows of the gradient."""
    _check_fields({"open_group": group}, _GRADIENT_FIELDS)


def checked_gradients(group: Mapping[str, Any], parameters: list[tuple[str, Tensor]]) -> dict[str, Tensor]:
    """The carried gradient, checked against the parameters it is added to (names, shapes, completeness; a group of
    no weight carries no gradient)."""
    gradients: dict[str, Tensor] = dict(group["gradients"])
    if not group["sums"]["units"]:
        for name, gradient in gradients.items():
            if bool(gradient.ne(0).any()):
                raise malformed(
                    f"open_group.gradients[{name!r}]",
                    "zero (`open_group.sums.units` is 0: no micro-batch of the group had a weight)",
                    "a tensor with non-zero values",
                )
    shapes = {name: tuple(p.shape) for name, p in parameters}
    for name, gradient in gradients.items():
        if name not in shapes:
            raise malformed(
                f"open_group.gradients[{name!r}]", f"the gradient of one of the parameters {sorted(shapes)}", name
            )
        if tuple(gradient.shape) != shapes[name]:
            raise malformed(f"open_group.gradients[{name!r}]", f"a tensor of shape {shapes[name]}", gradient.shape)
    known = set(gradients) | set(group.get("no_gradient", []))  # every parameter is carried or listed as unused
    for name in shapes:
        if name not in known:
            raise malformed(
                f"open_group.gradients[{name!r}]",
                "a tensor (the parameter is neither carried nor listed in `open_group.no_gradient`)",
                "missing",
            )
    return gradients


def refuse_unknown_meaning(state: Mapping[str, Any], group: Mapping[str, Any], path: str) -> None:
    """An entry written before format 2 inside a group of several replicas carries either their gradients' sum
    (DDP) or their average (FSDP2), without saying which: refused, with what to do."""
    carries = "gradients" in group or group.get("gradients_stored") == "distributed"
    replicas = int(group.get("replicas", 1))
    if "format" in state or not carries or replicas == 1:
        return
    raise ValueError(
        f"The checkpoint {path!r} was written inside an accumulation group on {replicas} replicas by an earlier"
        f" version of lightning_accum, whose entry does not say whether the carried gradient is the replicas' sum"
        f" (strategy 'accum_ddp') or their average ('accum_fsdp'): `{CHECKPOINT_KEY}.format` is missing. Resume from a"
        " checkpoint written at an update boundary; or, knowing the strategy that wrote it, set"
        f" `checkpoint[{CHECKPOINT_KEY!r}]['format'] = {FORMAT}` (after multiplying each tensor of"
        f" `open_group.gradients` by {replicas} if it was 'accum_fsdp' or 'accum_model_parallel') and save it again."
    )


def refuse_a_lost_group(written: Mapping[str, Any], now: Mapping[str, Any], position: int) -> None:
    """The entry says no group was open, yet Lightning's loop state resumes inside one under the configuration the
    checkpoint was written under: the group's first micro-batches would be silently missing from its update."""
    if any(key not in written or written[key] != now[key] for key in ("accumulate", "replicas")):
        return  # another A or D: the resumed run's first group is shorter (announced), nothing is lost
    raise malformed(
        "open_group",
        f"the group open at the checkpoint (Lightning's loop state in the same checkpoint resumes the run at"
        f" micro-batch {position + 1} of a group of {now['accumulate']}, the configuration it was written under)",
        None,
    )
