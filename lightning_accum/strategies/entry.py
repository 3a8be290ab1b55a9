"""A checkpoint as it is read back: the file (or sharded folder) readable, and the package's entry in it checked.

Reading, :func:`read_checkpoint`: Lightning's own read of the checkpoint, with the failures of a file that cannot be
read turned into one ``ValueError`` naming the file, its size, the likely cause and the way out (Lightning's or torch's
error chained as its cause): an empty file, a file cut short, a file that is no checkpoint at all, a shard of a sharded
folder cut short, a sharded folder given to a strategy that reads single files (:func:`describe_folder` says what wrote
it and how to resume it) or to a model that is not sharded. Every other error of the read passes through untouched:
the diagnosis looks at the file itself, never at the words of an error.

Checking, :func:`validated_state`: the entry under :data:`CHECKPOINT_KEY` against one table of its fields
(:data:`FIELDS`: where the field is, the form it must have, and that form in words, as the error names it), then
against a short list of rules between fields (:data:`RULES`); :func:`checked_gradients` checks the carried gradient
against the parameters it is added to, when they are known. Anything wrong is :func:`malformed`'s ``ValueError``,
naming the key, the expected form and what was found, before anything is installed. See ``docs/reliability.md``.
"""

from __future__ import annotations

import dataclasses
import math
import zipfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy
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
    "describe_folder",
    "distributed_gradients",
    "malformed",
    "own_slicing",
    "read_checkpoint",
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

_Path = str | Path


def _read_errors() -> tuple[type[BaseException], ...]:
    """What a failed read raises: exceptions, and torch's distributed-checkpoint error (a ``BaseException``)."""
    try:
        from torch.distributed.checkpoint.api import CheckpointException
    except ImportError:  # a torch built without distributed support
        return (Exception,)
    return (Exception, CheckpointException)


_READ_ERRORS = _read_errors()


# ---------------------------------------------------------------------- the file, read


def read_checkpoint(
    read: Callable[[], dict[str, Any]], path: _Path, strategy: Strategy | None = None
) -> dict[str, Any]:
    """``read()`` (Lightning's read of the checkpoint at ``path``), or the package's error for a file that cannot
    be read.

    Args:
        read: Reads the checkpoint (the Lightning strategy's ``load_checkpoint``).
        path: The checkpoint's path, as given to ``Trainer.fit(ckpt_path=...)``.
        strategy: The strategy reading it: whether it reads sharded folders, and into which model. ``None``: only
            the files themselves are looked at.

    Raises:
        ValueError: The file, or the folder, cannot be read; chained to Lightning's or torch's error where there was
            one. Any other error of ``read`` is raised as it was.
    """
    local = _local(path)
    if local is not None and local.is_dir() and strategy is not None:
        refusal = _folder_refusal(local, strategy)
        if refusal is not None:
            raise ValueError(refusal)
    try:
        return read()
    except _READ_ERRORS as error:
        custom_io = not isinstance(strategy, ModelParallelStrategy) and not isinstance(
            getattr(strategy, "checkpoint_io", None), TorchCheckpointIO | None
        )
        fault = None if local is None or custom_io else _folder_fault(local) if local.is_dir() else _file_fault(local)
        if fault is None:
            raise
        raise ValueError(f"`ckpt_path={str(path)!r}` cannot be read: {fault}") from error


def describe_folder(path: _Path) -> str:
    """What a checkpoint folder is and what wrote it, from its files and Lightning's metadata file in it."""
    folder = Path(path)
    if not _is_distributed(folder):
        names = sorted(p.name for p in folder.iterdir())
        shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "") if names else "nothing"
        return (
            f"a folder that is not a checkpoint written by Lightning (it holds {shown}; no `meta.pt` and `.metadata`)"
        )
    shards, processes, meta = _folder_facts(folder)
    entry = meta.get(CHECKPOINT_KEY)
    config = entry.get("config") if isinstance(entry, Mapping) else None
    where = (
        f", in epoch {meta['epoch']} after {meta.get('global_step', '?')} optimizer step(s)" if "epoch" in meta else ""
    )
    if isinstance(entry, Mapping) and entry.get("open_group_microbatches"):
        where += ", inside an accumulation group"
    what = f"a sharded checkpoint (a distributed checkpoint: {shards} shard file(s), `.metadata` and `meta.pt`)"
    if not isinstance(config, Mapping):
        return (
            f"{what} written by {processes} process(es) of a Lightning strategy without {CHECKPOINT_KEY!r} state"
            f" (ModelParallelStrategy){where}"
        )
    return (
        f"{what} written by {config.get('strategy', '?')} on {processes} process(es),"
        f" {config.get('replicas', '?')} data-parallel replica(s){where}"
    )


def _folder_facts(folder: Path) -> tuple[int, int, Mapping[str, Any]]:
    """A distributed checkpoint's shard files, the processes that wrote them (``__<rank>_<n>.distcp``), and
    Lightning's metadata file (empty where it cannot be read)."""
    shards = [p.name for p in folder.iterdir() if p.name.endswith(".distcp")]
    ranks = {name.split("_")[2] for name in shards if name.count("_") >= 3}
    try:
        meta = torch.load(folder / _METADATA_FILENAME, map_location="cpu", weights_only=True)
    except Exception:  # said by the read itself, when it fails
        meta = {}
    return len(shards), max(len(ranks), 1), meta if isinstance(meta, Mapping) else {}


def _resume_advice(folder: Path) -> str:
    """How to resume a sharded folder: the strategy that reads it and the devices it was written on."""
    _, processes, meta = _folder_facts(folder)
    try:
        replicas = max(int(meta[CHECKPOINT_KEY]["config"]["replicas"]), 1)
    except (KeyError, TypeError, ValueError):
        replicas = processes
    tensor_parallel = max(processes // replicas, 1)
    strategy = (
        "strategy='accum_fsdp'"
        if tensor_parallel == 1
        else f"strategy=ModelParallelAccumulationStrategy(tensor_parallel_size={tensor_parallel})"
    )
    return (
        f"Resume it with {strategy} and devices={processes} as it was written (another number of devices works too:"
        " the shards are read into this run's layout), with a model that shards its parameters in `configure_model`"
        " (`fully_shard(module, mesh=self.device_mesh['data_parallel'])`, on a mesh of any size, 1 included)."
    )


def _folder_refusal(folder: Path, strategy: Strategy) -> str | None:
    """Why ``strategy`` cannot read the folder at all (``None``: it can try): Lightning's single-file strategies read
    files only, and Lightning's model-parallel strategy reads a sharded folder into a sharded (DTensor) model only."""
    if not _is_distributed(folder):
        return (
            f"`ckpt_path={str(folder)!r}` is {describe_folder(folder)}. Give `ckpt_path` the checkpoint file (a `.ckpt`"
            " written by `Trainer.save_checkpoint` or `ModelCheckpoint`), or the folder of a sharded checkpoint."
        )
    if not isinstance(strategy, ModelParallelStrategy):
        return (
            f"`ckpt_path={str(folder)!r}` is {describe_folder(folder)}. {type(strategy).__name__} reads a checkpoint"
            f" from a single file only (Lightning's loader). {_resume_advice(folder)} To resume under any strategy,"
            " write checkpoints as single files: ModelParallelAccumulationStrategy(save_distributed_checkpoint=False)."
        )
    module = strategy.model if strategy.model is not None else strategy.lightning_module
    if module is None or _is_sharded(module):
        return None
    return (
        f"`ckpt_path={str(folder)!r}` is {describe_folder(folder)}, and this run's model has no sharded (DTensor)"
        f" parameter: its `configure_model` did not shard it on this run's {strategy.world_size} device(s)."
        " Lightning reads a sharded folder into a sharded model only (its own error: 'Could not find a distributed"
        f" model'). {_resume_advice(folder)}"
    )


def _is_distributed(folder: Path) -> bool:
    """Whether ``folder`` is a distributed checkpoint written by Lightning (torch's index of the shards, and
    Lightning's metadata file)."""
    return (folder / ".metadata").is_file() and (folder / _METADATA_FILENAME).is_file()


def _is_sharded(module: torch.nn.Module) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def _local(path: _Path) -> Path | None:
    """``path`` on the local file system, or ``None`` for a remote one (``s3://...``): not looked at."""
    text = str(path)
    if "://" in text and not text.startswith("file://"):
        return None
    return Path(text.removeprefix("file://"))


_SHORT = (
    "as a write or a copy that stopped early leaves it (the process killed while saving, a full disk, an interrupted"
    " transfer)"
)


def _file_fault(path: Path) -> str | None:
    """What makes the file at ``path`` unreadable as a checkpoint written by ``torch.save``, or ``None`` (it looks
    like one: the error is about something else)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as file:
            head = file.read(8)
    except OSError:
        return None  # missing or not readable: Lightning's and the system's own errors say so
    if size == 0:
        return (
            "the file is empty (0 bytes), as a write that stopped before its first byte leaves it (the process killed"
            " while saving, a full disk). Resume from another checkpoint of the run (the one written before it), or"
            " start the run again."
        )
    if head.startswith(b"PK"):
        try:
            with zipfile.ZipFile(path) as archive:
                names = archive.namelist()
        except zipfile.BadZipFile:
            return (
                f"the file is cut short: {size} bytes of a zip archive (PyTorch's checkpoint format) without the"
                f" directory that ends every complete archive, {_SHORT}. Resume from another checkpoint of the run;"
                " if this one was copied, copy it again and compare its size with the source's."
            )
        if not any(name == "data.pkl" or name.endswith("/data.pkl") for name in names):
            return (
                f"the file ({size} bytes) is a zip archive but not a PyTorch checkpoint (it holds no `data.pkl`)."
                " Check that `ckpt_path` names a checkpoint written by `Trainer.save_checkpoint` or `ModelCheckpoint`."
            )
        return None
    if head.startswith(b"\x80"):
        return None  # a pickle: torch's format before zip archives, whose errors are torch's own
    return (
        f"the file is not a PyTorch checkpoint: it is {size} byte(s) starting with {head!r}, where a checkpoint"
        " written by `torch.save` (`Trainer.save_checkpoint`, `ModelCheckpoint`) is a zip archive starting with"
        " b'PK'. Check that `ckpt_path` names the checkpoint (not a log, a configuration or a partly downloaded"
        " page) and resume from one; loading it with `weights_only=False`, as torch's error may advise, does not"
        " help: the file holds no checkpoint."
    )


def _folder_fault(folder: Path) -> str | None:
    """What makes a sharded folder unreadable (its metadata file, torch's index of the shards, a shard shorter than
    that index says), or ``None``."""
    meta, index = folder / _METADATA_FILENAME, folder / ".metadata"
    if not _is_distributed(folder):
        return None  # not a Lightning distributed checkpoint: Lightning's error says what it expected
    fault = _file_fault(meta)
    if fault is not None:
        return f"it is a sharded checkpoint, and its metadata file `meta.pt`: {fault}"
    from torch.distributed.checkpoint import FileSystemReader

    try:
        stored = FileSystemReader(str(folder)).read_metadata().storage_data
    except Exception:
        return (
            f"it is a sharded checkpoint whose index of the shards, `.metadata` ({index.stat().st_size} bytes),"
            f" cannot be read: it is damaged, {_SHORT}. Resume from another checkpoint of the run."
        )
    ends: dict[str, int] = {}
    for info in stored.values():
        name, end = getattr(info, "relative_path", None), getattr(info, "offset", 0) + getattr(info, "length", 0)
        if isinstance(name, str):
            ends[name] = max(ends.get(name, 0), int(end))
    for name, end in sorted(ends.items()):
        shard = folder / name
        size = shard.stat().st_size if shard.is_file() else None
        if size is None or size < end:
            found = "missing" if size is None else f"{size} bytes"
            return (
                f"it is a sharded checkpoint, and its shard `{name}` is {found}, but the folder's `.metadata` places"
                f" data up to byte {end} in it: the shard is cut short, {_SHORT}. Resume from another checkpoint of"
                " the run; if the folder was copied, copy that shard again."
            )
    return None


# ---------------------------------------------------------------------- the entry, checked

_UNITS = tuple(UNIT_CODES)  # the units a run can be weighted by
_LARGEST_COUNT = 2**53  # counts are exact below it in the float64 sums
_SUMS = [slot.name.lower() for slot in CARRIED]  # the carried sums, by name
_COUNT_SUMS = [name for name in _SUMS if name != "weighted_loss"]
_RECORD_FIELDS = {field.name for field in dataclasses.fields(GroupRecord)}  # a closed group's record, as written


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


def _sum(name: str, value: Any) -> bool:
    """A carried sum: a finite number, but ``Σ w·loss``, which is whatever the losses were."""
    return _float(value) if name == "weighted_loss" else _number(value)


def _none_or(test: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or test(value)


def _names(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(name, str) for name in value)


def _dict_of(keys: Callable[[Any], bool], values: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, Mapping) and all(keys(k) and values(v) for k, v in value.items())


def _record(value: Any) -> bool:
    return isinstance(value, Mapping) and set(value) == _RECORD_FIELDS


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _str(value: Any) -> bool:
    return isinstance(value, str)


def _tensor(value: Any) -> bool:
    return isinstance(value, Tensor)


def _dtype(value: Tensor) -> Any:
    return value.dtype


def _slice_sizes(value: Any) -> bool:
    return _dict_of(_positive, _count)(value)


def _slicing_record(value: Any) -> bool:
    """One rank's record of ``microbatch_size=`` (:meth:`SlicingLog.state_dict
    <lightning_accum.slicing.SlicingLog.state_dict>`), as the resumed rank reads it."""
    return (
        isinstance(value, Mapping)
        and _none_or(_positive)(value.get("size", 0))
        and _slice_sizes(value.get("slice_sizes"))
        and isinstance(value.get("retries"), list)
    )


_WHOLE = "a whole number in [0, 2**53) (a count)"


@dataclass(frozen=True)
class Field:
    """One field of the entry: where it is, the form it must have, and that form in words.

    ``path`` is dotted from the entry's top (``"open_group.sums.units"``); a last part ``*`` is every item of the
    dict before it (named ``open_group.gradients['name']``). A field inside a dict that is absent or ``None`` is not
    looked at (the row of that dict says whether it may be). ``required``: every entry the package writes holds the
    field where its dict is (a missing one is an error; the others may be absent). ``shown`` gives what the error
    says was found.
    """

    path: str
    test: Callable[[Any], bool]
    expected: str
    required: bool = False
    shown: Callable[[Any], Any] = lambda value: value


_NORMALIZE = ("auto", *_UNITS)
#: Every field of the entry, in the order they are checked (a dict before what it holds).
FIELDS: tuple[Field, ...] = (
    Field("ledger", lambda v: isinstance(v, Mapping), "a dict of the ledger's counters", required=True),
    *(Field(f"ledger.{name}", _count, "an int >= 0", required=True) for name in COUNTERS),
    Field(
        "ledger.updates_skipped",
        lambda v: _dict_of(_str, _count)(v) and set(SKIP_REASONS) <= set(v),
        f"a dict of reason -> int >= 0 for each of {SKIP_REASONS}",
        required=True,
    ),
    Field("ledger.normalization", _none_or(lambda v: v in _UNITS), f"None or one of {_UNITS}", required=True),
    Field("ledger.last_group", _none_or(_record), f"None or a dict with {sorted(_RECORD_FIELDS)}", required=True),
    Field("ledger.last_group.loss", _float, "a number (NaN or inf where the group had no weight or a non-finite loss)"),
    *(Field(f"ledger.last_group.{name}", _count, "an int >= 0") for name in ("tokens", "samples", "microbatches")),
    Field("ledger.last_group.applied", _is_bool, "True or False"),
    Field("ledger.last_group.dropped", _is_bool, "True or False"),
    Field("ledger.last_group.skip_reason", _none_or(lambda v: v in SKIP_REASONS), f"None or one of {SKIP_REASONS}"),
    Field("ledger.last_group.grad_scale", _none_or(_number), "None or a number"),
    Field("scale_ref", _none_or(lambda v: _number(v) and v > 0), "None or a number > 0", required=True),
    Field("consecutive_skips", _count, "an int >= 0", required=True),
    Field("open_group_microbatches", _count, "an int >= 0", required=True),
    Field("config", _none_or(lambda v: isinstance(v, Mapping)), "a dict", required=True),
    Field("config.strategy", _str, "the name of the strategy's class", required=True),
    Field("config.accumulate", _positive, "an int >= 1"),  # absent where no Trainer ran the strategy
    Field("config.replicas", _positive, "an int >= 1", required=True),
    Field("config.normalize", lambda v: v in _NORMALIZE, f"one of {_NORMALIZE}", required=True),
    Field("config.partial_group", lambda v: v in ("rescale", "drop"), "'rescale' or 'drop'", required=True),
    Field("format", lambda v: v == FORMAT, f"{FORMAT} (a later format is written by a later version)"),
    Field("open_group", _none_or(lambda v: isinstance(v, Mapping)), "None or a dict"),
    Field("open_group.microbatches", _count, "an int >= 0", required=True),
    Field("open_group.consistent", _is_bool, "True or False", required=True),
    Field("open_group.carried", _is_bool, "True or False (whether the entry carries the gradient)", required=True),
    Field("open_group.replicas", _positive, "an int >= 1", required=True),
    Field("open_group.accumulate", _positive, "an int >= 1"),
    Field("open_group.total_microbatches", _count, "an int >= 0", required=True),
    Field("open_group.carried_microbatches", _count, "an int >= 0"),  # written since it is checked
    Field("open_group.rerun", lambda v: _count(v) and v <= 1, "0 or 1", required=True),
    Field("open_group.reason", _str, "a string (why the group's gradient is not carried)"),
    Field("open_group.scale_ref", _none_or(lambda v: _number(v) and v > 0), "None or a number > 0"),
    Field("open_group.scale_ref_is_tensor", _is_bool, "True or False"),
    Field(
        "open_group.sums",
        lambda v: isinstance(v, Mapping) and set(v) == set(_SUMS) and all(_sum(k, x) for k, x in v.items()),
        f"a dict of finite numbers with keys {_SUMS} (`weighted_loss` may be NaN or inf: a loss may be)",
    ),
    *(
        Field(f"open_group.sums.{name}", lambda v: float(v).is_integer() and 0 <= v < _LARGEST_COUNT, _WHOLE)
        for name in _COUNT_SUMS
    ),
    *(
        Field(f"open_group.sums.{name}", lambda v: v < COUNT_SPLIT, f"below {COUNT_SPLIT} (the low part of a count)")
        for name in ("tokens_lo", "samples_lo")
    ),
    Field("open_group.gradients_stored", lambda v: v in ("inline", "distributed"), "'inline' or 'distributed'"),
    Field("open_group.gradient_names", _names, "a list of parameter names"),
    Field("open_group.gradients", _dict_of(_str, _tensor), "a dict of parameter name -> tensor"),
    Field("open_group.gradients.*", lambda v: v.is_floating_point(), "a floating-point tensor", shown=_dtype),
    Field("open_group.no_gradient", _names, "a list of parameter names"),
    Field("slicing", _none_or(lambda v: isinstance(v, Mapping)), "a dict"),
    Field("slicing.size", _none_or(_positive), "None or an int >= 1", required=True),
    Field("slicing.slice_sizes", _slice_sizes, "a dict of size -> int >= 0", required=True),
    Field("slicing.retries", lambda v: isinstance(v, list), "a list", required=True),
    Field(
        "slicing.per_rank",
        lambda v: isinstance(v, list) and all(_slicing_record(record) for record in v),
        "a list of each rank's record (a dict of `size`, `slice_sizes` and `retries` as above)",
        required=True,
    ),
)
_EXPECTED = {row.path: row.expected for row in FIELDS}
#: The rows of the carried gradient, checked again once a sharded folder's gradient is read.
_GRADIENT_FIELDS = tuple(row for row in FIELDS if row.path.startswith("open_group.gradients"))

Finding = tuple[str, str, Any]  # a rule's finding: the key, what it should be, what it is


def _group(state: Mapping[str, Any]) -> Mapping[str, Any] | None:
    group = state.get("open_group")
    return group if isinstance(group, Mapping) else None


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
    group = _group(state)
    if group is None or not group["carried"] or group["replicas"] != 1 or group["scale_ref"] is not None:
        return None
    units = group["sums"]["units"]
    if not units:
        return None
    return "open_group.scale_ref", f"a number > 0 (the group's c: its micro-batches have a weight of {units:g})", None


def _no_negative_count(state: Mapping[str, Any]) -> Finding | None:
    group = _group(state)
    if group is None or not group["carried"] or not group["sums"]["negative"]:
        return None
    expected = (
        "0 (a micro-batch of the open group reported a negative count before the checkpoint; such a group stops at"
        " its close and cannot be resumed)"
    )
    return "open_group.sums.negative", expected, group["sums"]["negative"]


def _units_are_the_unit(state: Mapping[str, Any]) -> Finding | None:
    """Under token (sample) weighting a group's weight is its tokens (samples)."""
    group, unit = _group(state), state["ledger"]["normalization"]
    if group is None or not group["carried"] or unit not in ("tokens", "samples"):
        return None
    sums = group["sums"]
    count = sums[f"{unit}_hi"] * COUNT_SPLIT + sums[f"{unit}_lo"]
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


def _places(state: Mapping[str, Any], path: str) -> Iterator[tuple[str, Mapping[str, Any], str]]:
    """Where ``path`` is in ``state``: the key as the error names it, the dict that holds it, its key there."""
    *parents, last = path.split(".")
    holder: Any = state
    for part in parents:
        holder = holder.get(part) if isinstance(holder, Mapping) else None
    if not isinstance(holder, Mapping):
        return
    prefix = ".".join(parents)
    if last == "*":
        yield from ((f"{prefix}[{key!r}]", holder, key) for key in holder)
    else:
        yield (f"{prefix}.{last}" if prefix else last), holder, last


def _check_fields(state: Mapping[str, Any], fields: tuple[Field, ...]) -> None:
    """The one check of the table: every field present where required, and of its form."""
    for row in fields:
        for key, holder, name in _places(state, row.path):
            if name not in holder:
                if row.required:
                    raise malformed(key, row.expected, "missing")
            elif not row.test(holder[name]):
                raise malformed(key, row.expected, row.shown(holder[name]))


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


def distributed_gradients(
    checkpoint: Mapping[str, Any],
    group: Mapping[str, Any],
    path: str,
    read: Callable[[list[str]], dict[str, Tensor]] | None,
) -> dict[str, Tensor]:
    """The open group's gradient stored in a distributed checkpoint's shards (or in one file it was consolidated into,
    which holds it under :data:`DISTRIBUTED_KEY`)."""
    if DISTRIBUTED_KEY in checkpoint:
        return dict(checkpoint[DISTRIBUTED_KEY])
    if read is None:
        raise ValueError(
            f"The checkpoint {path!r} was written inside an accumulation group by a sharded strategy: the group's"
            f" gradient is stored shard by shard in its distributed checkpoint (under {DISTRIBUTED_KEY!r}), which this"
            " strategy does not read. Resume it with strategy='accum_fsdp' or 'accum_model_parallel' (on any number"
            " of devices), or resume from a checkpoint written at an update boundary."
        )
    return read(list(group["gradient_names"]))


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


def own_slicing(state: Mapping[str, Any], rank: int) -> Mapping[str, Any]:
    """This rank's slicing record in a checkpoint's entry (rank zero's, or the only one, otherwise)."""
    rows = state.get("per_rank")
    if isinstance(rows, list) and rank < len(rows) and isinstance(rows[rank], Mapping):
        return rows[rank]  # type: ignore[no-any-return]
    return state
