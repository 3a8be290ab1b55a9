"""``microbatch_size=``: a loader batch run as slices gives the update of the unsplit batch, exactly; ``"auto"``
recovers from out-of-memory errors (injected: a module that raises ``torch.OutOfMemoryError`` when its input holds
more than k samples, or k padded tokens) without changing the update, on one device and with the error on one DDP rank
only; beside ``token_batches=`` a micro-batch is cut by tokens."""

from __future__ import annotations

import dataclasses
import json
import warnings
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from helpers import (
    IGNORE,
    ListDataset,
    RankStridedSampler,
    RecordOnRanks,
    TinyLM,
    fit,
    load_ranks,
    make_examples,
    make_trainer,
    params_vector,
    random_lengths,
    relative_error,
    sgd_reference,
)
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins import MixedPrecision
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_accum import (
    AccumulationCheck,
    AccumulationReport,
    AccumulationStrategy,
    AxisLogger,
    DDPAccumulationStrategy,
    TokenBatches,
)
from lightning_accum.slicing import slice_batch

#: Weak references to the activations of every attempt that ran out of memory, and how many of them were still alive
#: when the next forward started (a recovery must release a failed attempt before running the slice again).
FAILED: list[weakref.ref[Tensor]] = []
ALIVE_AT_NEXT_FORWARD: list[int] = []
CURRENT: list[weakref.ref[Tensor]] = []  # the running forward's activation


class _Keep(torch.autograd.Function):
    """Identity that saves its input for the backward: the input lives as long as the slice's graph does."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad


class _Gate(torch.autograd.Function):
    """Identity that runs out of memory in its forward or backward when the batch holds more than `limit` samples."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, limit: int, where: str) -> Tensor:
        ctx.limit, ctx.where, ctx.rows = limit, where, x.shape[0]
        ctx.activation = CURRENT[0]
        if where == "forward" and x.shape[0] > limit:
            FAILED.append(ctx.activation)
            raise torch.OutOfMemoryError(f"injected: {x.shape[0]} samples > {limit} in the forward")
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        if ctx.where == "backward" and ctx.rows > ctx.limit:
            FAILED.append(ctx.activation)
            raise torch.OutOfMemoryError(f"injected: {ctx.rows} samples > {ctx.limit} in the backward")
        return grad, None, None


class LimitedLM(TinyLM):
    """TinyLM whose activations "do not fit" above `limit` samples (on `ranks`; every rank when None).

    The gate sits between the embedding and the head, so an error in the backward comes after the head's gradient was
    already accumulated: a recovery that kept that partial gradient would be caught by the comparison. A buffer makes
    DDP broadcast buffers in its forward (a retried forward must not broadcast twice)."""

    def __init__(self, limit: int, where: str = "forward", ranks: tuple[int, ...] | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.limit, self.where, self.ranks = limit, where, ranks
        self.register_buffer("offset", torch.zeros(()))

    def forward(self, input_ids: Tensor) -> Tensor:
        if FAILED:
            ALIVE_AT_NEXT_FORWARD.append(sum(ref() is not None for ref in FAILED))
            FAILED.clear()
        activation = torch.tanh(self.embed(input_ids))
        CURRENT[:] = [weakref.ref(activation)]
        hidden = _Keep.apply(activation) + self.offset  # held by the graph until the backward passes the gate
        if self.ranks is None or self.global_rank in self.ranks:
            hidden = _Gate.apply(hidden, self.limit, self.where)
        return self.head(hidden)


class HookCounter(L.Callback):
    def __init__(self) -> None:
        self.batches = self.before = self.after = 0
        self.losses: list[float] = []

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Tensor) -> None:
        self.before += 1

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.after += 1

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.batches += 1
        self.losses.append(float(outputs["loss"]))


def _examples(n: int = 64, seed: int = 3) -> list[dict[str, Tensor]]:
    return make_examples(random_lengths(n, seed=seed), seed=seed)


def _adamw_run(microbatch_size: Any, examples: list[dict[str, Tensor]], model: TinyLM | None = None, **kw: Any):
    model = model if model is not None else TinyLM(lr=0.05, seed=5, optimizer="adamw")
    strategy = AccumulationStrategy(microbatch_size=microbatch_size, **kw)
    trainer = fit(model, examples, batch_size=8, accumulate=2, strategy=strategy)
    return model, trainer


# ---------------------------------------------------------------------------- splitting


def test_slices_of_two_give_the_unsplit_update_with_adamw() -> None:
    examples = _examples()
    whole, whole_trainer = _adamw_run(None, examples)
    sliced, trainer = _adamw_run(2, examples)
    # 64 examples, batches of 8, A = 2: 4 AdamW updates over variable-length token data.
    assert trainer.strategy.ledger.updates_applied == 4
    assert relative_error(params_vector(sliced), params_vector(whole)) < 1e-6
    # Lightning's units keep their meaning: the ledger counts loader batches; the slices are in `slicing`.
    ledger, whole_ledger = trainer.strategy.ledger.state_dict(), whole_trainer.strategy.ledger.state_dict()
    last, whole_last = ledger.pop("last_group"), whole_ledger.pop("last_group")
    assert ledger == whole_ledger
    assert last.pop("loss") == pytest.approx(whole_last.pop("loss"), rel=1e-6) and last == whole_last
    assert trainer.global_step == whole_trainer.global_step == 4
    assert trainer.strategy.slicing.slice_sizes == {2: 32}
    assert trainer.strategy.slicing.retries == []
    # and the run really differs from the naive mean over slices: Lightning's loss/A per slice is another objective
    naive = TinyLM(lr=0.05, seed=5, optimizer="adamw")
    fit(naive, examples, batch_size=2, accumulate=8, strategy="auto")
    assert relative_error(params_vector(naive), params_vector(whole)) > 1e-4


def test_uneven_slices_match_the_float64_token_weighted_reference() -> None:
    examples = _examples(48, seed=7)
    model = TinyLM(lr=0.5, seed=7)
    expected = sgd_reference(model, [examples[i : i + 16] for i in range(0, 48, 16)], lr=0.5)
    trainer = fit(model, examples, batch_size=8, accumulate=2, strategy=AccumulationStrategy(microbatch_size=3))
    assert relative_error(params_vector(model), expected) < 1e-6
    assert trainer.strategy.slicing.slice_sizes == {3: 12, 2: 6}  # 8 = 3 + 3 + 2, six loader batches


def test_hooks_run_once_per_loader_batch_and_outputs_hold_the_batch_loss() -> None:
    examples = _examples(32, seed=9)
    counter, whole_counter = HookCounter(), HookCounter()
    fit(TinyLM(lr=0.0, seed=9), examples, 8, 2, strategy=AccumulationStrategy(microbatch_size=3), callbacks=[counter])
    fit(TinyLM(lr=0.0, seed=9), examples, 8, 2, strategy="accum", callbacks=[whole_counter])
    assert counter.batches == counter.before == counter.after == 4
    # lr = 0: every batch sees the same parameters, so the batch's loss from slices equals the unsplit one
    assert counter.losses == pytest.approx(whole_counter.losses, rel=1e-6)


@pytest.mark.parametrize("size", [1, "auto"])
def test_slices_of_non_final_batches_make_no_host_sync_in_lightning_accum(size: Any) -> None:
    from host_reads import MicroBatchSyncCounter

    counter = MicroBatchSyncCounter()
    model = LimitedLM(limit=1, lr=0.5, seed=8)  # under "auto" the first batch retries down to slices of 1
    strategy = AccumulationStrategy(microbatch_size=size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the retries' warnings
        fit(model, _examples(16, seed=8), batch_size=4, accumulate=2, strategy=strategy, callbacks=[counter])
    assert counter.non_final_batches == 2 and strategy.slicing.slice_sizes == {1: 16}
    assert counter.non_final.package_ops >= 2 * 4 * 2  # every slice's weighting was seen
    assert counter.non_final.hits == []  # cutting, weighting, keeping gradients aside, retries: no host read
    assert all("tolist" in hit for hit in counter.final.hits) and len(counter.final.hits) == 2


# ---------------------------------------------------------------------------- out of memory


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_auto_recovers_from_out_of_memory_with_the_unsplit_update(where: str) -> None:
    examples = _examples()
    reference, _ = _adamw_run(None, examples)
    model = LimitedLM(limit=3, where=where, lr=0.05, seed=5, optimizer="adamw")
    FAILED.clear()
    ALIVE_AT_NEXT_FORWARD.clear()
    with pytest.warns(UserWarning, match="out of memory in the " + where):
        _, trainer = _adamw_run("auto", examples, model=model)
    assert relative_error(params_vector(model), params_vector(reference)) < 1e-6
    log = trainer.strategy.slicing
    # 8 fails, 4 fails, 2 fits: two retries in the first batch, then slices of 2 for the rest of the run.
    assert [(r.failed_size, r.new_size, r.phase, r.batch_idx, r.update) for r in log.retries] == [
        (8, 4, where, 0, 1),
        (4, 2, where, 0, 1),
    ]
    assert log.size == 2 and log.slice_sizes == {2: 32}
    # Each failed attempt's activations were released before the slice ran again (no traceback or graph kept them).
    assert ALIVE_AT_NEXT_FORWARD == [0, 0]


def test_auto_recovers_inside_a_group_without_touching_its_earlier_gradient() -> None:
    # The first out-of-memory error comes at the group's second batch (position 1): the gradient of the first batch
    # is already accumulated, and the failed backward had already added to the head's gradient.
    examples = _examples(32, seed=11)
    reference, _ = _adamw_run(None, examples)
    model = LimitedLM(limit=3, where="backward", lr=0.05, seed=5, optimizer="adamw")
    # Batches of 8 then 4: the 4-sample batches fit at the start (limit 4 for the first batch only).
    model.limit = 8
    calls = {"n": 0}

    class Tighten(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
            calls["n"] += 1
            pl_module.limit = 8 if batch_idx == 0 else 3

    strategy = AccumulationStrategy(microbatch_size="auto")
    with pytest.warns(UserWarning, match="out of memory in the backward"):
        fit(model, examples, batch_size=8, accumulate=2, strategy=strategy, callbacks=[Tighten()])
    assert relative_error(params_vector(model), params_vector(reference)) < 1e-6
    assert [(r.batch_idx, r.failed_size) for r in strategy.slicing.retries] == [(1, 8), (1, 4)]


class _TokenGate(torch.autograd.Function):
    """Identity that runs out of memory in its forward or backward when the batch holds more than `limit` padded
    tokens (its rows × its longest row of supervised tokens)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, tokens: int, limit: int, where: str) -> Tensor:
        ctx.tokens, ctx.limit, ctx.where = tokens, limit, where
        if where == "forward" and tokens > limit:
            raise torch.OutOfMemoryError(f"injected: {tokens} padded tokens > {limit} in the forward")
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        if ctx.where == "backward" and ctx.tokens > ctx.limit:
            raise torch.OutOfMemoryError(f"injected: {ctx.tokens} padded tokens > {ctx.limit} in the backward")
        return grad, None, None, None


class TokenLimitedLM(TinyLM):
    """TinyLM whose activations "do not fit" above `limit` padded tokens; `pieces`: each step's rows' lengths."""

    def __init__(self, limit: int, where: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.limit, self.where, self.tokens = limit, where, 0
        self.pieces: list[list[int]] = []

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Any:
        self.pieces.append((batch["labels"] != IGNORE).sum(1).tolist())
        self.tokens = len(self.pieces[-1]) * max(self.pieces[-1])
        return super().training_step(batch, batch_idx)

    def forward(self, input_ids: Tensor) -> Tensor:  # the gate between the embedding and the head, as LimitedLM's
        return self.head(_TokenGate.apply(torch.tanh(self.embed(input_ids)), self.tokens, self.limit, self.where))


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_auto_beside_token_batches_cuts_a_micro_batch_by_tokens_and_keeps_its_group(where: str) -> None:
    # Groups of B = 12 rows of 6, 6 and ten 1s supervised tokens, cut under 36 padded tokens into [6, 6, 1, 1, 1, 1]
    # and [1] * 6. 36 padded tokens do not fit in 13: the first such micro-batch runs out of memory and is cut by
    # tokens, under 18, into [6, 6] and [1] * 4 (12 and 4), where halving its rows ([6, 6, 1], 18) would fail again;
    # the limit of 18 tokens stays, each later [6, 6, 1, 1, 1, 1] is cut as it comes and every [1] * 6 runs whole.
    lengths = ([6, 6] + [1] * 10) * 4
    examples = make_examples(lengths, seed=4)
    expected = sgd_reference(TinyLM(seed=4), [examples[g : g + 12] for g in range(0, 48, 12)], lr=0.5)
    model = TokenLimitedLM(limit=13, where=where, lr=0.5, seed=4)
    tokens = TokenBatches(max_tokens=36, lengths=lengths)
    strategy = AccumulationStrategy(microbatch_size="auto", token_batches=tokens)
    loader = DataLoader(ListDataset(examples), batch_size=6)  # B = 6 × 2 × 1, in the data's order
    with pytest.warns(UserWarning, match=f"out of memory in the {where} of a slice of 6 sample.* slices of 18 tokens"):
        make_trainer(strategy=strategy, accumulate_grad_batches=2, precision="64-true").fit(model, loader)
    diff = float((params_vector(model) - expected).abs().max())
    print(f"out of memory in the {where}, cut by tokens: |params - float64 groups| = {diff:.1e}")
    assert diff < 1e-12
    log = strategy.slicing
    assert [(r.failed_size, r.new_size, r.phase) for r in log.retries] == [(36, 18, where)]
    assert (log.unit, log.size, log.slice_sizes) == ("tokens", 18, {2: 4, 4: 4, 6: 4})
    fits = sorted(p for p in model.pieces if len(p) * max(p) <= 13)  # all but the failed attempt's step
    assert len(model.pieces) == len(fits) + 1 and fits == sorted([[6, 6]] * 4 + [[1] * 4] * 4 + [[1] * 6] * 4)


def test_auto_report_lists_the_retries(tmp_path: Path) -> None:
    model = LimitedLM(limit=2, lr=0.1, seed=2)
    report = AccumulationReport(path=tmp_path / "report.json")
    with pytest.warns(UserWarning, match="out of memory"):
        fit(model, _examples(16), 8, 1, strategy=AccumulationStrategy(microbatch_size="auto"), callbacks=[report])
    record = json.loads((tmp_path / "report.json").read_text())
    slicing = record["microbatch_slicing"]
    assert slicing["configured"] == "auto"
    assert slicing["per_rank"][0]["size"] == 2
    assert slicing["per_rank"][0]["slice_sizes"] == {"2": 8}
    retries = slicing["per_rank"][0]["retries"]
    assert [(r["failed_size"], r["new_size"], r["rank"], r["phase"]) for r in retries] == [
        (8, 4, 0, "forward"),
        (4, 2, 0, "forward"),
    ]


def test_a_single_sample_that_does_not_fit_is_a_clear_error() -> None:
    model = LimitedLM(limit=0, lr=0.1, seed=2)
    with pytest.warns(UserWarning, match="out of memory"), pytest.raises(RuntimeError, match="slice of 1 sample") as e:
        fit(model, _examples(8), 4, 1, strategy=AccumulationStrategy(microbatch_size="auto"))
    assert "slice sizes run so far" in str(e.value) and "retries: 2" in str(e.value)
    assert isinstance(e.value.__cause__, torch.OutOfMemoryError)


def test_a_fixed_size_does_not_hide_out_of_memory() -> None:
    model = LimitedLM(limit=2, lr=0.1, seed=2)
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        fit(model, _examples(8), 8, 1, strategy=AccumulationStrategy(microbatch_size=3))  # 3 + 3 + 2


def test_auto_size_survives_a_checkpoint(tmp_path: Path) -> None:
    model = LimitedLM(limit=2, lr=0.1, seed=2)
    with pytest.warns(UserWarning, match="out of memory"):
        trainer = fit(model, _examples(16), 8, 1, strategy=AccumulationStrategy(microbatch_size="auto"))
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    strategy = AccumulationStrategy(microbatch_size="auto")
    resumed = make_trainer(strategy=strategy, max_epochs=2)
    loader = DataLoader(ListDataset(_examples(16)), batch_size=8)
    resumed.fit(LimitedLM(limit=2, lr=0.1, seed=2), loader, ckpt_path=tmp_path / "last.ckpt")  # no warning: no retry
    assert strategy.slicing.size == 2
    assert len(strategy.slicing.retries) == 2  # the first run's, from the checkpoint
    assert strategy.slicing.slice_sizes == {2: 16}  # 8 slices in each epoch


def test_fp16_with_a_grad_scaler_slices_give_the_unsplit_update() -> None:
    # Every slice's backward is scaled by the GradScaler like Lightning's own backward and the update is unscaled
    # once: with SGD, a wrong scale on any slice would show in the parameters' change in proportion.
    examples = _examples(32, seed=17)
    changes = []
    for size in (None, 3):
        model = TinyLM(lr=0.5, seed=17)
        before = params_vector(model)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
        trainer = fit(model, examples, 8, 2, strategy=AccumulationStrategy(microbatch_size=size), plugins=[plugin])
        assert trainer.strategy.ledger.updates_applied == 2
        changes.append(params_vector(model) - before)
    # fp16 autocast rounds each slice's activations differently from the whole batch's: fp16-level agreement.
    assert relative_error(changes[1], changes[0]) < 5e-3


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_ddp_out_of_memory_in_the_synchronising_backward_is_a_clear_error_not_a_hang() -> None:
    # A = 1: every batch's last slice synchronises; rank 1 runs out of memory in that backward.
    model = LimitedLM(limit=3, where="backward", ranks=(1,), lr=0.05, seed=5)
    strategy = DDPAccumulationStrategy(start_method="forkserver", microbatch_size="auto", timeout=timedelta(seconds=60))
    with pytest.raises(Exception, match="synchronises gradients over the replicas") as failure:
        fit(model, _examples(16), 8, 1, strategy=strategy, devices=2)
    assert "microbatch_size=4" in str(failure.value)


def test_accumulation_check_and_axis_logger_keep_their_meaning(tmp_path: Path) -> None:
    examples = _examples(32, seed=21)
    curves = {}
    for size in (None, 3):
        check = AccumulationCheck()  # the group of sliced batches against the same examples in one (whole) batch
        logger = TensorBoardLogger(tmp_path, name=f"size{size}", version=0)
        fit(
            TinyLM(lr=0.5, seed=21),
            examples,
            8,
            2,
            strategy=AccumulationStrategy(microbatch_size=size),
            callbacks=[check, AxisLogger(axis="tokens")],
            logger=logger,
            log_every_n_steps=1,
        )
        assert check.result is not None and check.result.errors == [] and check.result.relative_error < 1e-5
        events = EventAccumulator(str(tmp_path / f"size{size}" / "version_0"), size_guidance={"scalars": 0})
        events.Reload()
        curves[size] = [(e.step, e.value) for e in events.Scalars("accum/loss")]
    assert [s for s, _ in curves[3]] == [s for s, _ in curves[None]] and len(curves[3]) == 2  # the tokens axis
    assert [v for _, v in curves[3]] == pytest.approx([v for _, v in curves[None]], rel=1e-5)


class ManualLM(TinyLM):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(self.mean_loss(batch))
        optimizer.step()


def test_manual_optimization_with_microbatch_size_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="automatic_optimization = False"):
        fit(ManualLM(), _examples(8), 4, 1, strategy=AccumulationStrategy(microbatch_size=2))


def test_a_parameter_group_added_during_the_run_is_sliced_exactly() -> None:
    # The head is frozen at first and joins the optimizer at batch 2 (as BackboneFinetuning does): its gradient from
    # the earlier slices of a group's first batch must be kept aside across Lightning's zero_grad like the others'.
    class Unfreeze(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 2:
                pl_module.head.requires_grad_(True)
                trainer.optimizers[0].add_param_group({"params": list(pl_module.head.parameters())})

    class Frozen(TinyLM):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            self.head.requires_grad_(False)
            return torch.optim.SGD(self.embed.parameters(), lr=self.lr)

    examples = _examples(48, seed=23)
    runs = []
    for size in (None, 3):
        model = Frozen(lr=0.5, seed=23)
        fit(model, examples, 8, 2, strategy=AccumulationStrategy(microbatch_size=size), callbacks=[Unfreeze()])
        runs.append(params_vector(model))
    assert relative_error(runs[1], runs[0]) < 1e-6


def test_a_batch_kept_as_a_list_of_samples_with_per_sample_strings() -> None:
    examples = [dict(e, text=f"sample {i}") for i, e in enumerate(_examples(32, seed=25))]
    seen: list[list[str]] = []

    class ListLM(TinyLM):
        def training_step(self, batch: list[dict[str, Any]], batch_idx: int) -> Any:
            seen.append([item["text"] for item in batch])
            stacked = {k: torch.stack([item[k] for item in batch]) for k in ("input_ids", "labels")}
            return super().training_step(stacked, batch_idx)

    def keep(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return items

    model = ListLM(lr=0.5, seed=25)
    expected = sgd_reference(model, [examples[i : i + 16] for i in range(0, 32, 16)], lr=0.5)
    strategy = AccumulationStrategy(microbatch_size=3)
    fit(model, examples, 8, 2, strategy=strategy, collate_fn=keep)
    assert relative_error(params_vector(model), expected) < 1e-6
    assert seen[:3] == [
        ["sample 0", "sample 1", "sample 2"],
        ["sample 3", "sample 4", "sample 5"],
        ["sample 6", "sample 7"],
    ]
    part = slice_batch({"ids": torch.zeros(4, 2), "text": ["a", "b", "c", "d"], "pair": ("x", "y")}, 1, 3, 4)
    assert part["text"] == ["b", "c"] and part["pair"] == ("x", "y") and part["ids"].shape == (2, 2)


def test_a_last_slice_without_a_loss_keeps_the_batch_s_earlier_slices() -> None:
    # The step returns None for the 2-sample slice ending each batch (8 = 3 + 3 + 2): Lightning runs no backward for
    # it; the slices before it are in the update all the same (at A = 1 each group's first batch is its last).
    class NoLossForPairs(TinyLM):
        def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Any:
            return None if batch["input_ids"].shape[0] == 2 else super().training_step(batch, batch_idx)

    examples = _examples(16, seed=27)
    model = NoLossForPairs(lr=0.5, seed=27)
    kept = [examples[:6], examples[8:14]]
    expected = sgd_reference(model, kept, lr=0.5)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*returned `None`")  # Lightning's note for a step without a loss
        trainer = fit(model, examples, 8, 1, strategy=AccumulationStrategy(microbatch_size=3))
    assert trainer.strategy.ledger.updates_applied == 2
    assert relative_error(params_vector(model), expected) < 1e-6


# ---------------------------------------------------------------------------- errors and batch types


def test_invalid_options_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="positive int, 'auto' or None; got 0"):
        AccumulationStrategy(microbatch_size=0)
    with pytest.raises(ValueError, match="got 'big'"):
        AccumulationStrategy(microbatch_size="big")
    with pytest.raises(ValueError, match="normalize='batches'"):
        AccumulationStrategy(microbatch_size=2, normalize="batches")
    with pytest.raises(TypeError, match="split_batch"):
        AccumulationStrategy(microbatch_size=2, split_batch="first")


@dataclasses.dataclass
class Packed:
    """A custom batch type: token ids and labels, with the number of rows kept apart."""

    ids: Tensor
    labels: Tensor

    def __len__(self) -> int:
        return self.ids.shape[0]


class PackedLM(TinyLM):
    def training_step(self, batch: Packed, batch_idx: int) -> Any:
        return super().training_step({"input_ids": batch.ids, "labels": batch.labels}, batch_idx)


def test_a_custom_batch_type_is_cut_by_the_users_split_function() -> None:
    examples = _examples(32, seed=4)

    def collate(items: list[dict[str, Tensor]]) -> Packed:
        return Packed(torch.stack([i["input_ids"] for i in items]), torch.stack([i["labels"] for i in items]))

    cuts: list[tuple[int, int]] = []

    def split(batch: Packed, start: int, stop: int) -> Packed:
        cuts.append((start, stop))
        return Packed(batch.ids[start:stop], batch.labels[start:stop])

    model = PackedLM(lr=0.5, seed=4)
    expected = sgd_reference(model, [examples[i : i + 8] for i in range(0, 32, 8)], lr=0.5)
    strategy = AccumulationStrategy(microbatch_size=3, split_batch=split)
    fit(model, examples, 4, 2, strategy=strategy, collate_fn=collate)
    assert relative_error(params_vector(model), expected) < 1e-6
    assert cuts[:2] == [(0, 2), (2, 4)]  # 4 samples at 3: 2 + 2


# ---------------------------------------------------------------------------- DDP


class RecordSlicing(RecordOnRanks):
    """Also saves each rank's slicing record (it differs by rank)."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        path = Path(self.folder) / f"{self.name}-slicing{trainer.global_rank}.json"
        path.write_text(json.dumps(trainer.strategy.slicing.state_dict()))


def _without_loss(ledger: dict[str, Any]) -> tuple[dict[str, Any], float]:
    ledger = json.loads(json.dumps(ledger))
    return ledger, ledger["last_group"].pop("loss")


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_ddp_slices_and_an_out_of_memory_error_on_one_rank(tmp_path: Path) -> None:
    examples = _examples(64, seed=13)
    runs = {
        "whole": (TinyLM(lr=0.05, seed=5, optimizer="adamw"), None),
        "sliced": (TinyLM(lr=0.05, seed=5, optimizer="adamw"), 2),
        # Rank 1 alone runs out of memory above 3 samples (in the forward): it retries alone, rank 0 keeps whole
        # batches; the model's buffer makes DDP broadcast buffers in the forward that fails and is run again.
        "auto": (LimitedLM(limit=3, ranks=(1,), lr=0.05, seed=5, optimizer="adamw"), "auto"),
    }
    for name, (model, size) in runs.items():
        strategy = DDPAccumulationStrategy(start_method="spawn", microbatch_size=size)
        checkpoints = {"enable_checkpointing": True, "default_root_dir": str(tmp_path / name)}
        fit(
            model,
            examples,
            8,
            2,
            strategy=strategy,
            callbacks=[RecordSlicing(str(tmp_path), name)],
            devices=2,
            **(checkpoints if name == "auto" else {}),
        )
    # Resumed for a second epoch: each rank keeps its own slice size from the checkpoint (rank 1 retries no more).
    resumed = make_trainer(
        strategy=DDPAccumulationStrategy(start_method="spawn", microbatch_size="auto"),
        devices=2,
        accumulate_grad_batches=2,
        max_epochs=2,
        callbacks=[RecordSlicing(str(tmp_path), "resumed")],
    )
    (checkpoint,) = (tmp_path / "auto").rglob("*.ckpt")
    loader = DataLoader(ListDataset(examples), batch_size=8, sampler=RankStridedSampler(len(examples)))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*callbacks used to create the checkpoint")
        resumed.fit(LimitedLM(limit=3, ranks=(1,), lr=0.05, seed=5, optimizer="adamw"), loader, ckpt_path=checkpoint)
    whole = load_ranks(str(tmp_path), "whole")
    reference, reference_loss = _without_loss(whole[0]["ledger"])
    for name in ("sliced", "auto"):
        for rank in load_ranks(str(tmp_path), name):
            assert relative_error(rank["params"], whole[0]["params"]) < 1e-6
            ledger, loss = _without_loss(rank["ledger"])
            assert ledger == reference and loss == pytest.approx(reference_loss, rel=1e-6)
    slicing = [json.loads((tmp_path / f"auto-slicing{r}.json").read_text()) for r in (0, 1)]
    assert slicing[0]["retries"] == [] and slicing[0]["slice_sizes"] == {"8": 4}
    assert [(r["rank"], r["failed_size"], r["new_size"]) for r in slicing[1]["retries"]] == [(1, 8, 4), (1, 4, 2)]
    assert slicing[1]["slice_sizes"] == {"2": 16}
    after = [json.loads((tmp_path / f"resumed-slicing{r}.json").read_text()) for r in (0, 1)]
    assert after[0]["size"] is None and after[0]["retries"] == [] and after[0]["slice_sizes"] == {"8": 8}
    assert after[1]["size"] == 2 and after[1]["retries"] == slicing[1]["retries"]  # no new retry
    assert after[1]["slice_sizes"] == {"2": 32}
    sliced = json.loads((tmp_path / "sliced-slicing1.json").read_text())
    assert sliced == {"configured": 2, "size": 2, "unit": "samples", "slice_sizes": {"2": 16}, "retries": []}


# ---------------------------------------------------------------------------- FSDP2


def _fsdp_sliced_runs(rank: int, folder: str) -> None:
    from lightning_accum import ModelParallelAccumulationStrategy
    from strategies.test_model_parallel import Record, ShardedLM, _fit

    examples = make_examples(random_lengths(13, seed=19), seed=19)
    for mode in ("every_microbatch", "last_microbatch"):
        strategy = ModelParallelAccumulationStrategy(tensor_parallel_size=1, gradient_sync=mode, microbatch_size=2)
        _fit(ShardedLM("fsdp"), examples, strategy, 4, 1, 2, [Record(folder, mode)], split=True)
        Path(folder, f"{mode}-slicing{rank}.json").write_text(json.dumps(strategy.slicing.state_dict()))
    # Slices of 1: rank 0's second batch needs 3 slices, rank 1's holds 2 samples: an error on both ranks.
    strategy = ModelParallelAccumulationStrategy(tensor_parallel_size=1, microbatch_size=1)
    try:
        _fit(ShardedLM("fsdp"), examples, strategy, 4, 1, 2, [], split=True)
    except RuntimeError as error:
        Path(folder, f"uneven-rank{rank}.txt").write_text(str(error))


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_fsdp2_slices_match_the_single_process_run_and_ranks_agree_on_the_slice_count(tmp_path: Path) -> None:
    # 13 examples, batches of 4 per rank, A = 1, D = 2: update 1 holds examples 0-7 (4 + 4), update 2 examples 8-12
    # (rank 0: 3, rank 1: 2). Slices of 2: rank 0 cuts 3 into 2 + 1, rank 1 its 2 into 1 + 1 to run as many slices.
    from helpers import run_ddp

    from strategies.test_model_parallel import Record, ShardedLM, _fit, _load

    run_ddp(_fsdp_sliced_runs, str(tmp_path))
    examples = make_examples(random_lengths(13, seed=19), seed=19)
    _fit(ShardedLM(), examples, "accum", 8, 1, 1, [Record(str(tmp_path), "single")], split=False)
    single = torch.load(tmp_path / "single-rank0.pt", weights_only=True)
    for mode in ("every_microbatch", "last_microbatch"):
        for rank in _load(str(tmp_path), mode):
            assert relative_error(rank["params"], single["params"]) < 1e-5, mode
        slicing = [json.loads((tmp_path / f"{mode}-slicing{r}.json").read_text()) for r in (0, 1)]
        assert slicing[0]["slice_sizes"] == {"2": 3, "1": 1}  # 4 = 2 + 2, then 3 = 2 + 1
        assert slicing[1]["slice_sizes"] == {"2": 2, "1": 2}  # 4 = 2 + 2, then 2 = 1 + 1
    for rank in (0, 1):
        message = (tmp_path / f"uneven-rank{rank}.txt").read_text()
        assert "holds 2 sample(s), fewer than the 3 slices" in message


@pytest.mark.parametrize("size", [1, "auto"])
def test_a_checkpoint_inside_a_group_of_sliced_batches_resumes_exactly(tmp_path: Path, size: Any) -> None:
    from helpers import ResumableLoader

    from strategies.test_checkpoint import _Interrupted

    examples = _examples(16, seed=52)  # 8 batches of 2 an epoch, A = 3: groups of 3, 3, 2

    def run(model: _Interrupted, ckpt_path: Path | None = None) -> L.Trainer:
        trainer = make_trainer(
            strategy=AccumulationStrategy(microbatch_size=size), accumulate_grad_batches=3, max_epochs=2
        )
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*callbacks used to create the checkpoint")
            trainer.fit(model, ResumableLoader(ListDataset(examples), batch_size=2), ckpt_path=ckpt_path)
        return trainer

    whole_model = _Interrupted()
    whole = run(whole_model)
    # A checkpoint between the 2nd and 3rd batch of epoch 1's 1st group: it carries that group's gradient.
    run(_Interrupted(("callback", 1, 1), str(tmp_path)))
    state = torch.load(tmp_path / "by_callback.ckpt", weights_only=True)["lightning_accum"]
    assert state["open_group_microbatches"] == 2 and "gradients" in state["open_group"]
    resumed_model = _Interrupted()
    resumed = run(resumed_model, tmp_path / "by_callback.ckpt")
    assert resumed.strategy.ledger == whole.strategy.ledger
    torch.testing.assert_close(params_vector(resumed_model), params_vector(whole_model), rtol=1e-6, atol=1e-7)
