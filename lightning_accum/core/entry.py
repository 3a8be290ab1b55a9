"""The package's checkpoint entry as read back: one schema (:data:`FIELDS`, :data:`RULES`) and one error
(:func:`malformed`); docs/reliability.md describes the entry.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_accum.group import CARRIED, COUNT_SPLIT, UNIT_CODES
from lightning_accum.ledger import SKIP_REASONS, AccumulationLedger, GroupRecord

__all__ = [
    "CHECKPOINT_KEY",
    "DISTRIBUTED_KEY",
    "FIELDS",
    "FORMAT",
    "RULES",
    "Form",
    "check_gradient",
    "checked_distributed_gradients",
    "checked_gradients",
    "malformed",
    "refuse_a_lost_group",
    "refuse_unknown_meaning",
    "validated_state",
]

#: Key of the strategy's state in checkpoints written through the strategy.
CHECKPOINT_KEY = "lightning_accum"
#: The entry's format: 2 since the carried gradient is the replicas' sum whatever the strategy.
FORMAT = 2
#: Key, in a distributed checkpoint's sharded state, of the open group's gradient (name -> shard).
DISTRIBUTED_KEY = "lightning_accum_open_group"


def malformed(key: str, expected: str, found: Any) -> ValueError:
    """The error for a damaged entry: ``key`` should be ``expected`` but is ``found``."""
    shown = repr(found)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return ValueError(
        f"The checkpoint's {CHECKPOINT_KEY!r} entry is damaged: `{key}` should be {expected}, but it is {shown}."
        f" Resume from another checkpoint, or remove the {CHECKPOINT_KEY!r} entry to start the ledger again at 0"
        " (announced when loading)."
    )


@dataclass(frozen=True)
class Form:
    """A field's form: ``words`` (as the error says it), its ``test``, and ``shown``, what the error shows of it."""

    words: str
    test: Callable[[Any], bool]
    shown: Callable[[Any], Any] = lambda value: value

    def said(self, words: str) -> Form:
        return dataclasses.replace(self, words=words)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


def _number(value: Any, finite: bool = True) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and (not finite or math.isfinite(value))


def _is(kind: type | tuple[type, ...], words: str) -> Form:
    return Form(words, lambda value: isinstance(value, kind))


def _maybe(form: Form) -> Form:
    return Form(f"None or {form.words}", lambda value: value is None or form.test(value))


def _among(values: tuple[Any, ...], words: str = "") -> Form:
    return Form(words or f"one of {values}", lambda value: value in values)


def _dict_of(keys: Callable[[Any], bool], values: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, Mapping) and all(keys(key) and values(value) for key, value in v.items())


def _keyed(
    required: set[str], allowed: set[str], values: Callable[[Any], bool] = lambda value: True
) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, Mapping) and required <= set(v) <= allowed and all(map(values, v.values()))


_UNITS = tuple(UNIT_CODES)
_SUMS = [slot.name.lower() for slot in CARRIED]
_RECORD = {field.name for field in dataclasses.fields(GroupRecord)}  # a closed group's record, as written
#: What entries hold since documents are counted: an entry written before lacks them, and they are read as 0.
_SINCE_DOCUMENTS = {"documents", "dropped_documents", "documents_hi", "documents_lo"}
_STAGE = {
    *("stage", "threshold", "samples_per_update", "accumulate_grad_batches"),
    *("updates", "attempts", "samples", "tokens"),
}
COUNT = Form("an int >= 0", _count)
POSITIVE = Form("an int >= 1", lambda v: _count(v) and v > 0)
FLAG = _is(bool, "True or False")
DICT = _is(Mapping, "a dict")
NAMES = Form("a list of parameter names", lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v))
_SCALE = _maybe(Form("a number > 0", lambda v: _number(v) and v > 0))
_WHOLE = Form("a whole number in [0, 2**53) (a count)", lambda v: float(v).is_integer() and 0 <= v < 2**53)
_LOW = Form(f"below {COUNT_SPLIT} (the low part of a count)", lambda v: v < COUNT_SPLIT)
#: The form of a dataclass field written as its type (``int``: a count), where the schema does not say another.
_OF_TYPE = {"int": COUNT, "bool": FLAG, "float | None": _maybe(Form("a number", _number))}


def _typed(where: str, kind: type, optional: set[str], **forms: Form) -> dict[str, Form]:
    """The rows of a dataclass's fields under ``where``, each its type's form unless ``forms`` says another."""
    fields = dataclasses.fields(kind)
    return {f"{where}.{f.name}{'?' * (f.name in optional)}": forms.get(f.name) or _OF_TYPE[str(f.type)] for f in fields}


_RANK = {  # one record of `microbatch_size=` (`SlicingLog.state_dict`)
    "size": _maybe(POSITIVE),
    "slice_sizes": Form("a dict of size -> int >= 0", _dict_of(POSITIVE.test, _count)),
    "retries": _is(list, "a list"),
}

#: The entry's schema: each field's path (dotted from the entry's top; ``*`` is every item of the dict or list before
#: it) and :class:`Form` (or forms, checked in turn), in the order they are checked (a dict before what it holds). A
#: path ending in ``?`` may be absent; every other field is written by every entry that holds its dict. A field inside
#: a dict that is absent or ``None`` is not looked at.
FIELDS: dict[str, Form | tuple[Form, ...]] = {
    "ledger": DICT.said("a dict of the ledger's counters"),
    **_typed(
        "ledger",
        AccumulationLedger,
        _SINCE_DOCUMENTS,
        updates_skipped=Form(
            f"a dict of reason -> int >= 0 for each of {SKIP_REASONS}",
            lambda v: _dict_of(lambda key: isinstance(key, str), _count)(v) and set(SKIP_REASONS) <= set(v),
        ),
        normalization=_maybe(_among(_UNITS)),
        last_group=_maybe(Form(f"a dict with {sorted(_RECORD)}", _keyed(_RECORD - _SINCE_DOCUMENTS, _RECORD))),
    ),
    **_typed(
        "ledger.last_group",
        GroupRecord,
        _RECORD,  # its keys are checked as a whole above
        loss=Form(
            "a number (NaN or inf where the group had no weight or a non-finite loss)",
            lambda v: _number(v, finite=False),
        ),
        skip_reason=_maybe(_among(SKIP_REASONS)),
    ),
    "scale_ref": _SCALE,
    "consecutive_skips": COUNT,
    "open_group_microbatches": COUNT,
    "config": _maybe(DICT),
    "config.strategy": _is(str, "the name of the strategy's class"),
    "config.accumulate?": POSITIVE,  # absent where no Trainer ran the strategy
    "config.replicas": POSITIVE,
    "config.normalize": _among(("auto", *_UNITS)),
    "config.partial_group": _among(("rescale", "drop"), "'rescale' or 'drop'"),
    "format?": Form(f"{FORMAT} (a later format is written by a later version)", lambda v: v == FORMAT),
    "open_group?": _maybe(DICT),
    "open_group.microbatches": COUNT,
    "open_group.consistent": FLAG,
    "open_group.carried": FLAG.said("True or False (whether the entry carries the gradient)"),
    "open_group.replicas": POSITIVE,
    "open_group.accumulate?": POSITIVE,
    "open_group.total_microbatches": COUNT,
    "open_group.carried_microbatches?": COUNT,  # written since it is checked
    "open_group.rerun": Form("0 or 1", lambda v: _count(v) and v <= 1),
    "open_group.reason?": _is(str, "a string (why the group's gradient is not carried)"),
    "open_group.scale_ref?": _SCALE,
    "open_group.scale_ref_is_tensor?": FLAG,
    "open_group.sums?": Form(
        f"a dict of finite numbers with keys {_SUMS} (`weighted_loss` may be NaN or inf: a loss may be; the"
        " documents' keys are absent from an entry written before they were counted)",
        lambda v: (
            _keyed(set(_SUMS) - _SINCE_DOCUMENTS, set(_SUMS))(v)
            and all(_number(x, k != "weighted_loss") for k, x in v.items())
        ),
    ),
    **{f"open_group.sums.{name}?": _WHOLE for name in _SUMS if name != "weighted_loss"},
    **{f"open_group.sums.{kind}_lo?": (_WHOLE, _LOW) for kind in ("tokens", "samples", "documents")},
    "open_group.gradients_stored?": _among(("inline", "distributed"), "'inline' or 'distributed'"),
    "open_group.gradient_names?": NAMES,
    "open_group.gradients?": Form(
        "a dict of parameter name -> tensor",
        _dict_of(lambda key: isinstance(key, str), lambda value: isinstance(value, Tensor)),
    ),
    "open_group.no_gradient?": NAMES,
    "slicing?": _maybe(DICT),
    **{f"slicing.{name}": form for name, form in _RANK.items()},
    "slicing.per_rank": _is(list, "a list of each rank's record"),
    "slicing.per_rank.*": DICT.said("a dict of `size`, `slice_sizes` and `retries` (one rank's record)"),
    **{f"slicing.per_rank.*.{name}": form for name, form in _RANK.items()},
    # Under `batch_schedule=` (absent in entries written before it was saved, and without a schedule).
    "batch_stages?": _is(list, "a list of the stages reached (a dict each)"),
    "batch_stages.*": Form(
        f"a dict of ints >= 0 with the keys {sorted(_STAGE)} (and optionally ['tokens_per_update'])",
        _keyed(_STAGE, _STAGE | {"tokens_per_update"}, _count),
    ),
}
_WORDS = {path.rstrip("?"): form.words for path, form in FIELDS.items() if isinstance(form, Form)}

Finding = tuple[str, str, Any]  # a rule's finding: the key, what it should be, what it is
_MISSING = object()  # a key the dict that should hold it does not hold


def _places(holder: Any, parts: list[str], named: str = "") -> Iterator[tuple[str, Any]]:
    """Every place of the field ``parts`` under ``holder``: the key as the error names it, and the value there."""
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


def _check_fields(state: Mapping[str, Any], fields: Mapping[str, Form | tuple[Form, ...]]) -> None:
    for path, forms in fields.items():
        for form in forms if isinstance(forms, tuple) else (forms,):
            for key, value in _places(state, path.rstrip("?").split(".")):
                if value is _MISSING:
                    if not path.endswith("?"):
                        raise malformed(key, form.words, "missing")
                elif not form.test(value):
                    raise malformed(key, form.words, form.shown(value))


# ---------------------------------------------------------------------------- the rules between fields


def _group(state: Mapping[str, Any], carried: bool = False) -> Mapping[str, Any] | None:
    group = state.get("open_group")
    return group if isinstance(group, Mapping) and (group["carried"] or not carried) else None


def _updates_add_up(state: Mapping[str, Any]) -> Finding | None:
    ledger = state["ledger"]
    attempted, applied = ledger["updates_attempted"], ledger["updates_applied"]
    skipped = sum(ledger["updates_skipped"].values())
    if applied + skipped <= attempted:
        return None
    return "ledger.updates_attempted", f"at least the applied and skipped updates ({applied} + {skipped})", attempted


def _open_group_agrees(state: Mapping[str, Any]) -> Finding | None:
    count, group = state["open_group_microbatches"], _group(state)
    if count and not state.get("open_group"):
        expected = f"the group open at the checkpoint (`open_group_microbatches` is {count})"
        return "open_group", expected, state.get("open_group", "missing")
    if group is None or group["microbatches"] == count:
        return None
    return "open_group.microbatches", f"{count} (as `open_group_microbatches` says)", group["microbatches"]


def _total_adds_up(state: Mapping[str, Any]) -> Finding | None:
    group = _group(state)
    if group is None:
        return None
    per_replica, replicas, total = group["microbatches"], group["replicas"], group["total_microbatches"]
    own, carried_in = per_replica * replicas, group.get("carried_microbatches")
    if total < max(1, own):
        expected = (
            f"at least {max(1, own)} (the group holds {per_replica} micro-batch(es) on each of {replicas} replica(s),"
            " and a group is written only once it holds one)"
        )
        return "open_group.total_microbatches", expected, total
    if carried_in is None or total == carried_in + own:
        return None
    expected = (
        f"{carried_in + own} (`open_group.carried_microbatches` {carried_in}, carried into the group from an earlier"
        f" checkpoint, + {per_replica} micro-batch(es) on each of {replicas} replica(s))"
    )
    return "open_group.total_microbatches", expected, total


def _gradient_where_carried(state: Mapping[str, Any]) -> Finding | None:
    group = _group(state)
    if group is None:
        return None
    distributed = group.get("gradients_stored") == "distributed"
    if not group["carried"]:
        if "gradients" in group or distributed:
            return "open_group.carried", "True (the entry holds the group's gradient)", False
        reason = "open_group.reason"
        return None if "reason" in group else (reason, f"{_WORDS[reason]} (`open_group.carried` is False)", "missing")
    for key in ("gradient_names" if distributed else "gradients", "sums", "scale_ref", "no_gradient"):
        if key not in group:
            expected = f"{_WORDS[f'open_group.{key}']}: the group's (`open_group.carried` is True)"
            return f"open_group.{key}", expected, "missing"
    return None


def _carried_sums_hold(state: Mapping[str, Any]) -> Finding | None:
    group, unit = _group(state, carried=True), state["ledger"]["normalization"]
    if group is None:
        return None
    sums = group["sums"]
    if group["replicas"] == 1 and group["scale_ref"] is None and sums["units"]:
        weight = f"a number > 0 (the group's c: its micro-batches have a weight of {sums['units']:g})"
        return "open_group.scale_ref", weight, None
    if sums["negative"]:
        expected = (
            "0 (a micro-batch of the open group reported a negative count before the checkpoint; such a group stops at"
            " its close and cannot be resumed)"
        )
        return "open_group.sums.negative", expected, sums["negative"]
    if unit not in ("tokens", "samples", "documents"):
        return None
    count = sums.get(f"{unit}_hi", 0) * COUNT_SPLIT + sums.get(f"{unit}_lo", 0)
    expected = f"{count:g} (the group's {unit}: the run weighs micro-batches by them)"
    return None if sums["units"] == count else ("open_group.sums.units", expected, sums["units"])


#: The rules between fields, in the order they are checked (after every field has its form).
RULES: tuple[Callable[[Mapping[str, Any]], Finding | None], ...] = (
    _updates_add_up,
    _open_group_agrees,
    _total_adds_up,
    _gradient_where_carried,
    _carried_sums_hold,
)


def validated_state(state: Any) -> dict[str, Any]:
    """The package's checkpoint entry after checking every field (:data:`FIELDS`) and rule (:data:`RULES`).

    Raises:
        ValueError: :func:`malformed`'s, naming the first damaged key.
    """
    if not isinstance(state, Mapping):
        raise malformed(CHECKPOINT_KEY, "a dict", state)
    _check_fields(state, FIELDS)
    for rule in RULES:
        finding = rule(state)
        if finding is not None:
            raise malformed(*finding)
    return dict(state)


def checked_distributed_gradients(group: Mapping[str, Any]) -> None:
    _check_fields({"open_group": group}, {p: f for p, f in FIELDS.items() if p.startswith("open_group.gradients")})


def check_gradient(name: str, shape: Sequence[int], dtype: torch.dtype, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """One carried gradient's name, ``shape`` and ``dtype`` against the parameters' ``shapes``."""
    key = f"open_group.gradients[{name!r}]"
    if name not in shapes:
        raise malformed(key, f"the gradient of one of the parameters {sorted(shapes)}", name)
    if tuple(shape) != shapes[name]:
        raise malformed(key, f"a tensor of shape {shapes[name]}", shape)
    if not dtype.is_floating_point:
        raise malformed(key, "a floating-point tensor", dtype)


def checked_gradients(group: Mapping[str, Any], parameters: list[tuple[str, Tensor]]) -> dict[str, Tensor]:
    """The carried gradient, checked against the parameters it is added to; raises :func:`malformed`'s."""
    gradients: dict[str, Tensor] = dict(group["gradients"])
    shapes = {name: tuple(p.shape) for name, p in parameters}
    known = set(gradients) | set(group.get("no_gradient", []))  # every parameter is carried or listed as unused
    for name, gradient in gradients.items():
        if not group["sums"]["units"] and bool(gradient.ne(0).any()):
            expected = "zero (`open_group.sums.units` is 0: no micro-batch of the group had a weight)"
            raise malformed(f"open_group.gradients[{name!r}]", expected, "a tensor with non-zero values")
        check_gradient(name, gradient.shape, gradient.dtype, shapes)
    for name in [name for name in shapes if name not in known]:
        expected = "a tensor (the parameter is neither carried nor listed in `open_group.no_gradient`)"
        raise malformed(f"open_group.gradients[{name!r}]", expected, "missing")
    return gradients


def refuse_unknown_meaning(state: Mapping[str, Any], group: Mapping[str, Any], path: str) -> None:
    """Refuse an entry before format 2 carrying a group of several replicas (a sum or an average, it does not say)."""
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
    """Refuse an entry without open group where Lightning's loop resumes inside one under the same configuration."""
    if any(key not in written or written[key] != now[key] for key in ("accumulate", "replicas")):
        return  # another A or D: the resumed run's first group is shorter (announced), nothing is lost
    raise malformed(
        "open_group",
        f"the group open at the checkpoint (Lightning's loop state in the same checkpoint resumes the run at"
        f" micro-batch {position + 1} of a group of {now['accumulate']}, the configuration it was written under)",
        None,
    )
