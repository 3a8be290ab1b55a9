"""A checkpoint file (or sharded folder) as it is read: Lightning's read, or the package's error for one that cannot
be read.

:func:`read_checkpoint` turns the failures of a file that cannot be read into one ``ValueError`` naming the file, its
size, the likely cause and the way out (Lightning's or torch's error chained as its cause): an empty file, a file cut
short, a file that is no checkpoint at all, a shard of a sharded folder cut short, a sharded folder given to a strategy
that reads single files (:func:`describe_folder` says what wrote it and how to resume it) or to a model that is not
sharded. Every other error of the read passes through untouched: the diagnosis looks at the file itself, never at the
words of an error. :func:`distributed_gradients` reads the gradient of a group open at a sharded checkpoint. What is
read is checked by :mod:`~lightning_accum.strategies.entry`. See ``docs/reliability.md``.
"""

from __future__ import annotations

import pickletools
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy
from torch import Tensor
from torch.serialization import MAGIC_NUMBER

from lightning_accum.strategies.entry import CHECKPOINT_KEY, DISTRIBUTED_KEY

__all__ = ["describe_folder", "distributed_gradients", "read_checkpoint"]

_Path = str | Path


def _read_errors() -> tuple[type[BaseException], ...]:
    """What a failed read raises: exceptions, and torch's distributed-checkpoint error (a ``BaseException``)."""
    try:
        from torch.distributed.checkpoint.api import CheckpointException
    except ImportError:  # a torch built without distributed support
        return (Exception,)
    return (Exception, CheckpointException)


_READ_ERRORS = _read_errors()


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
    cut = _ends_inside_a_pickle(path, size) if head.startswith(b"\x80") else None  # torch's format before zip
    if cut:
        return (
            f"the file is cut short: its {size} byte(s) end inside a pickle of PyTorch's checkpoint format before zip"
            f" archives (a sequence of pickles, then the tensors' bytes), {_SHORT}. Resume from another checkpoint of"
            " the run; if this one was copied, copy it again and compare its size with the source's."
        )
    if cut is not None:
        return None  # its pickles are whole: torch's own error says the rest
    return (
        f"the file is not a PyTorch checkpoint: it is {size} byte(s) starting with {head!r}, where a checkpoint"
        " written by `torch.save` (`Trainer.save_checkpoint`, `ModelCheckpoint`) is a zip archive starting with"
        " b'PK'. Check that `ckpt_path` names the checkpoint (not a log, a configuration or a partly downloaded"
        " page) and resume from one; loading it with `weights_only=False`, as torch's error may advise, does not"
        " help: the file holds no checkpoint."
    )


def _ends_inside_a_pickle(path: Path, size: int) -> bool | None:
    """Whether the file ends inside one of the pickles of torch's format before zip archives; ``None`` where its bytes
    are no pickle's.

    Such a file is a sequence of pickles (torch's magic number, the protocol, facts of the system that wrote it, the
    object, the keys of its storages), then the storages' bytes, which are not looked at: what they should hold is
    known only by unpickling the object. Walking the pickles' opcodes (:func:`pickletools.genops`) runs nothing of
    the file; a walk that needs more bytes than the file has meets its end inside a pickle.
    """
    with path.open("rb") as file:
        for index in range(5):
            try:
                values = [arg for _, arg, _ in pickletools.genops(file)]
            except ValueError:  # the walk's own: more bytes needed, or an opcode that does not exist
                return True if file.tell() >= size else None
            if index == 0 and MAGIC_NUMBER not in values:
                return False  # one whole pickle, not torch's older format: torch's error says what it found
    return False


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
    names = list(group["gradient_names"])
    return read_checkpoint(lambda: read(names), path)  # a shard cut short: named, as when Lightning reads the folder
