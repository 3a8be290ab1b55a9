"""Exact accumulation in Lightning Fabric loops: `L.Fabric(strategy="accum")` and `"accum_ddp_spawn"` against float64
references and across splits, a mid-group `fabric.save` resumed in a new process, GradScaler skips, NaN groups, the
partial final group, AxisLR, damaged entries, and the axis in the logger.

The Fabric door's silent cases, each now exact or a clear error at the point of the mistake: a checkpoint loaded
without a state object, a group declared of one, a CheckpointIO of its own, and `AxisLR` without a strategy (the
rules of the manual API shared with the Trainer's door are in tests/core/test_rules.py).
"""

from __future__ import annotations

import csv
import inspect
import itertools
import math
import re
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import (
    IGNORE,
    VOCAB,
    assert_group_closed_before_exit,
    make_examples,
    params_vector,
    random_lengths,
    record_threads_at_exit,
    relative_error,
    run_ddp,
    sgd_reference,
)
from lightning.fabric.loggers import CSVLogger
from lightning.fabric.plugins.precision import MixedPrecision
from torch import Tensor, nn

from lightning_accum import AxisLR, FabricAccumulationStrategy, FabricDDPAccumulationStrategy, log_on_axis
from lightning_accum.core.entry import CHECKPOINT_KEY

LR = 0.5


class TinyNet(nn.Module):
    """The same network as the tests' TinyLM (`helpers.sgd_reference` computes its float64 updates)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.embed(input_ids)))


def stack(examples: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    return {key: torch.stack([e[key] for e in examples]) for key in examples[0]}


def micro_batches(examples: list[dict[str, Tensor]], m: int) -> list[dict[str, Tensor]]:
    return [stack(examples[i : i + m]) for i in range(0, len(examples), m)]


def train(
    fabric: L.Fabric,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[dict[str, Tensor]],
    accumulate: int,
    start: int = 0,
    stop: int | None = None,
    poison: dict[int, float] | None = None,
    scheduler: Any = None,
) -> list[Any]:
    """A Fabric loop in LitGPT's style over `batches[start:stop]`: micro-batch `i` of the whole list is the
    `i % accumulate`-th of its group; `poison[i]` multiplies that micro-batch's loss (inf, nan)."""
    records = []
    end = len(batches) if stop is None else stop
    for i in range(start, end):
        batch = fabric.to_device(batches[i])
        last = (i + 1) % accumulate == 0 or i == len(batches) - 1
        with fabric.no_backward_sync(model, enabled=not last):
            logits = model(batch["input_ids"])
            loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE)
            if poison and i in poison:
                loss = loss * poison[i]
            tokens = (batch["labels"] != IGNORE).sum()
            fabric.backward(fabric.strategy.accumulate(loss, num_tokens=tokens, batch=batch))
        if last:
            records.append(fabric.strategy.close_group(optimizer, group_size=accumulate))
            optimizer.step()
            optimizer.zero_grad()
            if scheduler is not None:
                scheduler.step()
    return records


def fabric_run(
    examples: list[dict[str, Tensor]], m: int, accumulate: int, precision: str = "32-true", **kwargs: Any
) -> tuple[L.Fabric, nn.Module]:
    fabric = L.Fabric(strategy="accum", accelerator="cpu", precision=precision)  # type: ignore[arg-type]
    model, optimizer = fabric.setup(*_model_and_optimizer())
    train(fabric, model, optimizer, micro_batches(examples, m), accumulate, **kwargs)
    return fabric, model


def _model_and_optimizer(seed: int = 0, dtype: torch.dtype = torch.float64) -> tuple[nn.Module, torch.optim.Optimizer]:
    # Built in float64 under Fabric's default precision: "64-true" would convert the module's outputs back to the
    # default float32 (Fabric's DoublePrecision.convert_output), which is not a float64 reference.
    model = TinyNet(seed).to(dtype)
    return model, torch.optim.SGD(model.parameters(), lr=LR)


def _groups(examples: list[dict[str, Tensor]], size: int) -> list[list[dict[str, Tensor]]]:
    return [examples[i : i + size] for i in range(0, len(examples), size)]


EXAMPLES = make_examples(random_lengths(24, seed=11), seed=11)


def test_one_device_matches_the_float64_reference_at_every_split() -> None:
    reference = sgd_reference(TinyNet(), _groups(EXAMPLES, 8), lr=LR)  # 3 updates of 8 examples
    for m, accumulate in ((8, 1), (4, 2), (2, 4), (1, 8)):
        fabric, model = fabric_run(EXAMPLES, m, accumulate)
        torch.testing.assert_close(params_vector(model), reference, rtol=0, atol=1e-12)
        ledger = fabric.strategy.ledger
        assert (ledger.updates_applied, ledger.microbatches, ledger.samples) == (3, 24 // m, 24)
        assert ledger.tokens == sum(int((e["labels"] != IGNORE).sum()) for e in EXAMPLES)
        assert ledger.normalization == "tokens"


def test_the_seed_example_is_weighted_by_tokens_not_averaged() -> None:
    # Two micro-batches with 2 and 6 supervised tokens: the record's loss is their token-weighted mean.
    examples = make_examples([1, 1, 3, 3], seed=1)  # lengths per sequence: 2 and 6 tokens in the two pairs
    fabric, _ = fabric_run(examples, 2, 2)
    record = fabric.strategy.ledger.last_group
    assert record is not None and record.tokens == 8 and record.microbatches == 2
    net = TinyNet().double()
    with torch.no_grad():
        means = [
            F.cross_entropy(net(b["input_ids"]).flatten(0, 1), b["labels"].flatten(), ignore_index=IGNORE)
            for b in micro_batches(examples, 2)
        ]
    assert record.loss == pytest.approx((2 * float(means[0]) + 6 * float(means[1])) / 8, rel=1e-12)
    assert record.loss != pytest.approx((float(means[0]) + float(means[1])) / 2, rel=1e-3)


def _ddp_worker(
    fabric: L.Fabric, examples: list[dict[str, Tensor]], m: int, accumulate: int, folder: str
) -> dict[str, Any]:
    # Each rank reads every other example of each group: together the replicas read the one-device groups.
    rank, world = fabric.global_rank, fabric.world_size
    record_threads_at_exit(Path(folder) / f"exit-rank{rank}.json")
    mine = [e for group in _groups(examples, 8) for e in group[rank::world]]
    model, optimizer = fabric.setup(*_model_and_optimizer())
    train(fabric, model, optimizer, micro_batches(mine, m), accumulate)
    # Plain data back to the main process (a tensor would travel as a shared-memory handle the worker takes away).
    return {"params": params_vector(model).tolist(), "ledger": fabric.strategy.ledger.state_dict()}


RAMP = (1, 2, 3, 4)  # a group's micro-batches (of 2 examples), one update each: 20 examples


def _ramp_loop(fabric: L.Fabric, examples: list[dict[str, Tensor]], set_to_none: bool = True) -> Tensor:
    """A loop under `precision="64-true"` of a float32-built TinyNet (Fabric converts it), groups of RAMP's sizes."""
    model, optimizer = fabric.setup(*_model_and_optimizer(dtype=torch.float32))
    batches = iter(micro_batches(examples, 2))
    for size in RAMP:
        for _ in range(size):
            batch = next(batches)
            logits = model(batch["input_ids"])
            assert logits.dtype == torch.float64  # Fabric's plugin would hand them back in float32
            loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE)
            tokens = (batch["labels"] != IGNORE).sum()
            fabric.backward(fabric.strategy.accumulate(loss, num_tokens=tokens, batch=batch))
        fabric.strategy.close_group(optimizer, group_size=size)
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
    return params_vector(model)


RAMP_EXAMPLES = make_examples(random_lengths(40, seed=12), seed=12)


def _ramp_groups(replicas: int) -> list[list[dict[str, Tensor]]]:
    """The examples of each update: RAMP's sizes × 2 examples × `replicas`."""
    bounds = [2 * replicas * sum(RAMP[:i]) for i in range(len(RAMP) + 1)]
    return [RAMP_EXAMPLES[a:b] for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize("set_to_none", [True, False])
def test_precision_64_true_is_float64_exact_with_the_default_dtype_at_float32(set_to_none: bool) -> None:
    # Before: 2.7e-9 from the float64 loop (Fabric's DoublePrecision hands the outputs back in the default float32).
    assert torch.get_default_dtype() == torch.float32
    fabric = L.Fabric(strategy="accum", accelerator="cpu", precision="64-true")
    params = _ramp_loop(fabric, RAMP_EXAMPLES[:20], set_to_none)
    assert relative_error(params, sgd_reference(TinyNet(), _ramp_groups(1), lr=LR)) < 1e-12


def _ramp_worker(rank: int, folder: str) -> None:
    fabric = L.Fabric(strategy="accum_ddp", devices=2, accelerator="cpu", precision="64-true")
    fabric.launch()  # the processes exist (run_ddp)
    mine = [e for group in _ramp_groups(2) for e in group[rank::2]]  # together the replicas read each group
    torch.save(_ramp_loop(fabric, mine), Path(folder) / f"rank{rank}.pt")


@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_precision_64_true_on_two_processes_is_float64_exact(tmp_path: Path) -> None:
    # Before: 3.1e-9 from the float64 loop (rank 0).
    run_ddp(_ramp_worker, str(tmp_path))
    reference = sgd_reference(TinyNet(), _ramp_groups(2), lr=LR)
    for rank in range(2):
        assert relative_error(torch.load(tmp_path / f"rank{rank}.pt"), reference) < 1e-12


@pytest.mark.ddp
@pytest.mark.timeout(300)
@pytest.mark.skipif(sys.platform != "linux", reason="reads thread names from /proc")
def test_two_processes_match_the_float64_reference_and_one_device(tmp_path: Path) -> None:
    reference = sgd_reference(TinyNet(), _groups(EXAMPLES, 8), lr=LR)
    for m, accumulate in ((2, 2), (1, 4)):  # 2 replicas × m × A = 8 examples per update
        strategy = FabricDDPAccumulationStrategy(start_method="spawn")
        fabric = L.Fabric(strategy=strategy, devices=2, accelerator="cpu")
        folder = tmp_path / f"m{m}"
        folder.mkdir()
        result = fabric.launch(_ddp_worker, EXAMPLES, m, accumulate, str(folder))
        torch.testing.assert_close(torch.tensor(result["params"], dtype=torch.float64), reference, rtol=0, atol=1e-12)
        ledger = result["ledger"]
        assert (ledger["updates_applied"], ledger["samples"], ledger["microbatches"]) == (3, 24, 24 // m)
        # Each worker closed its process group before its interpreter exited: a gloo group left to the interpreter's
        # finalization can abort the worker after the loop ended (SIGABRT, issue 23), as it did here before.
        for rank in range(2):
            assert_group_closed_before_exit(folder / f"exit-rank{rank}.json")


def test_the_string_builds_the_spawn_strategy() -> None:
    fabric = L.Fabric(strategy="accum_ddp_spawn", devices=2, accelerator="cpu")
    assert isinstance(fabric.strategy, FabricDDPAccumulationStrategy)
    assert fabric.strategy.data_parallel_replicas == 2 and fabric.strategy._start_method == "spawn"


# ---------------------------------------------------------------------- checkpoints


def _first_part(path: str, m: int, accumulate: int, stop: int) -> None:
    """In a process of its own: train micro-batches [0, stop) and save in the middle of a group."""
    fabric = L.Fabric(strategy="accum", accelerator="cpu")
    model, optimizer = fabric.setup(*_model_and_optimizer())
    train(fabric, model, optimizer, micro_batches(EXAMPLES, m), accumulate, stop=stop)
    fabric.save(path, {"model": model, "optimizer": optimizer, "next": stop})


def _second_part(path: str, m: int, accumulate: int, out: str) -> None:
    """In another process: load, and train the rest from the micro-batch after the saved one."""
    fabric = L.Fabric(strategy="accum", accelerator="cpu")
    model, optimizer = fabric.setup(*_model_and_optimizer(seed=99))  # other weights: the checkpoint restores them
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "next": 0}
    fabric.load(path, state)
    train(fabric, model, optimizer, micro_batches(EXAMPLES, m), accumulate, start=state["next"])
    torch.save({"params": params_vector(model), "ledger": fabric.strategy.ledger.state_dict()}, out)


def _in_a_new_process(fn: Any, *args: Any) -> None:
    context = torch.multiprocessing.get_context("forkserver")  # a clean process, forked (tests/conftest.py)
    process = context.Process(target=fn, args=args)
    process.start()
    process.join(timeout=240)
    assert process.exitcode == 0, f"{fn.__name__} exited with {process.exitcode}"


@pytest.mark.timeout(300)
def test_a_mid_group_save_resumes_exactly_in_a_new_process(tmp_path: Path) -> None:
    m, accumulate, stop = 2, 4, 6  # 3 groups of 4 micro-batches; saved after 2 of the second group's
    reference = sgd_reference(TinyNet(), _groups(EXAMPLES, 8), lr=LR)
    uninterrupted, model = fabric_run(EXAMPLES, m, accumulate)
    path, out = str(tmp_path / "mid.ckpt"), str(tmp_path / "resumed.pt")
    _in_a_new_process(_first_part, path, m, accumulate, stop)
    saved = torch.load(path, weights_only=True)[CHECKPOINT_KEY]
    assert saved["open_group"]["microbatches"] == 2 and saved["open_group"]["carried"] is True
    _in_a_new_process(_second_part, path, m, accumulate, out)
    resumed = torch.load(out, weights_only=True)
    torch.testing.assert_close(resumed["params"], reference, rtol=0, atol=1e-12)
    torch.testing.assert_close(resumed["params"], params_vector(model), rtol=0, atol=1e-12)
    assert resumed["ledger"] == uninterrupted.strategy.ledger.state_dict()


def test_a_damaged_entry_is_refused_with_its_key(tmp_path: Path) -> None:
    fabric = L.Fabric(strategy="accum", accelerator="cpu")
    model, optimizer = fabric.setup(*_model_and_optimizer())
    train(fabric, model, optimizer, micro_batches(EXAMPLES, 2), 4, stop=6)
    path = tmp_path / "mid.ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer})
    checkpoint = torch.load(path, weights_only=True)
    checkpoint[CHECKPOINT_KEY]["open_group"]["sums"]["units"] = -3.0
    torch.save(checkpoint, path)
    other = L.Fabric(strategy="accum", accelerator="cpu")
    model, optimizer = other.setup(*_model_and_optimizer())
    with pytest.raises(ValueError, match=r"`open_group.sums.units` should be"):
        other.load(path, {"model": model, "optimizer": optimizer})


@pytest.mark.parametrize("content", [b"", b"\x80", b"\x80\x02}"])  # before: a bare EOFError, IndexError, EOFError
def test_a_checkpoint_file_that_cannot_be_read_is_named(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "short.ckpt"
    path.write_bytes(content)
    fabric = L.Fabric(strategy="accum", accelerator="cpu")
    model, _ = fabric.setup(*_model_and_optimizer())
    size = f"({len(content)} byte(s)) cannot be read: "
    with pytest.raises(ValueError, match=re.escape(f"`ckpt_path={str(path)!r}` {size}")) as caught:
        fabric.load(path, {"model": model})
    assert caught.value.__cause__ is not None  # torch's own error, chained and named in the message
    assert type(caught.value.__cause__).__name__ in str(caught.value)


def test_the_users_state_keeps_its_keys_and_the_package_key_is_refused(tmp_path: Path) -> None:
    fabric = L.Fabric(strategy="accum", accelerator="cpu")
    model, optimizer = fabric.setup(*_model_and_optimizer())
    with pytest.raises(ValueError, match="holds a key 'lightning_accum'"):
        fabric.save(tmp_path / "a.ckpt", {"model": model, CHECKPOINT_KEY: 1})
    fabric.save(tmp_path / "b.ckpt", {"model": model, "optimizer": optimizer, "step": 7})
    state: dict[str, Any] = {"model": model, "step": 0}
    remainder = fabric.load(tmp_path / "b.ckpt", state, strict=False)
    # No optimizer in the state: weights (and the user's keys) only, as plain Fabric; the package's entry is left in
    # what is returned, unread (tests/test_fabric_load.py).
    assert state["step"] == 7 and CHECKPOINT_KEY in remainder
    state = {"model": model, "optimizer": optimizer, "step": 0}
    assert CHECKPOINT_KEY not in fabric.load(tmp_path / "b.ckpt", state)  # a resume consumes it


# ---------------------------------------------------------------------- skips, the partial group, schedules


def test_a_gradscaler_overflow_is_a_skipped_update_counted_as_such() -> None:
    fp16 = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    fabric = L.Fabric(strategy="accum", accelerator="cpu", plugins=[fp16])
    model, optimizer = fabric.setup(*_model_and_optimizer(dtype=torch.float32))
    batches = micro_batches(EXAMPLES, 2)
    records = train(fabric, model, optimizer, batches, 4, poison={5: float("inf")})  # group 1 overflows
    ledger = fabric.strategy.ledger
    assert (ledger.updates_attempted, ledger.updates_applied, ledger.updates_skipped["overflow"]) == (3, 2, 1)
    assert [r.applied for r in records] == [True, False, True] and records[1].skip_reason == "overflow"
    # The skipped group changed nothing: the same as a run without it (every other update identical).
    kept = [b for i, b in enumerate(batches) if i // 4 != 1]
    clean = L.Fabric(
        strategy="accum",
        accelerator="cpu",
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
    )
    ref_model, ref_optimizer = clean.setup(*_model_and_optimizer(dtype=torch.float32))
    train(clean, ref_model, ref_optimizer, kept, 4)
    torch.testing.assert_close(params_vector(model), params_vector(ref_model), rtol=1e-6, atol=1e-7)


def test_a_nan_group_is_skipped_without_a_scaler() -> None:
    with pytest.warns(UserWarning, match="skipped update 2: its gradient is not finite"):
        fabric, model = fabric_run(EXAMPLES, 2, 4, poison={4: float("nan")})
    ledger = fabric.strategy.ledger
    assert (ledger.updates_applied, ledger.updates_skipped["nonfinite"]) == (2, 1)
    reference = sgd_reference(TinyNet(), [EXAMPLES[:8], EXAMPLES[16:]], lr=LR)  # group 1 made no update
    torch.testing.assert_close(params_vector(model), reference, rtol=0, atol=1e-12)


@pytest.mark.parametrize("policy", ["rescale", "drop"])
def test_the_partial_final_group_follows_the_policy(policy: str) -> None:
    examples = EXAMPLES[:20]  # 2 full groups of 8 and a last one of 4 examples (2 of 4 micro-batches)
    fabric = L.Fabric(strategy=FabricAccumulationStrategy(partial_group=policy), accelerator="cpu")
    model, optimizer = fabric.setup(*_model_and_optimizer())
    records = train(fabric, model, optimizer, micro_batches(examples, 2), 4)
    ledger = fabric.strategy.ledger
    assert ledger.partial_groups == 1
    if policy == "rescale":  # updated with its real denominator: the float64 mean over its 4 examples
        reference = sgd_reference(TinyNet(), [examples[:8], examples[8:16], examples[16:]], lr=LR)
        assert ledger.updates_applied == 3 and records[-1].applied
    else:
        reference = sgd_reference(TinyNet(), [examples[:8], examples[8:16]], lr=LR)
        assert ledger.updates_applied == 2 and records[-1].dropped and ledger.dropped_samples == 4
    torch.testing.assert_close(params_vector(model), reference, rtol=0, atol=1e-12)


def test_axis_lr_follows_applied_updates_in_a_fabric_loop() -> None:
    fp16 = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    fabric = L.Fabric(strategy="accum", accelerator="cpu", plugins=[fp16])
    model, optimizer = _model_and_optimizer(dtype=torch.float32)
    scheduler = AxisLR(optimizer, axis="tokens", lr_lambda=lambda tokens: 1.0 / (1.0 + tokens / 100.0))
    if "scheduler" in inspect.signature(L.Fabric.setup).parameters:  # Fabric 2.6: `fabric.setup` binds it
        model, optimizer, scheduler = fabric.setup(model, optimizer, scheduler=scheduler)
        assert scheduler._engine is fabric.strategy.engine
    else:  # Fabric 2.5: bound by hand, the documented other way
        model, optimizer = fabric.setup(model, optimizer)
        scheduler.bind(fabric.strategy.engine)
    records = train(
        fabric, model, optimizer, micro_batches(EXAMPLES, 2), 4, poison={5: float("inf")}, scheduler=scheduler
    )
    applied_tokens = sum(r.tokens for r in records if r.applied)
    assert not records[1].applied and applied_tokens < fabric.strategy.ledger.tokens
    assert optimizer.param_groups[0]["lr"] == pytest.approx(LR / (1.0 + applied_tokens / 100.0), rel=1e-12)


def test_log_on_axis_writes_the_count_as_x_and_by_name(tmp_path: Path) -> None:
    fabric = L.Fabric(strategy="accum", accelerator="cpu", loggers=CSVLogger(tmp_path, name="csv"))
    model, optimizer = fabric.setup(*_model_and_optimizer())
    batches = micro_batches(EXAMPLES, 2)
    points = []
    for group in range(3):
        (record,) = train(fabric, model, optimizer, batches, 4, start=4 * group, stop=4 * group + 4)
        points.append(log_on_axis(fabric, {"loss": record.loss}))
    fabric.logger.finalize("success")
    with open(Path(fabric.logger.log_dir) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == points == [int(float(r["accum/tokens"])) for r in rows]
    assert points[-1] == fabric.strategy.ledger.tokens and all(not math.isnan(float(r["loss"])) for r in rows)


def _fabric() -> L.Fabric:
    return L.Fabric(strategy="accum", accelerator="cpu")


def _loss(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(batch["input_ids"])
    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE)
    return loss, (batch["labels"] != IGNORE).sum()


def test_a_checkpoint_loaded_without_a_state_object_resumes_the_ledger_and_the_open_group(tmp_path: Path) -> None:
    m, accumulate, stop = 2, 4, 6  # saved after 2 of the second group's 4 micro-batches
    path = tmp_path / "mid.ckpt"
    fabric = _fabric()
    model, optimizer = fabric.setup(*_model_and_optimizer())
    train(fabric, model, optimizer, micro_batches(EXAMPLES, m), accumulate, stop=stop)
    fabric.save(path, {"model": model, "optimizer": optimizer})

    fabric = _fabric()
    model, optimizer = fabric.setup(*_model_and_optimizer(seed=99))
    checkpoint = fabric.load(path)  # no state object: the user restores the weights from what is returned
    assert "lightning_accum" not in checkpoint  # the package's entry was consumed: the loop resumes
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    train(fabric, model, optimizer, micro_batches(EXAMPLES, m), accumulate, start=stop)
    reference = sgd_reference(TinyNet(), _groups(EXAMPLES, 8), lr=LR)
    # Before: the ledger restarted and the open group was lost (2.9e-2 from the reference in the probe).
    torch.testing.assert_close(params_vector(model), reference, rtol=0, atol=1e-12)
    assert (fabric.strategy.ledger.updates_applied, fabric.strategy.ledger.samples) == (3, 24)


def test_axis_lr_without_a_strategy_says_the_fabric_way() -> None:
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scheduler = AxisLR(optimizer, axis="tokens", lr_lambda=lambda tokens: 1.0)
    optimizer.step()
    with pytest.raises(RuntimeError, match=r"In a Fabric loop: `L.Fabric\(strategy='accum'\)`"):
        scheduler.step()


def _a_loop_at_one_micro_batch_per_update(strategy: str, group_size: int | None) -> torch.Tensor:
    """Six AdamW updates of a float32 model, one micro-batch each: with `"accum"` through `accumulate` and
    `close_group`, else the plain loop (`fabric.backward(loss)`)."""
    fabric = L.Fabric(strategy=strategy, accelerator="cpu")
    model = TinyNet().to(torch.float32)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for batch in micro_batches(EXAMPLES, 4):
        loss, tokens = _loss(model, batch)
        if strategy == "accum":
            fabric.backward(fabric.strategy.accumulate(loss, num_tokens=tokens, group_size=group_size))
            fabric.strategy.close_group(optimizer)
        else:
            fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return params_vector(model)


def test_group_size_one_is_the_plain_loop_bit_for_bit() -> None:
    plain = _a_loop_at_one_micro_batch_per_update("auto", None)
    # `group_size=1` declares the group's only micro-batch: c = w, the loss back-propagated as it is, the close's
    # factor exactly 1 (before: 2.4e-7 from the plain loop after six float32 updates, as without `group_size`).
    assert torch.equal(_a_loop_at_one_micro_batch_per_update("accum", 1), plain)


def test_the_one_device_strategies_take_the_device_first_as_lightnings_do() -> None:
    from lightning.fabric.accelerators import CPUAccelerator

    from lightning_accum import AccumulationStrategy, DDPAccumulationStrategy, FabricAccumulationStrategy

    # Before: a device passed positionally was taken as `normalize`, and a strategy given an accelerator instance was
    # refused by Fabric's connector ("accelerator set through both strategy class and accelerator flag").
    strategy = FabricAccumulationStrategy(torch.device("cpu"), accelerator=CPUAccelerator())
    fabric = L.Fabric(strategy=strategy, devices=2)  # as Fabric's SingleDeviceStrategy: the given device is kept
    assert fabric.strategy is strategy and fabric.strategy.root_device == torch.device("cpu")
    assert strategy.engine.options.normalize == "auto"
    assert AccumulationStrategy("cpu").root_device == torch.device("cpu")
    with pytest.raises(TypeError, match="positional argument"):  # the options are by name: never taken silently
        DDPAccumulationStrategy("tokens")  # type: ignore[misc]


def test_the_fabric_strategies_take_the_options_once_by_name_and_name_a_stray_keyword() -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    from lightning_accum import AccumulationOptions, TokenBatches
    from lightning_accum.fabric import (
        FabricAccumulationStrategy,
        FabricDDPAccumulationStrategy,
        FabricModelParallelAccumulationStrategy,
    )
    from lightning_accum.fabric_model_parallel import shard_module_lists

    # Issue #64: the option list is written once (`AccumulationOptions`), not in each Fabric class's signature.
    options = {field for field in AccumulationOptions.__dataclass_fields__}
    classes = (FabricAccumulationStrategy, FabricDDPAccumulationStrategy, FabricModelParallelAccumulationStrategy)
    assert all(not options & set(inspect.signature(cls).parameters) for cls in classes)
    fabric = L.Fabric(strategy=FabricAccumulationStrategy(normalize="tokens", partial_group="drop"), accelerator="cpu")
    assert (fabric.strategy.engine.options.normalize, fabric.strategy.engine.options.partial_group) == (
        "tokens",
        "drop",
    )
    ddp = FabricDDPAccumulationStrategy(normalize="samples", find_unused_parameters=True, timeout=None)
    assert ddp.engine.options.normalize == "samples" and ddp._ddp_kwargs == {"find_unused_parameters": True}
    tokens = TokenBatches(max_tokens=8, lengths="input_ids", samples_per_update=lambda epoch, position: 4)
    sharded = FabricModelParallelAccumulationStrategy(shard_module_lists, token_batches=tokens, timeout=None)
    assert sharded.engine.options.on_nonfinite == "skip" and sharded._timeout is None and sharded._tokens is tokens
    assert STRATEGY_REGISTRY["accum_fsdp"]["init_params"] == {
        "parallelize_fn": shard_module_lists,
        "tensor_parallel_size": 1,
    }
    with pytest.raises(
        TypeError,
        match=r"FabricAccumulationStrategy\(\) got an unexpected keyword argument 'normalise'\. It takes the options of"
        r" exact accumulation: normalize, .*global_order \(see `AccumulationOptions`\), token_batches; and device,"
        r" accelerator, checkpoint_io, precision \(SingleDeviceStrategy's\)\. Pass one of those\.",
    ):
        FabricAccumulationStrategy(normalise="tokens")
    with pytest.raises(TypeError, match=r"argument 'save_checkpoints'.*save_distributed_checkpoint"):
        FabricModelParallelAccumulationStrategy(shard_module_lists, save_checkpoints=True)
    with pytest.raises(ValueError, match=r"`normalize` must be one of"):
        FabricDDPAccumulationStrategy(normalize="words")


def test_a_checkpoint_io_that_returns_no_mapping_is_returned_as_fabric_returns_it(tmp_path: Path) -> None:
    from lightning.fabric.plugins import TorchCheckpointIO

    class Records(TorchCheckpointIO):
        """A user's CheckpointIO whose files hold a list of records, not a state mapping."""

        def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Any = None) -> Any:
            return [("step", 3), ("loss", 0.5)]

    fabric = L.Fabric(strategy="accum", accelerator="cpu", plugins=[Records()])
    # Before: `TypeError: argument of type 'list' is not iterable`-like failures from looking for the package's entry.
    assert fabric.load(tmp_path / "records.bin") == [("step", 3), ("loss", 0.5)]
    assert fabric.strategy.ledger.updates_applied == 0
