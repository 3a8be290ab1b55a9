"""A checkpoint file or sharded folder as it is read, and the gradient of a group open at a sharded checkpoint."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lightning.fabric import __version__ as fabric_version
from lightning.fabric.utilities import cloud_io
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException

from lightning_accum.core.entry import DISTRIBUTED_KEY

__all__ = [
    "LIGHTNING_TAKES_REMOTE_FOLDERS",
    "WAY_OUT",
    "checkpoint_location",
    "distributed_gradients",
    "fsspec_reader",
    "local_path",
    "read_checkpoint",
]

_Path = str | Path

#: How to resume a sharded checkpoint folder (said by the Trainer door's refusal of a folder).
WAY_OUT = (
    "Resume it with strategy='accum_fsdp' (or ModelParallelAccumulationStrategy) on a model sharded in"
    " `configure_model`, or write single files with save_distributed_checkpoint=False."
)


#: Whether Lightning's model-parallel strategies (the Trainer's and Fabric's) save and load checkpoints at remote
#: (fsspec) URLs: from Lightning 2.7 (its PRs #21775, #21821), whose strategies resolve a path through
#: ``cloud_io._resolve_path``; up to 2.6 they turn every path into a local ``Path`` (``s3://b/c`` becomes ``s3:/b/c``).
LIGHTNING_TAKES_REMOTE_FOLDERS = hasattr(cloud_io, "_resolve_path")

#: What a failed read raises: exceptions, and torch's distributed-checkpoint error (a ``BaseException``).
_READ_ERRORS = (Exception, CheckpointException)


def read_checkpoint(
    read: Callable[[], dict[str, Any]], path: _Path, refuse_folder: Callable[[Path], str | None] | None = None
) -> dict[str, Any]:
    """``read()``, Lightning's read of the checkpoint at ``path``, after ``refuse_folder`` said why a folder is refused.

    Raises:
        ValueError: A folder this strategy cannot read, or a file or folder torch's read failed on (its path, size
            and torch's error, chained). Any other error of ``read`` is raised as it was.
    """
    local = local_path(path)
    if local is not None and local.is_dir() and refuse_folder is not None:
        refusal = refuse_folder(local)
        if refusal is not None:
            raise ValueError(refusal)
    try:
        return read()
    except _READ_ERRORS as error:
        size = _size(local) if local is not None and _from_torch_read(error) else None
        if size is None:
            raise
        said = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        raise ValueError(f"`ckpt_path={str(path)!r}` ({size}) cannot be read: {said}") from error


def _from_torch_read(error: BaseException) -> bool:
    """Whether ``error`` is torch's read of the file failing, not Lightning's or the model's side of the load."""
    if isinstance(error, CheckpointException):
        return True
    trace = error.__traceback__
    while trace is not None:
        if trace.tb_frame.f_globals.get("__name__") == "torch.serialization":
            return True
        trace = trace.tb_next
    return False


def _size(path: Path) -> str | None:
    try:
        if not path.is_dir():
            return f"{path.stat().st_size} byte(s)"
        sizes = [p.stat().st_size for p in path.rglob("*") if p.is_file()]
    except OSError:
        return None
    return f"a folder of {len(sizes)} file(s), {sum(sizes)} byte(s)"


def local_path(path: _Path) -> Path | None:
    """``path`` on the local file system, or ``None`` for a remote one."""
    text = str(path)
    if "://" in text and not text.startswith("file://"):
        return None
    return Path(text.removeprefix("file://"))


def checkpoint_location(path: _Path) -> Path | str:
    """The model-parallel checkpoint ``path``: a local ``Path``, or a URL where Lightning takes them (else refused)."""
    text = str(path)
    if "://" in text and not LIGHTNING_TAKES_REMOTE_FOLDERS:
        raise ValueError(
            f"A checkpoint at {text!r}: Lightning {fabric_version}'s model-parallel strategy writes and reads"
            " checkpoints at local paths only (a URL would be written as a local path of another name: 's3://b/c' as"
            " 's3:/b/c'). Give a local path, or use a Lightning whose model-parallel strategy takes URLs (2.7 and"
            " later)."
        )
    local = local_path(path)
    return local if local is not None else text


def fsspec_reader() -> Any:
    """torch's ``FsspecReader``: public where torch has it (2.15, whose private module warns), private before."""
    try:
        from torch.distributed.checkpoint.fsspec_filesystem import FsspecReader
    except ImportError:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    return FsspecReader


def distributed_gradients(
    checkpoint: Mapping[str, Any],
    group: Mapping[str, Any],
    path: str,
    read: Callable[[list[str]], dict[str, Tensor]] | None,
) -> dict[str, Tensor]:
    """The open group's gradient stored in a distributed checkpoint's shards; ``ValueError`` without ``read``."""
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
    return read_checkpoint(lambda: read(names), path)  # a shard torch cannot read: named, as in Lightning's read
