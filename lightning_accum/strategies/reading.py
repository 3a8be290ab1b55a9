"""A checkpoint file (or sharded folder) as it is read: Lightning's read, or the package's error for one that cannot
be read.

:func:`read_checkpoint` turns a failure of torch's read of a local file or sharded folder into one ``ValueError``
naming the path, its size and torch's own error (chained as its cause); every other error of the read (a missing file,
a state that does not fit the model, a remote path) passes through untouched. A sharded folder given to a strategy that
cannot read it is refused before the read (:func:`describe_folder` says what wrote it and how to resume it).
:func:`distributed_gradients` reads the gradient of a group open at a sharded checkpoint. What is read is checked by
:mod:`~lightning_accum.strategies.entry`. See ``docs/reliability.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy
from torch import Tensor

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
        strategy: The strategy reading it: whether it reads sharded folders, and into which model. ``None``: no
            folder is refused before the read.

    Raises:
        ValueError: A sharded folder this strategy cannot read, or a file or folder torch's read failed on (the path,
            its size and torch's error, chained as its cause). Any other error of ``read`` is raised as it was.
    """
    local = _local(path)
    if local is not None and local.is_dir() and strategy is not None:
        refusal = _folder_refusal(local, strategy)
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
    """Whether ``error`` is torch's read of the file failing (raised inside ``torch.load``, or torch's
    distributed-checkpoint error), not Lightning's or the model's side of the load (a missing file, a state that does
    not fit)."""
    if isinstance(error, _READ_ERRORS[1:]):  # torch's distributed-checkpoint error
        return True
    trace = error.__traceback__
    while trace is not None:
        if trace.tb_frame.f_globals.get("__name__") == "torch.serialization":
            return True
        trace = trace.tb_next
    return False


def _size(path: Path) -> str | None:
    """The size of the file (or of the folder's files) at ``path``; ``None`` where it cannot be read."""
    try:
        if not path.is_dir():
            return f"{path.stat().st_size} byte(s)"
        sizes = [p.stat().st_size for p in path.rglob("*") if p.is_file()]
    except OSError:
        return None
    return f"a folder of {len(sizes)} file(s), {sum(sizes)} byte(s)"


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
    return read_checkpoint(lambda: read(names), path)  # a shard torch cannot read: named, as in Lightning's read
