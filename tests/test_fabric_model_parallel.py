"""Fabric's ModelParallelStrategy with exact accumulation (`FabricModelParallelAccumulationStrategy`, "accum_fsdp"):
FSDP2 on 2 processes and FSDP2 × tensor parallelism on 4, over gloo on CPU, against a float64 one-device reference
computed here (a float64 model under "32-true": Fabric refuses "64-true" with this strategy), at several (m, A, D)
with unequal token counts per replica: no_backward_sync, clipping, a NaN in one rank's shard, clear errors for a bad
set-up, and a mid-group `fabric.save` / `fabric.load` (sharded folder and full file) resumed 2 → 2, 2 → 1 and 1 → 2."""

from __future__ import annotations

import datetime
import itertools
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import IGNORE, VOCAB, ListDataset, make_examples, make_trainer, random_lengths, run_ddp
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_accum import FabricModelParallelAccumulationStrategy
from lightning_accum.core.entry import CHECKPOINT_KEY, DISTRIBUTED_KEY

EXAMPLES = make_examples(random_lengths(24, seed=44), seed=44)  # unequal lengths: the ranks' token counts differ
GROUP = 8  # examples per update, whatever the split: 3 updates
LR, MOMENTUM = 0.5, 0.9  # SGD with momentum: a wrong gradient scale shows, and the optimizer has state to resume
CLIP = 0.05  # below every update's gradient norm: clipping acts


class Blocks(nn.Module):
    """An embedding, a `ModuleList` of two residual MLP blocks and a head; `forward(ids, nan_row=True)` also returns a
    term whose gradient is NaN in the embedding's last row only (after FSDP2's reduce-scatter: one rank's shard)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.embed = nn.Embedding(VOCAB, 8)
        self.blocks = nn.ModuleList([_Block() for _ in range(2)])
        self.head = nn.Linear(8, VOCAB)

    def forward(self, input_ids: Tensor, nan_row: bool = False) -> Any:
        h = torch.tanh(self.embed(input_ids))
        for block in self.blocks:
            h = h + block(h)
        if not nan_row:
            return self.head(h)
        last_row = self.embed(torch.full((1,), VOCAB - 1, device=input_ids.device))
        return self.head(h), (last_row * float("nan")).sum()


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, h: Tensor) -> Tensor:
        return self.down(torch.tanh(self.up(h)))


def _fsdp_over_tp(model: nn.Module, mesh: Any) -> nn.Module:
    """A user's `parallelize_fn` for dp × tp: each block's MLP column- then row-wise over the tensor-parallel mesh,
    the embedding and head left whole, then FSDP2 over the data-parallel mesh (mixed DTensor meshes)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in model.blocks:  # type: ignore[union-attr]
        parallelize_module(block, mesh["tensor_parallel"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def _stack(examples: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    return {key: torch.stack([e[key] for e in examples]) for key in examples[0]}


def _sum_loss(model: nn.Module, examples: list[dict[str, Tensor]]) -> Tensor:
    batch = _stack(examples)
    logits = model(batch["input_ids"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE, reduction="sum")


def reference(groups: list[list[int]], clip: float | None = None, skip: tuple[int, ...] = ()) -> dict[str, Tensor]:
    """float64 on one device, outside the package: per group of example indices, the gradient of Σ token losses / N
    (N: the group's supervised tokens), clipped by torch's `clip_grad_norm_`, and one SGD update (none for `skip`)."""
    model = Blocks().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for g, indices in enumerate(groups):
        if g in skip:
            continue
        examples = [EXAMPLES[i] for i in indices]
        tokens = sum(int((e["labels"] != IGNORE).sum()) for e in examples)
        optimizer.zero_grad()
        (_sum_loss(model, examples) / tokens).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _whole_groups() -> list[list[int]]:
    return [list(range(start, start + GROUP)) for start in range(0, len(EXAMPLES), GROUP)]


def _plan(dp_rank: int, dp: int, m: int, start: int) -> list[list[dict[str, Tensor]]]:
    """Per group of the examples from `start` (the first one ends at the one-device group's end): this data-parallel
    rank's micro-batches of `m` (rank r reads every dp-th example)."""
    bounds = [start, *range((start // GROUP + 1) * GROUP, len(EXAMPLES), GROUP), len(EXAMPLES)]
    groups = []
    for first, end in itertools.pairwise(bounds):
        mine = EXAMPLES[first:end][dp_rank::dp]
        groups.append([_stack(mine[i : i + m]) for i in range(0, len(mine), m)])
    return groups


# ---------------------------------------------------------------------------------------------- the worker's parts


def _fabric(strategy: Any = "accum_fsdp", devices: int = 2) -> L.Fabric:
    fabric = L.Fabric(strategy=strategy, devices=devices, accelerator="cpu")
    fabric.launch()  # the processes exist (run_ddp): sets up the process group and the mesh
    return fabric


def _setup(fabric: L.Fabric) -> tuple[Any, Any]:
    model = fabric.setup_module(Blocks().double())  # float64 under "32-true": the reference's precision
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM))
    return model, optimizer


def _train(
    fabric: L.Fabric,
    model: Any,
    optimizer: Any,
    groups: list[list[dict[str, Tensor]]],
    sync: bool = False,
    clip: float | None = None,
    nan_at: tuple[int, int] | None = None,
    save_at: tuple[int, int, str] | None = None,
) -> None:
    """LitGPT's loop: `sync` runs every backward with synchronisation (else non-final ones inside
    `no_backward_sync`); `nan_at = (group, micro-batch)` of data-parallel rank 0 adds the NaN row; `save_at = (group,
    micro-batches, path)` saves there and stops."""
    dp_rank = fabric.strategy.device_mesh["data_parallel"].get_local_rank()  # type: ignore[attr-defined]
    for g, group in enumerate(groups):
        for i, batch in enumerate(group):
            last = i == len(group) - 1
            with fabric.no_backward_sync(model, enabled=not (last or sync)):
                poisoned = nan_at == (g, i) and dp_rank == 0
                out = model(batch["input_ids"], nan_row=True) if poisoned else model(batch["input_ids"])
                logits, extra = out if poisoned else (out, 0.0)
                loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE)
                tokens = (batch["labels"] != IGNORE).sum()
                fabric.backward(fabric.strategy.accumulate(loss + extra, num_tokens=tokens, batch=batch))
            if save_at is not None and (g, i + 1) == save_at[:2]:
                fabric.save(save_at[2], {"model": model, "optimizer": optimizer})
                return
        fabric.strategy.close_group(optimizer)
        if clip is not None:
            fabric.clip_gradients(model, optimizer, max_norm=clip)
        optimizer.step()
        optimizer.zero_grad()


def _result(fabric: L.Fabric, model: Any, **extra: Any) -> dict[str, Any]:
    """The parameters gathered whole (a collective), by name, and the ledger."""
    params = {}
    for name, p in model.module.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        params[name] = full.detach().cpu().to(torch.float64)
    return {"params": params, "ledger": fabric.strategy.ledger.state_dict(), **extra}  # type: ignore[attr-defined]


def _error(call: Callable[[], Any]) -> str:
    try:
        call()
    except (RuntimeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _save(folder: str, name: str, result: dict[str, Any]) -> None:
    torch.save(result, os.path.join(folder, f"{name}-rank{torch.distributed.get_rank()}.pt"))


def _load(folder: Path, name: str) -> dict[str, Any]:
    return torch.load(folder / f"{name}-rank0.pt", weights_only=True)  # type: ignore[no-any-return]


def _assert_params(result: dict[str, Any], expected: dict[str, Tensor]) -> None:
    assert result["params"].keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(result["params"][name], value, rtol=0, atol=1e-12, msg=name)


# ---------------------------------------------------------------------------------------------- FSDP2 on 2 processes


def _fsdp_worker(rank: int, folder: str) -> None:
    from torch.distributed.fsdp import FSDPModule

    # "accum_fsdp" (its default parallelize_fn), m = 1, A = 4, every backward synchronised.
    fabric = _fabric()
    model, optimizer = _setup(fabric)
    units = sorted(name for name, module in model.module.named_modules() if isinstance(module, FSDPModule))
    _train(fabric, model, optimizer, _plan(rank, 2, 1, 0), sync=True)
    _save(folder, "every-backward", _result(fabric, model, units=units))
    # m = 2, A = 2: the non-final micro-batches inside no_backward_sync, the group's gradient clipped after the close.
    fabric = _fabric()
    model, optimizer = _setup(fabric)
    _train(fabric, model, optimizer, _plan(rank, 2, 2, 0), clip=CLIP)
    _save(folder, "no-sync-clipped", _result(fabric, model))
    # m = 1, A = 4: a NaN in group 1's second micro-batch of rank 0, which lands in rank 1's shard only.
    fabric = _fabric()
    model, optimizer = _setup(fabric)
    _train(fabric, model, optimizer, _plan(rank, 2, 1, 0), nan_at=(1, 1))
    _save(folder, "nan", _result(fabric, model))
    _save(folder, "errors", _errors(rank))


def _errors(rank: int) -> dict[str, str]:
    """What a bad set-up or loop gets (each an error on every rank, before any collective)."""
    errors = {}
    fabric, model = _fabric(), Blocks().double()
    errors["optimizer first"] = _error(lambda: fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR)))
    unsharded = FabricModelParallelAccumulationStrategy(lambda module, mesh: module, tensor_parallel_size=1)
    errors["unsharded"] = _error(lambda: _fabric(unsharded).setup_module(Blocks()))
    fabric = _fabric()
    model, optimizer = _setup(fabric)
    batch = _plan(rank, 2, 2, 0)[0][0]
    with fabric.no_backward_sync(model, enabled=True):  # the group's last backward, without synchronisation
        loss = F.cross_entropy(model(batch["input_ids"]).flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE)
        fabric.backward(fabric.strategy.accumulate(loss, num_tokens=(batch["labels"] != IGNORE).sum()))
    errors["clip inside"] = _error(lambda: fabric.clip_gradients(model, optimizer, max_norm=CLIP))
    errors["last unsynced"] = _error(lambda: fabric.strategy.close_group(optimizer))
    return errors


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("fsdp")
    run_ddp(_fsdp_worker, str(folder))
    return folder


TOKENS = sum(int((e["labels"] != IGNORE).sum()) for e in EXAMPLES)


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_fsdp2_on_two_processes_matches_the_float64_reference_at_two_splits(fsdp_runs: Path) -> None:
    # (m, A, D) = (1, 4, 2) with every backward reduce-scattered, and (2, 2, 2) with no_backward_sync and clipping.
    run = _load(fsdp_runs, "every-backward")
    assert run["units"] == ["", "blocks.0", "blocks.1"]  # "accum_fsdp": each block of the ModuleList, and the root
    _assert_params(run, reference(_whole_groups()))
    ledger = run["ledger"]
    assert (ledger["updates_applied"], ledger["microbatches"], ledger["samples"], ledger["tokens"]) == (
        3,
        24,
        24,
        TOKENS,
    )
    clipped = _load(fsdp_runs, "no-sync-clipped")
    _assert_params(clipped, reference(_whole_groups(), clip=CLIP))
    assert clipped["ledger"]["microbatches"] == 12 and clipped["ledger"]["tokens"] == TOKENS
    # The clip acts: the unclipped update is far from it.
    unclipped = reference(_whole_groups())
    assert max(float((clipped["params"][k] - v).abs().max()) for k, v in unclipped.items()) > 1e-2


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_a_nan_in_one_ranks_shard_skips_the_update_on_every_rank(fsdp_runs: Path) -> None:
    ranks = [torch.load(fsdp_runs / f"nan-rank{r}.pt", weights_only=True) for r in range(2)]
    for run in ranks:
        skipped = {reason: n for reason, n in run["ledger"]["updates_skipped"].items() if n}
        assert skipped == {"nonfinite": 1} and run["ledger"]["updates_applied"] == 2
        _assert_params(run, reference(_whole_groups(), skip=(1,)))


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_a_bad_set_up_or_loop_is_a_clear_error(fsdp_runs: Path) -> None:
    errors = _load(fsdp_runs, "errors")
    assert errors["optimizer first"].startswith("ValueError: The optimizer (SGD) holds none of the parameters")
    assert "Build the optimizer after `model = fabric.setup_module(model)`" in errors["optimizer first"]
    assert errors["unsharded"].startswith("RuntimeError: FabricModelParallelAccumulationStrategy runs on 2 devices")
    assert "after the `parallelize_fn` no parameter is sharded" in errors["unsharded"]
    assert "inside an open accumulation group (1 micro-batch(es) reported)" in errors["clip inside"]
    assert "the group's last backward ran with gradient synchronisation blocked" in errors["last unsynced"]


class _ManualBlocks(L.LightningModule):
    """The Trainer's manual door to the same loop: one `training_step` runs a group of `3 - rank` micro-batches and
    closes it (the loader's batch is only the step's occasion)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = Blocks().double()

    def configure_model(self) -> None:
        from lightning_accum.fabric_model_parallel import shard_module_lists

        shard_module_lists(self.net, self.device_mesh)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        strategy, optimizer = self.trainer.strategy, self.optimizers()
        for micro in _plan(self.global_rank, 2, 1, 0)[0][: 3 - self.global_rank]:
            logits = self.net(micro["input_ids"])
            loss = F.cross_entropy(logits.flatten(0, 1), micro["labels"].flatten(), ignore_index=IGNORE)
            self.manual_backward(strategy.accumulate(loss, num_tokens=(micro["labels"] != IGNORE).sum()))  # type: ignore[attr-defined]
        strategy.close_group(optimizer)  # type: ignore[attr-defined]
        optimizer.step()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.net.parameters(), lr=LR)


def _unequal_counts_worker(rank: int, folder: str, door: str) -> None:
    """Rank 0 runs a micro-batch more than rank 1 in the group, every backward reduce-scattered, then both close it,
    under a process-group timeout of 5 s (the processes start together first: the timeout bounds the mismatch only)."""
    from lightning_accum import ModelParallelAccumulationStrategy
    from lightning_accum.fabric_model_parallel import shard_module_lists

    Path(folder, f"ready{rank}").touch()
    deadline = time.monotonic() + 120
    while not Path(folder, f"ready{1 - rank}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    timeout = datetime.timedelta(seconds=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if door == "fabric":
            strategy = FabricModelParallelAccumulationStrategy(
                shard_module_lists, tensor_parallel_size=1, timeout=timeout
            )
            fabric = _fabric(strategy)
            model, optimizer = _setup(fabric)
            group = _plan(rank, 2, 1, 0)[0][: 3 - rank]
            error = _error(lambda: _train(fabric, model, optimizer, [group], sync=True))
        else:
            trainer = make_trainer(
                strategy=ModelParallelAccumulationStrategy(tensor_parallel_size=1, timeout=timeout), devices=2
            )
            error = _error(lambda: trainer.fit(_ManualBlocks(), DataLoader(ListDataset(EXAMPLES[:1]))))
    said = [str(w.message) for w in caught if "lightning_accum: a collective failed" in str(w.message)]
    _save(folder, "unequal", {"error": error, "warnings": said})


@pytest.mark.ddp
@pytest.mark.timeout(300)
@pytest.mark.parametrize("door", ["fabric", "trainer"])
def test_a_micro_batch_more_on_one_rank_ends_at_the_timeout_with_the_cause_named(tmp_path: Path, door: str) -> None:
    start = time.monotonic()
    run_ddp(_unequal_counts_worker, str(tmp_path), door)  # returns once both processes ended
    seconds = time.monotonic() - start
    ranks = [torch.load(tmp_path / f"unequal-rank{r}.pt", weights_only=True) for r in range(2)]
    # Rank 1 waits in the close's all-reduce, rank 0 in its extra forward's all-gather (FSDP2's own, in the loop's
    # code): the close raises the cause and the way out, the original chained; the forward raises torch's error, and
    # the Trainer's door (its `on_exception`) warns there with the same message.
    said = "lightning_accum: a collective failed"
    assert ranks[1]["error"].startswith(f"RuntimeError: {said}"), ranks[1]["error"]
    assert "ran a different number of micro-batches in this group than another" in ranks[1]["error"]
    assert "bounded by the strategy's `timeout=`" in ranks[1]["error"]
    assert ranks[1]["warnings"] == []  # said once, by the error
    assert ranks[0]["error"].startswith("RuntimeError:") and said not in ranks[0]["error"], ranks[0]["error"]
    if door == "trainer":
        assert len(ranks[0]["warnings"]) == 1 and "micro-batches in this group" in ranks[0]["warnings"][0]
    else:
        assert ranks[0]["warnings"] == []  # Fabric has no hook where the loop's own forward fails
    assert seconds < 120, seconds
    print(f"both processes ended after {seconds:.1f} s")


# ---------------------------------------------------------------------------------------------- dp × tp on 4 processes


def _tensor_parallel_worker(rank: int, folder: str) -> None:
    fabric = _fabric(FabricModelParallelAccumulationStrategy(_fsdp_over_tp, data_parallel_size=2), devices=4)
    model, optimizer = _setup(fabric)
    dp_rank = fabric.strategy.device_mesh["data_parallel"].get_local_rank()  # type: ignore[attr-defined]
    _train(fabric, model, optimizer, _plan(dp_rank, 2, 2, 0), clip=CLIP)
    strategy: Any = fabric.strategy
    evaluation = strategy.evaluation()  # the trained model's loss over the whole set, every replica
    with torch.no_grad():
        for batch in itertools.chain(*_plan(dp_rank, 2, 2, 0)):
            logits = model(batch["input_ids"])
            loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE)
            evaluation.add(loss, num_tokens=(batch["labels"] != IGNORE).sum())
    evaluated = evaluation.compute()
    sizes = (strategy.data_parallel_replicas, strategy.tensor_parallel_size)
    _save(folder, "dp-tp", _result(fabric, model, sizes=sizes, evaluated=(evaluated.loss, evaluated.units)))


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_fsdp2_over_tensor_parallelism_on_four_processes_matches_the_reference(tmp_path: Path) -> None:
    run_ddp(_tensor_parallel_worker, str(tmp_path), world_size=4)
    run = _load(tmp_path, "dp-tp")
    expected = reference(_whole_groups(), clip=CLIP)
    _assert_params(run, expected)  # clipped over DTensors of two meshes
    # D = 2: the two tensor-parallel ranks of a replica read the same micro-batches, counted once.
    assert run["sizes"] == (2, 2)
    assert (run["ledger"]["microbatches"], run["ledger"]["samples"], run["ledger"]["tokens"]) == (12, 24, TOKENS)
    # `fabric.strategy.evaluation()` (the core's) sums over the data-parallel group too: the trained model's loss.
    trained = Blocks().double()
    trained.load_state_dict(expected)
    with torch.no_grad():
        loss = float(_sum_loss(trained, EXAMPLES) / TOKENS)
    assert run["evaluated"][1] == TOKENS and run["evaluated"][0] == pytest.approx(loss, rel=0, abs=1e-12)


# ---------------------------------------------------------------------------------------------- mid-group save / load

SAVED_AT = 12  # every writer saves after examples 0-11: group 1 holds 8-11 (2 micro-batches of 2, or 2 of 1 per rank)


def _strategy(form: str = "sharded") -> FabricModelParallelAccumulationStrategy:
    from lightning_accum.fabric_model_parallel import shard_module_lists

    return FabricModelParallelAccumulationStrategy(
        shard_module_lists, tensor_parallel_size=1, save_distributed_checkpoint=form == "sharded"
    )


def _write(folder: str, devices: int, form: str, sync: bool = True) -> list[str]:
    """Train from the start and save inside group 1, after examples 8-11; the warnings said meanwhile."""
    fabric = _fabric(_strategy(form), devices)
    model, optimizer = _setup(fabric)
    m = 2 // devices  # 2 micro-batches per rank before the save, whatever D
    path = os.path.join(folder, f"{devices}-{form}" + ("" if sync else "-unsynced"))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        _train(fabric, model, optimizer, _plan(fabric.global_rank, devices, m, 0), sync=sync, save_at=(1, 2, path))
    return [str(w.message) for w in said]


def _resume(folder: str, name: str, devices: int, m: int) -> None:
    """Load the checkpoint `name` (written by another D, or this one) and train from example 12 to the end, the
    non-final micro-batches inside no_backward_sync."""
    fabric = _fabric(_strategy(), devices)
    model, optimizer = _setup(fabric)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        fabric.load(os.path.join(folder, name), {"model": model, "optimizer": optimizer})
        _train(fabric, model, optimizer, _plan(fabric.global_rank, devices, m, SAVED_AT))
    _save(folder, f"{name}-to-{devices}", _result(fabric, model, said=[str(w.message) for w in said]))


def _one_process_writes(rank: int, folder: str) -> None:
    for form in ("sharded", "full"):
        _write(folder, 1, form)


def _two_processes(rank: int, folder: str) -> None:
    for form in ("sharded", "full"):
        _write(folder, 2, form)
    said = _write(folder, 2, "sharded", sync=False)
    _save(folder, "unsynced-writer", {"said": said})
    for name in ("1-sharded", "1-full", "2-sharded", "2-full"):  # 1 -> 2 and 2 -> 2
        _resume(folder, name, 2, m=1)
    _resume(folder, "2-sharded-unsynced", 2, m=1)


def _one_process_resumes(rank: int, folder: str) -> None:
    for name in ("2-sharded", "2-full"):  # 2 -> 1
        _resume(folder, name, 1, m=2)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("resume")
    run_ddp(_one_process_writes, str(folder), world_size=1)
    run_ddp(_two_processes, str(folder))
    run_ddp(_one_process_resumes, str(folder), world_size=1)
    return folder


@pytest.mark.ddp
@pytest.mark.timeout(900)
def test_a_mid_group_save_resumes_exactly_sharded_and_full_under_every_replica_count(resumed: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    expected = reference(_whole_groups())
    for name in ("1-sharded-to-2", "1-full-to-2", "2-sharded-to-2", "2-full-to-2", "2-sharded-to-1", "2-full-to-1"):
        run = _load(resumed, name)
        _assert_params(run, expected)
        ledger = run["ledger"]
        assert (ledger["updates_applied"], ledger["samples"], ledger["tokens"]) == (3, 24, TOKENS), name
    # The sharded folder holds the group's gradient shard by shard in its distributed checkpoint, beside the model's.
    stored = FileSystemReader(str(resumed / "2-sharded")).read_metadata().state_dict_metadata
    assert {key for key in stored if key.startswith(DISTRIBUTED_KEY)} == {
        f"{DISTRIBUTED_KEY}.{name}" for name in expected
    }
    group = torch.load(resumed / "2-sharded" / "meta.pt", weights_only=True)[CHECKPOINT_KEY]["open_group"]
    assert group["gradients_stored"] == "distributed" and group["total_microbatches"] == 4
    # The one file holds it whole, gathered.
    group = torch.load(resumed / "2-full", weights_only=True)[CHECKPOINT_KEY]["open_group"]
    assert {name: tuple(g.shape) for name, g in group["gradients"].items()} == {
        name: tuple(p.shape) for name, p in expected.items()
    }


@pytest.mark.ddp
@pytest.mark.timeout(900)
def test_a_group_run_inside_no_backward_sync_is_not_carried_and_the_resume_says_so(resumed: Path) -> None:
    said = _load(resumed, "unsynced-writer")["said"]
    assert any(
        "after backwards inside `fabric.no_backward_sync(model, enabled=True)` the group's gradient is held unreduced"
        " inside FSDP2 and cannot be carried" in message
        for message in said
    ), said
    run = _load(resumed, "2-sharded-unsynced-to-2")
    assert any("4 of them, which Lightning does not run again, are lost" in message for message in run["said"]), run
    # Group 1's update is the mean over the micro-batches that remain (examples 12-15), exactly.
    _assert_params(run, reference([list(range(8)), list(range(12, 16)), list(range(16, 24))]))


def test_accum_fsdp_is_fabrics_model_parallel_strategy_over_every_device() -> None:
    from lightning.fabric.strategies import ModelParallelStrategy

    from lightning_accum.fabric_model_parallel import shard_module_lists

    strategy = L.Fabric(strategy="accum_fsdp", devices=2, accelerator="cpu").strategy
    assert isinstance(strategy, FabricModelParallelAccumulationStrategy)
    assert isinstance(strategy, ModelParallelStrategy)
    assert strategy._parallelize_fn is shard_module_lists and strategy._tensor_parallel_size == 1
    with pytest.raises(ValueError, match=r"`data_parallel_size` must be 'auto' or an int ≥ 1, got 0\."):
        FabricModelParallelAccumulationStrategy(shard_module_lists, data_parallel_size=0)
    # A product that is not the world size is named before any process group starts.
    four = _strategy_with(data_parallel_size=2, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"the world size is 2 .* or Fabric's `devices=` / `num_nodes=`\."):
        L.Fabric(strategy=four, devices=2, accelerator="cpu").strategy.setup_environment()
    # Fabric refuses float64 precision here; a float64 model under "32-true" is how the tests check exactness.
    with pytest.raises(ValueError, match=r"does not support `Fabric\(\.\.\., precision='64-true'\)`"):
        L.Fabric(strategy="accum_fsdp", devices=2, accelerator="cpu", precision="64-true")


def _strategy_with(**sizes: Any) -> FabricModelParallelAccumulationStrategy:
    from lightning_accum.fabric_model_parallel import shard_module_lists

    return FabricModelParallelAccumulationStrategy(shard_module_lists, **sizes)
