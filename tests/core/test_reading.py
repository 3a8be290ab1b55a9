"""core/reading: a checkpoint file or folder torch cannot read is named with its path, its size and torch's error; a
folder the strategy cannot read is refused before the read, with the way out."""

from __future__ import annotations

import contextlib
import json
import pickle
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from helpers import _EXAMPLES, ListDataset, ResumableLoader, TinyLM, _resume, _written_at, make_trainer, run_ddp

import lightning_accum  # noqa: F401  (registers the strategy strings)


def _names_path_size_and_torchs_error(error: ValueError, path: Path, size: str) -> bool:
    """The package's error for a checkpoint torch cannot read: the path, its size and torch's own error (chained)."""
    cause = error.__cause__
    assert cause is not None  # torch's own error, chained
    said = f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
    return str(error) == f"`ckpt_path={str(path)!r}` ({size}) cannot be read: {said}"


@pytest.mark.parametrize("name", ["empty", "one byte", "text", "half", "pickle start", "legacy start", "a pickle"])
def test_a_checkpoint_file_that_cannot_be_read_is_named_with_its_size_and_torchs_error(
    tmp_path: Path, name: str
) -> None:
    # Before the package's error: torch's bare EOFError (empty), an UnpicklingError (one byte), bare errors of its
    # unpickler (text: IndexError "pop from empty list"), "PytorchStreamReader failed reading zip archive" (half), a
    # bare IndexError or EOFError for the start of a pickle (torch's format before zip archives: b"\x80" is a pickle's
    # first opcode without its protocol, b"\x80\x02}" a protocol-2 pickle's first dict without its end), "Invalid
    # magic number" (a whole pickle that is not torch's), none naming the file. Never a silent reset.
    written = _written_at(tmp_path, 4).read_bytes()
    content = {"empty": b"", "one byte": b"x", "text": b"epoch: 3\nloss: 2.5\nstep: 9\n", "half": written[:2000]}
    content.update({"pickle start": b"\x80", "legacy start": b"\x80\x02}"})
    content["a pickle"] = pickle.dumps({"epoch": 3}, protocol=2)
    ckpt = tmp_path / f"{name.replace(' ', '-')}.ckpt"
    ckpt.write_bytes(content[name])
    with pytest.raises(
        ValueError, match=re.escape(f"`ckpt_path={str(ckpt)!r}` ({len(content[name])} byte(s))")
    ) as caught:
        _resume(ckpt, "accum", 3)
    assert _names_path_size_and_torchs_error(caught.value, ckpt, f"{len(content[name])} byte(s)")


def test_a_missing_file_is_lightnings_error_and_torchs_advice_is_kept(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found"):  # Lightning's own
        _resume(tmp_path / "never-written.ckpt", "accum", 3)
    # A whole checkpoint holding an object `weights_only=True` refuses: torch's error, and its advice, in the message.
    # (Lightning 2.5 reads checkpoints with `weights_only=False`: the object is loaded there, nothing to refuse.)
    state = torch.load(_written_at(tmp_path, 4), weights_only=True)
    state["note"] = contextlib.nullcontext()
    torch.save(state, tmp_path / "with-an-object.ckpt")
    if tuple(int(v) for v in L.__version__.split(".")[:2]) >= (2, 6):
        with pytest.raises(ValueError, match=r"(?s)cannot be read: UnpicklingError: .*weights_only") as caught:
            _resume(tmp_path / "with-an-object.ckpt", "accum", 3)
        assert isinstance(caught.value.__cause__, pickle.UnpicklingError)


class _ShardedTinyLM(TinyLM):
    """TinyLM (AdamW: Lightning's FSDP2 loader needs an optimizer state) that shards itself with FSDP2 in
    `configure_model`; `on_one_device=False` leaves it whole on a mesh of one device, as some user code does."""

    def __init__(self, on_one_device: bool = True) -> None:
        super().__init__(lr=0.3, optimizer="adamw")
        self.on_one_device = on_one_device

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if mesh is None or (mesh["data_parallel"].size() == 1 and not self.on_one_device):
            return
        from torch.distributed.fsdp import fully_shard

        for module in (self.embed, self.head):
            fully_shard(module, mesh=mesh["data_parallel"])


class _SaveAt(L.Callback):
    def __init__(self, path: Path, batch_idx: int) -> None:
        self.path, self.batch_idx = path, batch_idx

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if args[-1] == self.batch_idx:
            trainer.save_checkpoint(self.path)


def _sharded_fit(devices: int, model: L.LightningModule, callbacks: list[L.Callback], ckpt: Path | None) -> L.Trainer:
    from lightning_accum import ModelParallelAccumulationStrategy

    trainer = make_trainer(
        strategy=ModelParallelAccumulationStrategy(tensor_parallel_size=1),  # a sharded folder (Lightning's default)
        devices=devices,
        accumulate_grad_batches=2,
        callbacks=callbacks,
        use_distributed_sampler=False,
    )
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    loader = ResumableLoader(ListDataset(_EXAMPLES[rank::devices]), batch_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's resume notes
        trainer.fit(model, loader, ckpt_path=ckpt)
    return trainer


def _write_sharded_folder(rank: int, folder: str) -> None:
    # Inside the group of micro-batches 2, 3 (after the first update: Lightning's FSDP2 loader needs an optimizer
    # state).
    _sharded_fit(2, _ShardedTinyLM(), [_SaveAt(Path(folder, "inside.ckpt"), 2)], None)


def _read_on_one_device(rank: int, folder: str) -> None:
    said = {}
    for name, model, ckpt in (
        ("unsharded model", _ShardedTinyLM(on_one_device=False), "inside.ckpt"),
        ("shard cut short", _ShardedTinyLM(), "cut.ckpt"),
        ("shard cut to 90 %", _ShardedTinyLM(), "cut90.ckpt"),
        ("sharded model", _ShardedTinyLM(), "inside.ckpt"),
    ):
        try:
            trainer = _sharded_fit(1, model, [], Path(folder, ckpt))
            said[name] = f"resumed: {trainer.strategy.ledger.microbatches} micro-batches"
        except ValueError as error:
            said[name] = f"{error} (from {type(error.__cause__).__name__})"
    Path(folder, "said.json").write_text(json.dumps(said))


_WAY_OUT = re.escape(
    "Resume it with strategy='accum_fsdp' (or ModelParallelAccumulationStrategy) on a model sharded in"
    " `configure_model`, or write single files with save_distributed_checkpoint=False."
)


def test_a_folder_a_strategy_cannot_read_is_refused_before_the_read(tmp_path: Path) -> None:
    # Before: IsADirectoryError from torch's read, for both folders.
    folder = tmp_path / "not-a-checkpoint"
    folder.mkdir()
    (folder / "notes.txt").write_text("epoch 3")
    with pytest.raises(
        ValueError,
        match=re.escape(f"`ckpt_path={str(folder)!r}` is a folder that is not a checkpoint")
        + r".* Give `ckpt_path` the checkpoint file",
    ):
        _resume(folder, "accum", 3)
    # A sharded folder's layout (torch's index of the shards, Lightning's metadata file) under a single-file strategy.
    sharded = tmp_path / "sharded.ckpt"
    sharded.mkdir()
    (sharded / ".metadata").write_bytes(b"")
    (sharded / "meta.pt").write_bytes(b"")
    with pytest.raises(
        ValueError,
        match=re.escape(f"`ckpt_path={str(sharded)!r}` is a sharded (distributed) checkpoint folder;")
        + r" AccumulationStrategy reads single files only\. "
        + _WAY_OUT,
    ):
        _resume(sharded, "accum", 3)


@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_a_sharded_folder_that_cannot_be_read_is_refused_with_the_way_out(tmp_path: Path) -> None:
    run_ddp(_write_sharded_folder, str(tmp_path))  # accum_fsdp on 2 devices: a sharded folder
    folder = tmp_path / "inside.ckpt"
    assert folder.is_dir()
    # A strategy that reads single files (before: IsADirectoryError).
    with pytest.raises(
        ValueError,
        match=re.escape(f"`ckpt_path={str(folder)!r}` is a sharded (distributed) checkpoint folder;")
        + r" AccumulationStrategy reads single files only\. "
        + _WAY_OUT,
    ):
        _resume(folder, "accum", 2)
    # One shard cut in half (before: torch's CheckpointException around "failed reading zip archive"), and cut to 90 %:
    # Lightning's read of the model and the optimizer then succeeds, and the package's own read of the open group's
    # gradient, stored last, fails (before: torch's CheckpointException around the same zip error, not named): both
    # named with the folder's size and torch's error.
    for name, kept in (("cut.ckpt", 0.5), ("cut90.ckpt", 0.9)):
        shutil.copytree(folder, tmp_path / name)
        shard = max((tmp_path / name).glob("*.distcp"), key=lambda p: p.stat().st_size)
        shard.write_bytes(shard.read_bytes()[: int(shard.stat().st_size * kept)])
    run_ddp(_read_on_one_device, str(tmp_path), world_size=1)
    said = json.loads((tmp_path / "said.json").read_text())
    # On one device the folder resumes into a model sharded on its mesh of one ...
    assert said["sharded model"] == "resumed: 11 micro-batches", said  # 2 x 2, then 2 carried + 1, then 2 x 2
    # ... and a model left whole gets what to do (before: Lightning's "Could not find a distributed model").
    assert re.search(
        r"is a sharded \(distributed\) checkpoint folder, and this run's model has no sharded \(DTensor\) parameter on"
        r" its 1 device\(s\) \(Lightning: 'Could not find a distributed model'\)\. " + _WAY_OUT,
        said["unsharded model"],
    ), said
    for name, case in (("cut.ckpt", "shard cut short"), ("cut90.ckpt", "shard cut to 90 %")):
        files = [p for p in (tmp_path / name).rglob("*") if p.is_file()]
        size = f"a folder of {len(files)} file(s), {sum(p.stat().st_size for p in files)} byte(s)"
        # The folder, its size and torch's own error (which names the failed read of the shard).
        assert said[case].startswith(f"`ckpt_path={str(tmp_path / name)!r}` ({size}) cannot be read: "), said
        assert said[case].endswith("(from CheckpointException)"), said
