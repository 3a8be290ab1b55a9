"""Shared test parts: a tiny token model, variable-length padded data, float64 references, a DDP harness."""

from __future__ import annotations

import atexit
import contextlib
import copy
import gc
import json
import os
import socket
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, Sampler

# What the fork server imports before it forks the workers of multi-process tests (tests/conftest.py).
PRELOADED = ["torch", "lightning", "lightning_accum", "helpers"]

IGNORE = -100
VOCAB = 11
SEQ = 6


def make_examples(lengths: Sequence[int], seed: int = 0) -> list[dict[str, Tensor]]:
    """Token sequences padded to SEQ; positions past each length carry the ignore index in `labels`."""
    gen = torch.Generator().manual_seed(seed)
    examples = []
    for length in lengths:
        ids = torch.randint(0, VOCAB, (SEQ,), generator=gen)
        labels = torch.randint(0, VOCAB, (SEQ,), generator=gen)
        labels[length:] = IGNORE
        examples.append({"input_ids": ids, "labels": labels})
    return examples


#: Seven examples, for tests that watch where Lightning's groups start and end.
EXAMPLES_FOR_GROUPING = make_examples([3, 1, 4, 1, 5, 2, 6])


def random_lengths(n: int, seed: int = 0, low: int = 1) -> list[int]:
    gen = torch.Generator().manual_seed(seed + 1000)
    return torch.randint(low, SEQ + 1, (n,), generator=gen).tolist()


class ListDataset(Dataset):
    def __init__(self, examples: list[dict[str, Tensor]]) -> None:
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return self.examples[index]


class TinyLM(L.LightningModule):
    """Embedding -> linear head; the mean cross-entropy over supervised tokens of the micro-batch.

    `report` selects what training_step returns: "tokens" ({"loss", "num_tokens"}), "loss" (tensor only),
    "samples" ({"loss", "num_samples"}).
    """

    def __init__(
        self,
        lr: float = 1.0,
        report: str = "tokens",
        seed: int = 0,
        optimizer: str = "sgd",
        loss_divisor: float = 1.0,
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)
        self.lr = lr
        self.report = report
        self.optimizer_name = optimizer
        self.loss_divisor = loss_divisor
        self.seen_input_ids: list[Tensor] = []

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.embed(input_ids)))

    def mean_loss(self, batch: dict[str, Tensor]) -> Tensor:
        logits = self(batch["input_ids"])
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Any:
        self.seen_input_ids.append(batch["input_ids"].detach().clone())
        loss = self.mean_loss(batch) / self.loss_divisor
        if self.report == "tokens":
            return {"loss": loss, "num_tokens": (batch["labels"] != IGNORE).sum()}
        if self.report == "samples":
            return {"loss": loss, "num_samples": batch["labels"].shape[0]}
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class EvalLM(TinyLM):
    """TinyLM whose `validation_step` / `test_step` return `evaluation` ("tokens": the training contract, "loss": a
    plain tensor, "none": nothing) and log Lightning's own `val_loss` / `test_loss` beside it."""

    def __init__(self, evaluation: str = "tokens", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.evaluation = evaluation

    def _evaluate(self, batch: dict[str, Tensor], name: str) -> Any:
        loss = self.mean_loss(batch)
        self.log(name, loss, sync_dist=True)  # Lightning's own value, unchanged beside the package's
        if self.evaluation == "tokens":
            return {"loss": loss, "num_tokens": (batch["labels"] != IGNORE).sum()}
        return loss if self.evaluation == "loss" else None

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int, dataloader_idx: int = 0) -> Any:
        return self._evaluate(batch, "val_loss")

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> Any:
        return self._evaluate(batch, "test_loss")


def reference_loss(model: TinyLM, examples: list[dict[str, Tensor]]) -> float:
    """float64: Σ token losses / supervised tokens over the whole set."""
    ref = TinyLM()
    ref.load_state_dict(model.state_dict())
    ref = ref.double()
    ids = torch.stack([e["input_ids"] for e in examples])
    labels = torch.stack([e["labels"] for e in examples])
    with torch.no_grad():
        total = F.cross_entropy(ref(ids).flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    return float(total / (labels != IGNORE).sum())


def params_vector(module: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1).to(torch.float64) for p in module.parameters()])


def full_params(module: nn.Module) -> Tensor:
    """Every parameter, gathered from its shards (a collective under FSDP2 / tensor parallelism), in float64."""
    parts = []
    for p in module.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        parts.append(full.detach().reshape(-1).to(torch.float64))
    return torch.cat(parts)


def token_weighted_grad(module: nn.Module, examples: list[dict[str, Tensor]]) -> Tensor:
    """float64 gradient of Σ token losses / N over `examples` (N = supervised tokens of all of them)."""
    ref = copy.deepcopy(module).double()
    ids = torch.stack([e["input_ids"] for e in examples])
    labels = torch.stack([e["labels"] for e in examples])
    logits = ref.head(torch.tanh(ref.embed(ids)))
    n = (labels != IGNORE).sum()
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum") / n
    loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in ref.parameters()])


def sgd_reference(
    module: nn.Module, groups: list[list[dict[str, Tensor]]], lr: float = 1.0, momentum: float = 0.0
) -> Tensor:
    """Parameters after float64 SGD (torch's momentum rule) with one token-weighted update per group of examples."""
    ref = copy.deepcopy(module).double()
    velocity: Tensor | None = None
    for group in groups:
        grad = token_weighted_grad(ref, group)
        velocity = grad if velocity is None or not momentum else momentum * velocity + grad
        with torch.no_grad():
            offset = 0
            for p in ref.parameters():
                n = p.numel()
                p -= lr * velocity[offset : offset + n].view_as(p)
                offset += n
    return params_vector(ref)


def group_tokens(group: list[dict[str, Tensor]]) -> int:
    return int(sum(int((e["labels"] != IGNORE).sum()) for e in group))


def hand_groups(
    examples: list[dict[str, Tensor]], schedule: Any, epochs: int, orders: Sequence[Sequence[int]] | None = None
) -> list[list[dict[str, Tensor]]]:
    """The groups a hand loop forms under a `BatchSchedule` on tokens, `epochs` passes over `examples` in order (or,
    with `orders`, epoch e in the order of the indices `orders[e]`): at each group's start the stage of the tokens seen
    so far; an epoch's last group holds what remains (the partial-group policy "rescale": its real tokens)."""
    groups, seen = [], 0
    for epoch in range(epochs):
        ordered = examples if orders is None else [examples[i] for i in orders[epoch]]
        start = 0
        while start < len(ordered):
            size = schedule.stage_at(seen).samples
            group = ordered[start : start + size]
            groups.append(group)
            seen += group_tokens(group)
            start += size
    return groups


def hand_trail(
    model: nn.Module,
    examples: list[dict[str, Tensor]],
    schedule: Any,
    epochs: int,
    lr: float,
    orders: Sequence[Sequence[int]] | None = None,
) -> list[Tensor]:
    """float64 SGD: one token-weighted update per hand group (`hand_groups`, at the stage's learning-rate factor); the
    parameters after each update."""
    ref = copy.deepcopy(model).double()
    trail, seen = [], 0
    for group in hand_groups(examples, schedule, epochs, orders):
        factor = schedule.lr_factor(schedule.stage_at(seen))
        grad = token_weighted_grad(ref, group)
        with torch.no_grad():
            offset = 0
            for p in ref.parameters():
                p -= lr * factor * grad[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
        seen += group_tokens(group)
        trail.append(params_vector(ref))
    return trail


def relative_error(actual: Tensor, expected: Tensor) -> float:
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


class RankStridedSampler(Sampler[int]):
    """Rank r reads examples r, r + D, r + 2D, ... in order (what DistributedSampler does without shuffling).

    Lightning always shuffles the distributed sampler it injects for training; the tests need a known layout.
    The rank is read when iterating, so the sampler can be built before processes are spawned.
    """

    def __init__(self, length: int) -> None:
        self.length = length

    def _layout(self) -> tuple[int, int]:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
        return 0, 1

    def __iter__(self) -> Iterator[int]:
        rank, world = self._layout()
        return iter(range(rank, self.length, world))

    def __len__(self) -> int:
        rank, world = self._layout()
        return len(range(rank, self.length, world))


def native_threads() -> list[int]:
    """The ids of this process's native threads (Linux: `/proc/self/task`)."""
    return sorted(int(tid) for tid in os.listdir("/proc/self/task"))


def record_threads_at_exit(path: str | Path) -> None:
    """Write to `path`, at this process's interpreter exit (atexit runs before finalization), whether a process group
    is still initialized and which native threads are alive then and now (the end of a spawned worker, issue 23)."""
    now = native_threads()

    def write() -> None:
        state = {"initialized": dist.is_initialized(), "threads_at_exit": native_threads(), "threads_before": now}
        Path(path).write_text(json.dumps(state))

    atexit.register(write)


def assert_group_closed_before_exit(path: str | Path) -> None:
    """What `record_threads_at_exit` wrote: the group was gone at exit, and native threads that were alive while it
    existed (its work threads, its TCP loop, on rank 0 the store's server) had ended by then. Threads are told by their
    ids, not their names, which torch gives them only in recent releases."""
    state = json.loads(Path(path).read_text())
    assert not state["initialized"], state
    ended = set(state["threads_before"]) - set(state["threads_at_exit"])
    assert len(ended) >= 2, state  # at least gloo's two work threads, joined while the interpreter was alive


def make_trainer(**overrides: Any) -> L.Trainer:
    """A quiet CPU Trainer of the exact strategy: `strategy="accum"`, one device, one epoch, no logger, checkpoints,
    progress bar, model summary or sanity validation; on several devices or nodes no distributed sampler (each rank
    reads what its loader gives it: a `RankStridedSampler`'s share, or the same examples). `overrides` win."""
    options: dict[str, Any] = {
        "strategy": "accum",
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        **overrides,
    }
    if options["devices"] != 1 or options.get("num_nodes", 1) != 1:
        options.setdefault("use_distributed_sampler", False)
    return L.Trainer(**options)


def fit(
    model: L.LightningModule,
    examples: list[dict[str, Tensor]],
    batch_size: int,
    accumulate: int,
    strategy: Any = "accum",
    callbacks: list[L.Callback] | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    **trainer_kwargs: Any,
) -> L.Trainer:
    """One epoch of `Trainer.fit` over `examples` in order; with several devices each rank reads a strided,
    unshuffled share; `collate_fn` for examples the default collation cannot stack."""
    trainer = make_trainer(
        strategy=strategy, accumulate_grad_batches=accumulate, callbacks=callbacks or [], **trainer_kwargs
    )
    distributed = trainer_kwargs.get("devices", 1) != 1 or trainer_kwargs.get("num_nodes", 1) != 1
    sampler = RankStridedSampler(len(examples)) if distributed else None
    loader = DataLoader(
        ListDataset(examples), batch_size=batch_size, shuffle=False, sampler=sampler, collate_fn=collate_fn
    )
    trainer.fit(model, loader)
    return trainer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_env() -> dict[str, str]:
    """This process's environment for a launched script: without pytest's and torch's distributed variables, and
    with warnings silenced."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "LOCAL_RANK", "RANK", "WORLD_SIZE"))}
    env["PYTHONWARNINGS"] = "ignore"
    return env


def torchrun_two_nodes(script: Path, *args: str, env: dict[str, str]) -> None:
    """Runs `script args` under torchrun as 2 nodes x 1 process on the loopback interface; both must end cleanly."""
    port = free_port()
    nodes = [
        subprocess.Popen(
            [
                sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                f"--node-rank={rank}", "--master-addr=127.0.0.1", f"--master-port={port}",
                str(script), *args,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]  # fmt: skip
    logs = [node.communicate(timeout=500)[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), "\n".join(log[-3000:] for log in logs)


def _ddp_worker(rank: int, world_size: int, port: int, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
    # The variables torchrun sets: Lightning's environment then sees externally created processes.
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
    )
    torch.set_num_threads(1)
    try:
        fn(rank, *args)
    finally:
        # Left to interpreter shutdown, the process group's destructor can abort the process (SIGABRT) after `fn`
        # finished, failing a test whose work had passed; destroyed here, it goes in a fixed order. The collection
        # drops the references Python objects still hold to the groups (FSDP2's and tensor parallelism's device
        # meshes), so that their native threads are joined while the interpreter is alive, as the package's own
        # workers do (lightning_accum/_worker_exit.py). Seen once without it, in a 2-core CI run of the full suite:
        # "terminate called without an active exception" in an FSDP2 worker.
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
            gc.collect()


def forked_ddp(**options: Any) -> Any:
    """The Trainer's `"accum_ddp_spawn"` strategy with its workers forked by the fork server (tests/conftest.py)."""
    from lightning_accum import DDPAccumulationStrategy

    return DDPAccumulationStrategy(start_method="forkserver", **options)


def run_ddp(fn: Callable[..., None], *args: Any, world_size: int = 2) -> None:
    """Run `fn(rank, *args)` in `world_size` fresh processes laid out like a torchrun launch.

    The processes are forked by Python's fork server (see tests/conftest.py), not spawned.

    The port is free when chosen but only bound seconds later, by rank zero's store: on a shared machine another
    process may take it in between. That start-up failure (nothing of `fn` ran) is retried with a new port.
    """
    for attempt in range(3):
        try:
            torch.multiprocessing.start_processes(
                _ddp_worker,
                args=(world_size, free_port(), fn, args),
                nprocs=world_size,
                join=True,
                start_method="forkserver",
            )
            return
        except torch.multiprocessing.ProcessRaisedException as err:
            if attempt == 2 or "address already in use" not in str(err).lower():
                raise


class RecordOnRanks(L.Callback):
    """Saves each rank's final parameters and ledger to `folder/rank{r}.pt` (spawned workers' results)."""

    def __init__(self, folder: str, name: str = "run") -> None:
        self.folder, self.name = folder, name

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        ledger = getattr(trainer.strategy, "ledger", None)
        torch.save(
            {"params": params_vector(pl_module), "ledger": ledger.state_dict() if ledger is not None else None},
            os.path.join(self.folder, f"{self.name}-rank{trainer.global_rank}.pt"),
        )


def load_ranks(folder: str, name: str = "run", world_size: int = 2) -> list[dict[str, Any]]:
    return [torch.load(os.path.join(folder, f"{name}-rank{r}.pt"), weights_only=True) for r in range(world_size)]


def ddp_trainer(
    strategy: Any, accumulate: int, max_epochs: int = 1, callbacks: list[L.Callback] | None = None
) -> L.Trainer:
    """A 2-process CPU Trainer for run_ddp workers; each rank reads its own data (no distributed sampler)."""
    return make_trainer(
        strategy=strategy,
        devices=2,
        accumulate_grad_batches=accumulate,
        max_epochs=max_epochs,
        callbacks=callbacks or [],
        enable_checkpointing=bool(callbacks),
    )


class CheckpointAt(L.Callback):
    """Writes `path` from `on_train_batch_end` of micro-batch `at` (between micro-batches; inside a group when `at`
    does not end one) and lets the fit train on."""

    def __init__(self, path: Path, at: int) -> None:
        self.path, self.at = path, at

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.fit_loop.epoch_loop.batch_idx == self.at:
            trainer.save_checkpoint(self.path)


class ResumableLoader(DataLoader):
    """A DataLoader that Lightning can checkpoint mid-epoch (it has `state_dict`/`load_state_dict`): on restore it
    skips the batches the interrupted epoch already consumed. Plain DataLoaders restart the epoch's data from its
    start on a mid-epoch resume (Lightning's behaviour), so exact mid-epoch resumption needs one like this (or
    torchdata's StatefulDataLoader)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.consumed = 0
        self.skip = 0

    def __iter__(self) -> Any:
        skip, self.skip = self.skip, 0
        self.consumed = 0
        for i, batch in enumerate(super().__iter__()):
            if i < skip:
                continue
            self.consumed = i + 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        # Between a restore and the first batch of the resumed epoch the batches to skip are the ones consumed.
        return {"consumed": max(self.consumed, self.skip)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skip = int(state["consumed"])


# A checkpoint written at micro-batch `at` of a one-device run (A = 3 unless said), and the run resumed from it: the
# checkpoint tests of tests/core/ (test_checkpoint.py, test_entry.py, test_reading.py) share them.


def _plain_trainer(strategy: Any, accumulate: int, callbacks: list[L.Callback] | None = None) -> L.Trainer:
    return make_trainer(
        strategy=strategy,
        accumulate_grad_batches=accumulate,
        callbacks=callbacks or [],
    )


_EXAMPLES = make_examples(random_lengths(16, seed=55), seed=55)  # 8 micro-batches of 2


def _loader() -> ResumableLoader:
    return ResumableLoader(ListDataset(_EXAMPLES), batch_size=2)


def _resume(
    ckpt: Path,
    strategy: Any,
    accumulate: int,
    model: L.LightningModule | None = None,
    callbacks: list[L.Callback] | None = None,
) -> tuple[L.Trainer, L.LightningModule, list[str]]:
    model = model if model is not None else TinyLM()
    trainer = _plain_trainer(strategy, accumulate, callbacks)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, _loader(), ckpt_path=ckpt)
    return trainer, model, [str(w.message) for w in caught if "callbacks used to create" not in str(w.message)]


def _written_at(folder: Path, at: int, strategy: Any = "accum", accumulate: int = 3) -> Path:
    _plain_trainer(strategy, accumulate, [CheckpointAt(folder / "at.ckpt", at)]).fit(TinyLM(), _loader())
    return folder / "at.ckpt"


class HoldMemory(L.Callback):
    """Holds `megabytes` of touched memory from the first batch to the end of training (memory the fit's peak holds)."""

    def __init__(self, megabytes: int) -> None:
        self.megabytes = megabytes
        self.block: Tensor | None = None

    def on_train_batch_start(self, *args: Any) -> None:
        if self.block is None:
            self.block = torch.ones(self.megabytes * 2**20 // 4)  # float32, every page written

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.block = None


def reset_resident_peak() -> None:
    """Start this process's peak resident set (VmHWM) again at its resident set now, where Linux allows it, so that a
    test measuring a peak against it does not depend on what earlier tests in the process held."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
