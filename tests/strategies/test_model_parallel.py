"""FSDP2 and tensor parallelism on Lightning's ModelParallelStrategy, 2 processes over gloo on CPU: the sharded runs
equal the single-process run of the same groups (D = data-parallel replicas, tokens counted once per replica), and
plain ModelParallelStrategy on the same data does not."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import (
    IGNORE,
    ListDataset,
    RankStridedSampler,
    ResumableLoader,
    full_params,
    launch_env,
    make_examples,
    make_trainer,
    relative_error,
    run_ddp,
    torchrun_two_nodes,
)
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor, nn
from torch.utils.data import DataLoader

import lightning_accum
from lightning_accum import (
    AccumulationCheck,
    AccumulationLedger,
    AccumulationReport,
    ModelParallelAccumulationStrategy,
)
from lightning_accum.core.reading import LIGHTNING_TAKES_REMOTE_FOLDERS

WIDTH = 12  # vocabulary rows and logits (the data's ids and labels stay below helpers.VOCAB = 11)
# Even positions go to data-parallel rank 0, odd ones to rank 1: rank 0 holds the long sequences.
UNEQUAL = [6, 1, 5, 2, 6, 1, 4, 1, 6, 2, 5, 1, 6, 1, 3, 2, 6, 1, 5, 1]
CLIP = 0.2  # below the first update's gradient norm (0.48): clipping acts on the sharded gradient
# AdamW (with clipping) as users run it; SGD (without) as well, since AdamW hides a wrong overall gradient scale.
OPTIMIZERS = {"adamw": (0.05, CLIP), "sgd": (0.5, None)}


class ShardedLM(L.LightningModule):
    """Embedding, a residual MLP and a head; `configure_model` shards it with FSDP2 (`layout="fsdp"`), tensor
    parallelism (`"tp"`), both (`"2d"`) or not at all (`None`, and always on one device)."""

    def __init__(
        self, layout: str | None = None, seed: int = 5, optimizer: str = "adamw", nan_in_group: int | None = None
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layout = layout
        self.optimizer = optimizer
        self.nan_in_group = nan_in_group  # that group's gradient gets a NaN in the last embedding row only
        self.embed = nn.Embedding(WIDTH, 8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.head = nn.Linear(8, WIDTH)

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if mesh is None or self.layout is None:
            return
        if self.layout in ("fsdp", "2d"):
            if self.layout == "2d":
                self._tensor_parallel(mesh["tensor_parallel"])
            from torch.distributed.fsdp import fully_shard

            for module in (self.embed, self.up, self.down, self.head):
                fully_shard(module, mesh=mesh["data_parallel"])
        else:
            self._tensor_parallel(mesh["tensor_parallel"])

    def _tensor_parallel(self, mesh: Any) -> None:
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {
            "embed": RowwiseParallel(input_layouts=Replicate()),
            "up": ColwiseParallel(),
            "down": RowwiseParallel(),
            "head": ColwiseParallel(output_layouts=Replicate()),
        }
        parallelize_module(self, mesh, plan)  # type: ignore[arg-type]

    def forward(self, input_ids: Tensor) -> Tensor:
        h = torch.tanh(self.embed(input_ids))
        return self.head(h + self.down(torch.tanh(self.up(h))))

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Any:
        logits = self(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE)
        if self.nan_in_group is not None and batch_idx // self.trainer.accumulate_grad_batches == self.nan_in_group:
            # Only the last row's gradient is NaN: after FSDP2's reduce-scatter it sits in the last rank's shard alone.
            last_row = self.embed(torch.tensor([WIDTH - 1], device=self.device))
            loss = loss + (last_row * float("nan")).sum()
        return {"loss": loss, "num_tokens": (batch["labels"] != IGNORE).sum()}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        lr = OPTIMIZERS[self.optimizer][0]
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=lr)
        return torch.optim.AdamW(self.parameters(), lr=lr)


class Record(L.Callback):
    """Saves rank `r`'s gathered parameters and ledger to `folder/name-rank{r}.pt`."""

    def __init__(self, folder: str, name: str) -> None:
        self.folder, self.name = folder, name

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        params = full_params(pl_module)
        ledger = getattr(trainer.strategy, "ledger", None)
        state = {"params": params, "ledger": ledger.state_dict() if ledger is not None else None}
        torch.save(state, os.path.join(self.folder, f"{self.name}-rank{trainer.global_rank}.pt"))


def _fit(
    model: ShardedLM,
    examples: list[dict[str, Tensor]],
    strategy: Any,
    batch_size: int,
    accumulate: int,
    devices: int,
    callbacks: list[L.Callback],
    split: bool,
) -> L.Trainer:
    trainer = make_trainer(
        strategy=strategy,
        devices=devices,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=OPTIMIZERS[model.optimizer][1],
        callbacks=callbacks,
    )
    sampler = RankStridedSampler(len(examples)) if split else None
    trainer.fit(model, DataLoader(ListDataset(examples), batch_size=batch_size, sampler=sampler))
    return trainer


def _load(folder: str, name: str) -> list[dict[str, Any]]:
    return [torch.load(os.path.join(folder, f"{name}-rank{r}.pt"), weights_only=True) for r in range(2)]


def _counts(ledger: dict[str, Any]) -> dict[str, Any]:
    """The ledger's exact counters (the group loss is a float, compared with a tolerance elsewhere)."""
    state = AccumulationLedger()
    state.load_state_dict(ledger)
    out = state.state_dict()
    last = out.pop("last_group")
    out["last_group_counts"] = {k: v for k, v in last.items() if k != "loss"}
    return out


def _single(folder: str, examples: list[dict[str, Tensor]], accumulate: int, optimizer: str) -> dict[str, Any]:
    """The single-process run of the same groups (batch 2, `accumulate` micro-batches)."""
    name = f"single-{optimizer}"
    _fit(ShardedLM(optimizer=optimizer), examples, "accum", 2, accumulate, 1, [Record(folder, name)], split=False)
    return torch.load(os.path.join(folder, f"{name}-rank0.pt"), weights_only=True)


# (gradient_sync, optimizer) of the FSDP2 runs
FSDP_RUNS = [("every_microbatch", "adamw"), ("last_microbatch", "adamw"), ("every_microbatch", "sgd")]


def _fsdp_runs(rank: int, folder: str) -> None:
    examples = make_examples(UNEQUAL, seed=8)
    for mode, optimizer in FSDP_RUNS:
        name = f"{mode}-{optimizer}"
        strategy = ModelParallelAccumulationStrategy(tensor_parallel_size=1, gradient_sync=mode)
        callbacks: list[L.Callback] = [Record(folder, name), AccumulationReport(path=os.path.join(folder, name))]
        check = AccumulationCheck()  # the pre-flight check on sharded gradients; it leaves the run unchanged
        if optimizer == "sgd":
            callbacks.append(check)
        with warnings.catch_warnings(record=True):  # the check names the test's own (non-distributed) sampler
            _fit(ShardedLM("fsdp", optimizer=optimizer), examples, strategy, 2, 2, 2, callbacks, split=True)
        if check.result is not None:
            result = {"relative_error": check.result.relative_error, "errors": check.result.errors}
            torch.save(result, os.path.join(folder, f"check-rank{rank}.pt"))
    plain = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    _fit(ShardedLM("fsdp"), examples, plain, 2, 2, 2, [Record(folder, "plain")], split=True)
    # A NaN in the second group's gradient, in rank 1's shard only: both ranks skip that update.
    model = ShardedLM("fsdp", optimizer="sgd", nan_in_group=1)
    with warnings.catch_warnings(record=True):
        _fit(model, examples[:8], "accum_fsdp", 2, 1, 2, [Record(folder, "nan")], split=True)


def _tp_runs(rank: int, folder: str) -> None:
    examples = make_examples(UNEQUAL[:18], seed=9)
    for optimizer in OPTIMIZERS:
        name = f"tp-{optimizer}"
        callbacks: list[L.Callback] = [Record(folder, name), AccumulationReport(path=os.path.join(folder, name))]
        _fit(ShardedLM("tp", optimizer=optimizer), examples, "accum_model_parallel", 2, 2, 2, callbacks, split=False)
    try:  # a module whose configure_model shards nothing
        _fit(ShardedLM(None), examples, "accum_fsdp", 2, 2, 2, [], split=False)
    except RuntimeError as error:
        torch.save(str(error), os.path.join(folder, f"unsharded-rank{rank}.pt"))


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_fsdp2_matches_the_single_process_run_in_both_sync_modes_and_plain_lightning_does_not(tmp_path: Path) -> None:
    # m = 2, A = 2, D = 2 over 20 examples: per replica 5 micro-batches, groups of 2, 2 and a partial 1; on one
    # process m = 2, A = 4: groups 0-7, 8-15 and the partial 16-19, the same examples. AdamW, clipping at 0.5.
    run_ddp(_fsdp_runs, str(tmp_path))
    examples = make_examples(UNEQUAL, seed=8)
    singles = {name: _single(str(tmp_path), examples, 4, name) for name in OPTIMIZERS}
    assert singles["adamw"]["ledger"]["partial_groups"] == 1 and singles["adamw"]["ledger"]["updates_applied"] == 3

    for mode, optimizer in FSDP_RUNS:
        name, single = f"{mode}-{optimizer}", singles[optimizer]
        for rank in _load(str(tmp_path), name):
            assert relative_error(rank["params"], single["params"]) < 1e-5, name
            assert _counts(rank["ledger"]) == _counts(single["ledger"]), name
            assert rank["ledger"]["last_group"]["loss"] == pytest.approx(single["ledger"]["last_group"]["loss"])
        report = json.loads((tmp_path / name / "accumulation_report.json").read_text())
        assert report["data_parallel_replicas"] == 2 and report["tensor_parallel_size"] == 1
        assert report["effective_batch"]["arithmetic"] == "2 × 2 × 2 = 8"
        assert report["tokens"]["total"] == sum(UNEQUAL)

    for rank in range(2):  # AccumulationCheck on sharded gradients: one update equals the same examples in one batch
        check = torch.load(tmp_path / f"check-rank{rank}.pt", weights_only=True)
        assert check["errors"] == [] and check["relative_error"] < 1e-5

    plain = _load(str(tmp_path), "plain")[0]
    error = relative_error(plain["params"], singles["adamw"]["params"])
    assert error > 1e-3, error  # mean of micro-batch means, the partial group at k/A: a different update

    # The NaN was in rank 1's shard only; rank 0 knows it too (the check is summed over the mesh).
    nan_runs = _load(str(tmp_path), "nan")
    for rank in nan_runs:
        assert rank["ledger"]["updates_skipped"]["nonfinite"] == 1 and rank["ledger"]["updates_applied"] == 1
    assert torch.equal(nan_runs[0]["params"], nan_runs[1]["params"]) and bool(
        torch.isfinite(nan_runs[0]["params"]).all()
    )


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_tensor_parallel_counts_tokens_once_with_d_equal_one(tmp_path: Path) -> None:
    # dp = 1, tp = 2: both ranks read every batch. 18 examples, m = 2, A = 2: 4 groups and a partial one.
    run_ddp(_tp_runs, str(tmp_path))
    examples = make_examples(UNEQUAL[:18], seed=9)
    for optimizer in OPTIMIZERS:
        single = _single(str(tmp_path), examples, 2, optimizer)
        ranks = _load(str(tmp_path), f"tp-{optimizer}")
        for rank in ranks:
            assert relative_error(rank["params"], single["params"]) < 1e-5, optimizer
            assert _counts(rank["ledger"]) == _counts(single["ledger"]), optimizer
        assert ranks[0]["ledger"]["tokens"] == sum(UNEQUAL[:18])  # not twice: the two devices share one replica
        assert ranks[0]["ledger"]["partial_groups"] == 1
    report = json.loads((tmp_path / "tp-adamw" / "accumulation_report.json").read_text())
    unsharded = torch.load(tmp_path / "unsharded-rank0.pt", weights_only=True)
    assert "after `ShardedLM.configure_model()` no parameter is sharded" in unsharded
    assert report["data_parallel_replicas"] == 1 and report["tensor_parallel_size"] == 2
    assert report["effective_batch"]["arithmetic"] == "2 × 2 × 1 = 4; tensor parallel 2 (devices sharing one replica)"


class SaveAt(L.Callback):
    """Writes a checkpoint after micro-batch `batch_idx` of epoch 0, or at its end (every rank takes part)."""

    def __init__(self, path: str, batch_idx: int | None = None) -> None:
        self.path, self.batch_idx = path, batch_idx

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.current_epoch == 0 and args[-1] == self.batch_idx:
            trainer.save_checkpoint(self.path)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == 0 and self.batch_idx is None:
            trainer.save_checkpoint(self.path)


def _checkpoint_runs(rank: int, folder: str) -> None:
    examples = make_examples(UNEQUAL[:16], seed=3)

    def fit(
        name: str,
        distributed: bool,
        epochs: int,
        callbacks: list[L.Callback],
        ckpt: str | None = None,
        sync: str = "every_microbatch",
    ) -> None:
        strategy = ModelParallelAccumulationStrategy(
            tensor_parallel_size=1, save_distributed_checkpoint=distributed, gradient_sync=sync
        )
        trainer = make_trainer(
            strategy=strategy,
            devices=2,
            accumulate_grad_batches=2,
            max_epochs=epochs,
            callbacks=[Record(folder, name), *callbacks],
        )
        loader = ResumableLoader(ListDataset(examples), batch_size=2, sampler=RankStridedSampler(len(examples)))
        trainer.fit(ShardedLM("fsdp", optimizer="adamw"), loader, ckpt_path=ckpt)

    for distributed in (True, False):
        kind = "sharded" if distributed else "full"
        path = os.path.join(folder, f"{kind}.ckpt")
        # Two epochs of 2 updates each; the checkpoint is written at the end of epoch 0 (an update boundary).
        fit(f"whole-{kind}", distributed, 2, [SaveAt(path)])
        fit(f"resumed-{kind}", distributed, 2, [], ckpt=path)
    # Inside a group (after the first micro-batch of epoch 0's second group): carried under every_microbatch ...
    path = os.path.join(folder, "inside.ckpt")
    fit("inside", True, 2, [SaveAt(path, batch_idx=2)])
    fit("inside-resumed", True, 2, [], ckpt=path)
    # ... and said to be lost under last_microbatch, when writing and when resuming.
    path = os.path.join(folder, "inside-last.ckpt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit("inside-last", True, 1, [SaveAt(path, batch_idx=2)], sync="last_microbatch")
        fit("inside-last-resumed", True, 1, [], ckpt=path, sync="last_microbatch")
    torch.save([str(w.message) for w in caught], os.path.join(folder, f"inside-warnings-rank{rank}.pt"))


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_checkpoints_carry_the_ledger_and_the_open_group_and_resume_exactly(tmp_path: Path) -> None:
    run_ddp(_checkpoint_runs, str(tmp_path))
    assert (tmp_path / "sharded.ckpt").is_dir() and (tmp_path / "full.ckpt").is_file()
    for kind in ("sharded", "full"):
        whole, resumed = _load(str(tmp_path), f"whole-{kind}"), _load(str(tmp_path), f"resumed-{kind}")
        for a, b in zip(whole, resumed, strict=True):
            assert relative_error(b["params"], a["params"]) < 1e-6, kind
            assert _counts(b["ledger"]) == _counts(a["ledger"]), kind
        assert resumed[0]["ledger"]["updates_applied"] == 4 and resumed[0]["ledger"]["tokens"] == 2 * sum(UNEQUAL[:16])

    # Written inside a group under every_microbatch: the resumed run equals the uninterrupted one.
    whole, inside = _load(str(tmp_path), "whole-sharded"), _load(str(tmp_path), "inside-resumed")
    for a, b in zip(whole, inside, strict=True):
        assert relative_error(b["params"], a["params"]) < 1e-6
        assert _counts(b["ledger"]) == _counts(a["ledger"])

    said = " ".join(torch.load(tmp_path / "inside-warnings-rank0.pt", weights_only=True))
    assert "under gradient_sync='last_microbatch' the group's gradient is held unreduced inside FSDP2" in said
    assert "resumed inside an accumulation group, but the checkpoint does not carry" in said
    ledger = _load(str(tmp_path), "inside-last-resumed")[0]["ledger"]
    assert ledger["microbatches"] == 8 - 2  # the epoch's 8 micro-batches, less the one lost on each replica


def _remote_runs(rank: int, folder: str) -> None:
    # One process (FSDP2 over one device): a checkpoint written inside a group into a sharded folder at an fsspec URL
    # (in-memory storage, and a `file://` URL), resumed from that URL.
    examples = make_examples(UNEQUAL[:8], seed=3)

    def fit(name: str, callbacks: list[L.Callback], ckpt: str | None = None) -> None:
        strategy = ModelParallelAccumulationStrategy(tensor_parallel_size=1, save_distributed_checkpoint=True)
        trainer = make_trainer(
            strategy=strategy, devices=1, accumulate_grad_batches=2, max_epochs=2, callbacks=[Record(folder, name)]
        )
        trainer.callbacks.extend(callbacks)
        loader = ResumableLoader(ListDataset(examples), batch_size=2, sampler=RankStridedSampler(len(examples)))
        trainer.fit(ShardedLM("fsdp", optimizer="adamw"), loader, ckpt_path=ckpt)

    fit("whole", [])
    for url in ("memory://accum/inside.ckpt", f"file://{folder}/inside.ckpt"):
        kind = url.split(":")[0]
        if not LIGHTNING_TAKES_REMOTE_FOLDERS:
            # A Lightning whose model-parallel strategy takes local paths only (2.6): refused, nothing written.
            with pytest.raises(ValueError, match=r"inside.ckpt'.*local paths only.*Give a local path"):
                fit(f"inside-{kind}", [SaveAt(url, batch_idx=2)])
            continue
        fit(f"inside-{kind}", [SaveAt(url, batch_idx=2)])
        fit(f"resumed-{kind}", [], ckpt=url)


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_a_mid_group_sharded_save_at_an_fsspec_url_resumes_exactly_where_lightning_takes_one(tmp_path: Path) -> None:
    run_ddp(_remote_runs, str(tmp_path), world_size=1)
    whole = torch.load(tmp_path / "whole-rank0.pt", weights_only=True)
    if not LIGHTNING_TAKES_REMOTE_FOLDERS:
        assert not (tmp_path / "inside.ckpt").exists() and not Path("file:").exists() and not Path("memory:").exists()
        return
    assert (tmp_path / "inside.ckpt" / "meta.pt").is_file()  # the file:// URL is the local folder
    for kind in ("memory", "file"):
        resumed = torch.load(tmp_path / f"resumed-{kind}-rank0.pt", weights_only=True)
        assert relative_error(resumed["params"], whole["params"]) < 1e-6, kind
        assert _counts(resumed["ledger"]) == _counts(whole["ledger"]), kind


def test_strategy_strings_sizes_and_argument_errors() -> None:
    assert "accum_fsdp" in lightning_accum.strategies.StrategyRegistry
    fsdp = make_trainer(strategy="accum_fsdp", devices=2).strategy
    assert isinstance(fsdp, ModelParallelAccumulationStrategy) and fsdp.gradient_sync == "every_microbatch"
    assert fsdp.tensor_parallel_size == 1
    with pytest.raises(ValueError, match=r"`gradient_sync` must be one of 'every_microbatch', 'last_microbatch', got"):
        ModelParallelAccumulationStrategy(gradient_sync="never")
    with pytest.raises(ValueError, match=r"`tensor_parallel_size` must be 'auto' or an int ≥ 1, got 0"):
        ModelParallelAccumulationStrategy(tensor_parallel_size=0)


class DataParallelStridedSampler(RankStridedSampler):
    """Data-parallel rank `r` of `D` reads examples r, r + D, ...; the ranks of one tensor-parallel group alike."""

    def __init__(self, length: int, tensor_parallel: int) -> None:
        super().__init__(length)
        self.tensor_parallel = tensor_parallel

    def _layout(self) -> tuple[int, int]:
        rank, world = super()._layout()
        return (
            rank // self.tensor_parallel,
            world // self.tensor_parallel,
        )  # the mesh is (data_parallel, tensor_parallel)


def _two_d_run(rank: int, folder: str) -> None:
    examples = make_examples(UNEQUAL, seed=8)
    strategy = ModelParallelAccumulationStrategy(data_parallel_size=2, tensor_parallel_size=2)
    report = AccumulationReport(path=os.path.join(folder, "2d"))
    trainer = make_trainer(
        strategy=strategy,
        devices=4,
        accumulate_grad_batches=2,
        gradient_clip_val=CLIP,
        callbacks=[Record(folder, "2d"), report],
    )
    sampler = DataParallelStridedSampler(len(examples), tensor_parallel=2)
    trainer.fit(ShardedLM("2d"), DataLoader(ListDataset(examples), batch_size=2, sampler=sampler))


@pytest.mark.ddp
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fsdp2_with_tensor_parallel_on_four_processes_matches_the_single_process_run(tmp_path: Path) -> None:
    # dp = 2 × tp = 2: the same groups as the FSDP2 test (m = 2, A = 2, D = 2; on one process A = 4).
    run_ddp(_two_d_run, str(tmp_path), world_size=4)
    single = _single(str(tmp_path), make_examples(UNEQUAL, seed=8), 4, "adamw")
    ranks = [torch.load(tmp_path / f"2d-rank{r}.pt", weights_only=True) for r in range(4)]
    for rank in ranks:
        assert relative_error(rank["params"], single["params"]) < 1e-5
        assert _counts(rank["ledger"]) == _counts(single["ledger"])
    report = json.loads((tmp_path / "2d" / "accumulation_report.json").read_text())
    assert report["effective_batch"]["arithmetic"] == "2 × 2 × 2 = 8; tensor parallel 2 (devices sharing one replica)"


@pytest.mark.ddp
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_torchrun_two_nodes_one_process_each_with_accum_fsdp(tmp_path: Path) -> None:
    out, env = tmp_path / "torchrun.pt", launch_env()
    # This checkout's package, whatever copy the interpreter has installed.
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    torchrun_two_nodes(Path(__file__).resolve().parents[1] / "model_parallel_launch_script.py", str(out), env=env)
    result = torch.load(out, weights_only=True)
    assert (result["replicas"], result["world_size"]) == (2, 2)
    single = _single(str(tmp_path), make_examples(UNEQUAL, seed=8), 4, "adamw")
    assert relative_error(result["params"], single["params"]) < 1e-5
    assert _counts(result["ledger"]) == _counts(single["ledger"])
