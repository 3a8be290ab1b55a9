"""core/entry: the checkpoint's entry as one schema and one message: every damaged key, broken rule and entry of unknown
meaning is a ValueError naming the key, the expected form and what was found, before anything is trained."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import _resume, _written_at, params_vector
from torch import Tensor

from lightning_accum import AccumulationStrategy


def _damage(state: dict[str, Any], how: str) -> None:
    group = state["lightning_accum"].get("open_group") or {}
    if how == "no entry":
        del state["lightning_accum"]
    elif how == "unit":
        state["lightning_accum"]["ledger"]["normalization"] = "words"
    elif how == "ledger":
        state["lightning_accum"]["ledger"] = None
    elif how == "scale_ref":
        state["lightning_accum"]["scale_ref"] = 0.0
    elif how == "sums":
        del group["sums"]["units"]
    elif how == "microbatches":
        group["microbatches"] = "2"
    elif how == "gradient":
        del group["gradients"]["head.bias"]
    elif how == "shape":
        group["gradients"]["head.bias"] = torch.zeros(3)
    elif how == "open group None":
        state["lightning_accum"]["open_group"] = None
    elif how == "open group count":
        group["microbatches"] = 1
    elif how == "total 0":
        group["total_microbatches"] = 0
    elif how == "units 0":
        group["sums"]["units"] = 0.0
    elif how == "negative tokens":
        group["sums"]["tokens_lo"] = -3.0
    elif how == "huge samples":
        group["sums"]["samples_hi"] = 1e300
    elif how == "negative":
        group["sums"]["negative"] = 1.0
    elif how == "int64":
        group["gradients"]["head.bias"] = group["gradients"]["head.bias"].long()
    elif how == "applied":
        ledger = state["lightning_accum"]["ledger"]
        ledger["updates_applied"] = ledger["updates_attempted"] + 1
    elif how == "format":
        state["lightning_accum"]["format"] = 3
    elif how == "legacy":  # as written before format 2 on 2 replicas (the gradient's meaning unknown)
        del state["lightning_accum"]["format"]
        group.update(replicas=2, total_microbatches=4)


@pytest.mark.parametrize(
    ("how", "message"),
    [
        (
            "unit",
            r"`ledger.normalization` should be None or one of \('tokens', 'samples', 'batches',"
            r" 'documents'\), but it is 'words'",
        ),
        ("ledger", r"`ledger` should be a dict of the ledger's counters, but it is None"),
        ("scale_ref", r"`scale_ref` should be None or a number > 0, but it is 0.0"),
        ("sums", r"`open_group.sums` should be a dict of finite numbers with keys \['units'"),
        ("microbatches", r"`open_group.microbatches` should be an int >= 0, but it is '2'"),
        ("gradient", r"`open_group.gradients\['head.bias'\]` should be a tensor .*, but it is 'missing'"),
        ("shape", r"`open_group.gradients\['head.bias'\]` should be a tensor of shape \(11,\), but it is torch.Size"),
        (
            "open group None",
            r"`open_group` should be the group open at the checkpoint \(`open_group_microbatches` is 2",
        ),
        (
            "open group count",
            r"`open_group.microbatches` should be 2 \(as `open_group_microbatches` says\), but it is 1",
        ),
        ("total 0", r"`open_group.total_microbatches` should be at least 2 .*, but it is 0"),
        ("units 0", r"`open_group.sums.units` should be \d+ \(the group's tokens: .*, but it is 0.0"),
        (
            "negative tokens",
            r"`open_group.sums.tokens_lo` should be a whole number in \[0, 2\*\*53\) .*, but it is -3.0",
        ),
        (
            "huge samples",
            r"`open_group.sums.samples_hi` should be a whole number in \[0, 2\*\*53\) .*, but it is 1e\+300",
        ),
        ("negative", r"`open_group.sums.negative` should be 0 \(a micro-batch of the open group reported a negative"),
        ("int64", r"`open_group.gradients\['head.bias'\]` should be a floating-point tensor, but it is torch.int64"),
        (
            "applied",
            r"`ledger.updates_attempted` should be at least the applied and skipped updates \(2 \+ 0\), but it is 1",
        ),
        ("format", r"`format` should be 2 \(a later format is written by a later version\), but it is 3"),
    ],
)
def test_a_damaged_entry_is_an_error_naming_the_key(tmp_path: Path, how: str, message: str) -> None:
    ckpt = _written_at(tmp_path, 4)
    state = torch.load(ckpt, weights_only=True)
    _damage(state, how)
    torch.save(state, ckpt)
    with pytest.raises(ValueError, match=r"The checkpoint's 'lightning_accum' entry is damaged: " + message):
        _resume(ckpt, "accum", 3)


def test_an_open_group_removed_with_its_count_is_told_by_lightnings_loop_state(tmp_path: Path) -> None:
    # The entry's own two records of the open group removed together: the loop state Lightning wrote in the same file
    # resumes the run at micro-batch 3 of a group of 3 under the configuration it was written under. Resumed as at an
    # update boundary before, the group's first 2 micro-batches were silently missing from its update.
    ckpt = _written_at(tmp_path, 4)
    state = torch.load(ckpt, weights_only=True)
    del state["lightning_accum"]["open_group"]
    state["lightning_accum"]["open_group_microbatches"] = 0
    torch.save(state, ckpt)
    with pytest.raises(ValueError, match=r"`open_group` should be the group open at the checkpoint \(Lightning's loop"):
        _resume(ckpt, "accum", 3)
    # Under another A the resumed run's first group is only shorter (announced), as after a boundary checkpoint.
    trainer, _, _ = _resume(ckpt, "accum", 2)
    assert trainer.strategy.ledger.updates_applied == 1 + 1 + 1  # (0-2 before) + the short group (5) + 6, 7


def test_an_entry_of_unknown_meaning_is_refused_with_what_to_do(tmp_path: Path) -> None:
    # Before format 2, an open group written on several replicas held their gradients' sum (DDP) or their average
    # (FSDP2) without saying which: resumed under another engine it was weighted x2 or x1/2, announced as exact.
    ckpt = _written_at(tmp_path, 4)
    state = torch.load(ckpt, weights_only=True)
    _damage(state, "legacy")
    torch.save(state, ckpt)
    with pytest.raises(ValueError, match=r"written inside an accumulation group on 2 replicas by an earlier version"):
        _resume(ckpt, "accum", 3)
    # The way out the message gives: say which it was (DDP's sum) and save it again.
    state["lightning_accum"]["format"] = 2
    group = state["lightning_accum"]["open_group"]
    group.update(replicas=1, total_microbatches=2)
    torch.save(state, ckpt)
    trainer, _, _ = _resume(ckpt, "accum", 3)
    assert trainer.strategy.ledger.microbatches == 3 + 3 + 2


def test_a_group_that_says_it_carried_its_gradient_but_holds_none_is_an_error(tmp_path: Path) -> None:
    # `carried: True` without `gradients`: read before as a group that could not be carried, its first micro-batches
    # were lost with a warning and the run trained on, off the uninterrupted run.
    ckpt = _written_at(tmp_path, 4)
    state = torch.load(ckpt, weights_only=True)
    assert state["lightning_accum"]["open_group"]["carried"] is True
    del state["lightning_accum"]["open_group"]["gradients"]
    torch.save(state, ckpt)
    with pytest.raises(
        ValueError,
        match=r"`open_group.gradients` should be a dict of parameter name -> tensor: the group's \(`open_group.carried`"
        r" is True\), but it is 'missing'",
    ):
        _resume(ckpt, "accum", 3)


def test_a_total_of_micro_batches_that_contradicts_the_counters_is_an_error(tmp_path: Path) -> None:
    # The total over all replicas is the run's micro-batches on each replica plus those carried in from an earlier
    # checkpoint (recorded). Read before as it was, the ledger counted the extra micro-batches (13 instead of 8).
    ckpt = _written_at(tmp_path, 4)
    state = torch.load(ckpt, weights_only=True)
    group = state["lightning_accum"]["open_group"]
    assert (group["microbatches"], group["replicas"], group["carried_microbatches"]) == (2, 1, 0)
    group["total_microbatches"] = 7
    torch.save(state, ckpt)
    with pytest.raises(
        ValueError,
        match=r"`open_group.total_microbatches` should be 2 \(`open_group.carried_microbatches` 0, carried into the"
        r" group from an earlier checkpoint, \+ 2 micro-batch\(es\) on each of 1 replica\(s\)\), but it is 7",
    ):
        _resume(ckpt, "accum", 3)


# ---------------------------------------------------------------------------- every damage to a real entry

_DELETE = object()  # the key is removed
_KINDS = ["delete", "none", "wrong type", "negative", "out of range", "inconsistent"]
#: Relations between fields, each broken by one damage: (key path, the damage, the keys an error may name; none:
#: harmless, the resumed run is the undamaged resume).
_INCONSISTENT: list[tuple[tuple[Any, ...], Callable[[Any], Any], tuple[str, ...]]] = [
    (("open_group", "microbatches"), lambda v: v + 1, ("open_group.microbatches",)),
    (("open_group_microbatches",), lambda v: v + 1, ("open_group.microbatches",)),
    (("open_group_microbatches",), lambda v: 0, ("open_group.microbatches",)),
    (("open_group", "total_microbatches"), lambda v: v + 5, ("open_group.total_microbatches",)),
    (("open_group", "total_microbatches"), lambda v: v - 1, ("open_group.total_microbatches",)),
    (("open_group", "carried_microbatches"), lambda v: v + 1, ("open_group.total_microbatches",)),
    (("open_group", "replicas"), lambda v: 2, ("open_group.total_microbatches",)),
    (("open_group", "sums", "units"), lambda v: v + 1, ("open_group.sums.units",)),
    (("open_group", "sums", "tokens_lo"), lambda v: v + 1, ("open_group.sums.units",)),
    (("open_group", "sums", "tokens_hi"), lambda v: v + 1, ("open_group.sums.units",)),
    (("open_group", "sums", "negative"), lambda v: 1.0, ("open_group.sums.negative",)),
    (("open_group", "sums", "units"), lambda v: 0.0, ("open_group.sums.units",)),
    (("open_group", "carried"), lambda v: False, ("open_group.carried",)),
    (("open_group", "gradients_stored"), lambda v: "distributed", ("open_group.gradient_names",)),
    (("open_group", "gradients"), lambda v: {f"{k}x": t for k, t in v.items()}, ("open_group.gradients",)),
    (("open_group", "no_gradient"), lambda v: ["head.bias"], ()),  # listed, yet carried: the gradient is added
    (("ledger", "updates_applied"), lambda v: v + 1, ("ledger.updates_attempted",)),
    (("ledger", "updates_skipped", "overflow"), lambda v: v + 1, ("ledger.updates_attempted",)),
    (("ledger", "normalization"), lambda v: "samples", ("open_group.sums.units",)),
    (("config", "accumulate"), lambda v: v + 1, ()),  # announced as a change of A: nothing is computed from it
    (("config", "replicas"), lambda v: v + 1, ()),
    (("format",), lambda v: 1, ("format",)),
]


def _leaves(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every value of the entry with its path (dict keys, list indices), the entry itself first."""
    yield path, node
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        yield from _leaves(value, (*path, key))


def _shown(path: tuple[Any, ...]) -> str:
    """The key as the package's errors name it: `open_group.gradients['head.bias']`, `slicing.per_rank[0].size`."""
    text = "lightning_accum" if not path else ""
    for i, part in enumerate(path):
        indexed = isinstance(part, int) or (i and path[i - 1] == "gradients")
        text += f"[{part!r}]" if indexed else (f".{part}" if text else part)
    return text


def _damages(kind: str, path: tuple[Any, ...], value: Any) -> list[Any]:
    """The damaged values of one kind for the value at `path` (`_DELETE` removes the key)."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if kind == "delete":
        return [_DELETE] if path else []  # the whole entry removed is the announced case (tested above)
    if kind == "none":
        return [] if value is None else [None]
    if kind == "wrong type":
        return [1 if isinstance(value, str) else "x"]
    if kind == "negative":  # a loss sum may be below 0 (a loss below 0): not a damage
        return [-1 if isinstance(value, int) else -1.0] if number and path[-1] != "weighted_loss" else []
    if kind != "out of range":
        return []
    if isinstance(value, bool):
        return [2]
    if isinstance(value, int):
        return [2**63, 2.5]
    if isinstance(value, float):
        if path[-1] == "weighted_loss":  # a loss sum is whatever the losses were: NaN and inf are not damage
            return []
        counts = path[:2] == ("open_group", "sums")
        return [float("nan"), float("inf"), *([0.5, 2.0**53] if counts else [])]
    if isinstance(value, Tensor):
        return [torch.zeros(3), value.long()]
    if isinstance(value, list):
        return [[1]]
    if isinstance(value, str):
        return ["no such value"]
    return []


def _damaged(state: dict[str, Any], path: tuple[Any, ...], new: Any) -> dict[str, Any]:
    state = copy.deepcopy(state)
    holder: Any = state
    for part in ("lightning_accum", *path)[:-1]:
        holder = holder[part]
    last = ("lightning_accum", *path)[-1]
    if new is _DELETE:
        del holder[last]
    else:
        holder[last] = new
    return state


def _sliced() -> AccumulationStrategy:
    return AccumulationStrategy(microbatch_size=1)  # the entry then also holds the slicing record


@pytest.fixture(scope="module")
def real_entry(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], torch.Tensor, Any]:
    """A checkpoint written inside a group (micro-batches 3, 4 of 3..5, sliced), and the run resumed from it."""
    folder = tmp_path_factory.mktemp("entry")
    ckpt = _written_at(folder, 4, strategy=_sliced())
    trainer, model, _ = _resume(ckpt, _sliced(), 3)
    state = torch.load(ckpt, weights_only=True)
    slicing = state["lightning_accum"]["slicing"]
    slicing["per_rank"] = copy.deepcopy(slicing["per_rank"])  # shared in the file with the top record: apart
    return state, params_vector(model), (trainer.strategy.ledger, trainer.strategy.slicing.state_dict())


@pytest.mark.parametrize("kind", _KINDS)
def test_every_damage_to_a_real_entry_is_an_error_naming_the_key_or_harmless(
    tmp_path: Path, real_entry: tuple[dict[str, Any], Tensor, Any], kind: str
) -> None:
    state, params, (ledger, record) = real_entry  # the undamaged resume: parameters, ledger, slicing record
    if kind == "inconsistent":
        cases = [(path, damage(_at(state, path)), keys) for path, damage, keys in _INCONSISTENT]
    else:
        cases = [
            (path, new, None)
            for path, value in _leaves(state["lightning_accum"])
            for new in _damages(kind, path, value)
        ]
    ckpt = tmp_path / "damaged.ckpt"
    outcomes: dict[str, list[str]] = {"error": [], "harmless": [], "record only": [], "wrong": []}
    for path, new, keys in cases:
        torch.save(_damaged(state, path, new), ckpt)
        label = f"{_shown(path)} = {'deleted' if new is _DELETE else repr(new)[:40]}"
        try:
            trainer, model, _ = _resume(ckpt, _sliced(), 3)
        except ValueError as error:
            named = re.search(r"entry is damaged: `([^`]+)`", str(error))
            key = named.group(1) if named else str(error)[:80]
            related = _names_the_key(key, _shown(path)) if keys is None else any(_names_the_key(key, k) for k in keys)
            outcomes["error" if related else "wrong"].append(f"{label}: names {key}")
            continue
        trained = trainer.strategy.ledger == ledger and torch.allclose(
            params_vector(model), params, rtol=1e-6, atol=1e-8
        )
        recorded = trainer.strategy.slicing.state_dict() == record
        if trained and not recorded and path[:1] == ("slicing",) and not keys:
            # A checkpoint written without `microbatch_size=` holds no slicing record, and the record's counts are
            # free: the training is the undamaged one, only the record of slice sizes (the report's) starts again.
            outcomes["record only"].append(label)
            continue
        outcomes["harmless" if trained and recorded and not keys else "wrong"].append(
            f"{label}: {'same run' if trained else 'resumed differently'}"
        )
    counts = {name: len(found) for name, found in outcomes.items() if name != "wrong"}
    print(f"\n{kind}: {len(cases)} damages, {counts}; harmless: {outcomes['harmless']}, {outcomes['record only']}")
    assert cases and not outcomes["wrong"], outcomes["wrong"]


def _at(state: dict[str, Any], path: tuple[Any, ...]) -> Any:
    value: Any = state["lightning_accum"]
    for part in path:
        value = value.get(part) if isinstance(value, dict) else value[part]
    return value


def _names_the_key(named: str, damaged: str) -> bool:
    """The error names the damaged key, the dict that holds it, or a key inside it."""
    if named == damaged or damaged == "lightning_accum":
        return True
    return any(a.startswith(b) and a[len(b)] in ".[" for a, b in ((named, damaged), (damaged, named)))
