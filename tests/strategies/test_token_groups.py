"""`token_batches=` in real fits: each update is the float64 token-weighted gradient of the fixed-`m` run's group with
`global_order=True` (one device, DDP and FSDP2 on 2 processes, a Fabric loop), Lightning's loop right in every
epoch of a varying length (its end, validation, limits, `max_steps`, the progress bar), resumes, and bad input."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from helpers import (
    IGNORE,
    CheckpointAt,
    EvalLM,
    ListDataset,
    TinyLM,
    forked_ddp,
    full_params,
    load_ranks,
    make_examples,
    make_trainer,
    params_vector,
    random_lengths,
    run_ddp,
    sgd_reference,
    token_weighted_grad,
)
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, SequentialSampler

from lightning_accum import (
    AccumulationStrategy,
    BatchSchedule,
    FabricAccumulationStrategy,
    FabricDDPAccumulationStrategy,
    GlobalOrderSampler,
    ModelParallelAccumulationStrategy,
    TokenBatches,
    TokenBatchSampler,
)

LR = 0.5


@pytest.fixture(autouse=True)
def _seed_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)  # the order's seed is Lightning's: 0, here and in the workers


def _examples(n: int, seed: int = 59) -> list[dict[str, torch.Tensor]]:
    """Rows of 1 to 6 supervised tokens, each with its index (the micro-batches' records read it back)."""
    rows = make_examples(random_lengths(n, seed=seed), seed=seed)
    return [{**row, "index": torch.tensor(i)} for i, row in enumerate(rows)]


def _lengths(examples: list[dict[str, torch.Tensor]]) -> list[int]:
    return [int((row["labels"] != IGNORE).sum()) for row in examples]


def _reference(examples: list[dict[str, torch.Tensor]], b: int, replicas: int, epochs: int) -> torch.Tensor:
    """float64 SGD, one token-weighted update per block of B positions of each epoch's order (`global_order=True`'s
    groups, the tail rule), from TinyLM(seed=59)."""
    covered = replicas * (len(examples) // replicas)
    orders = [GlobalOrderSampler(examples, seed=0).order(epoch)[:covered] for epoch in range(epochs)]
    groups = [[examples[i] for i in order[s : s + b]] for order in orders for s in range(0, covered, b)]
    return sgd_reference(TinyLM(seed=59), groups, lr=LR)


def _tokens(examples: list[dict[str, torch.Tensor]], max_tokens: int, **options: Any) -> TokenBatches:
    return TokenBatches(max_tokens=max_tokens, lengths=_lengths(examples), **options)


def _loader(examples: list[dict[str, torch.Tensor]], m: int, shuffle: bool = True) -> DataLoader:
    return DataLoader(ListDataset(examples), batch_size=m, shuffle=shuffle)


class Watch(L.Callback):
    """Per epoch: the indices of each micro-batch, Lightning's count and the progress bar's total at its start,
    where validation ran; written to `folder/name-rank{r}.pt` with the parameters and the ledger at the end."""

    def __init__(self, folder: str = "", name: str = "") -> None:
        self.folder, self.name = folder, name
        self.batches: list[list[list[int]]] = []
        self.counts: list[int] = []
        self.totals: list[Any] = []
        self.validations: list[tuple[int, int]] = []
        self.epoch = -1

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if self.epoch != trainer.current_epoch:  # an epoch's first batch (a resumed one's too)
            self.epoch, bar = trainer.current_epoch, trainer.progress_bar_callback
            self.batches.append([])
            self.counts.append(trainer.num_training_batches)
            self.totals += [] if bar is None else [bar.train_progress_bar.total]  # type: ignore[attr-defined]
        self.batches[-1].append(batch["index"].tolist())

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.validations.append((trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_idx))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.folder:
            state = {"batches": self.batches, "params": full_params(pl_module)}
            state |= {"ledger": trainer.strategy.ledger.state_dict(), "counts": self.counts}  # type: ignore[attr-defined]
            torch.save(state, os.path.join(self.folder, f"{self.name}-rank{trainer.global_rank}.pt"))


def _fit(
    strategy: Any,
    examples: list[Any],
    m: int,
    a: int,
    model: L.LightningModule | None = None,
    callbacks: tuple[L.Callback, ...] = (),
    record: tuple[str, str] = ("", ""),
    **kwargs: Any,
) -> tuple[L.Trainer, L.LightningModule, Watch]:
    watch = Watch(*record)
    val, ckpt = kwargs.pop("val_dataloaders", None), kwargs.pop("ckpt_path", None)
    kwargs.setdefault("precision", "64-true")
    trainer = make_trainer(strategy=strategy, accumulate_grad_batches=a, callbacks=[watch, *callbacks], **kwargs)
    model = model or TinyLM(lr=LR, seed=59)
    trainer.fit(model, _loader(examples, m), val, ckpt_path=ckpt)
    return trainer, model, watch


def _check_epochs(ranks: list[dict[str, Any]], lengths: list[int], max_tokens: int) -> None:
    """Every epoch reads each position of its order once over the replicas (the tail left out), within the budget,
    in as many micro-batches on every replica as Lightning counted at its start, reshuffled."""
    covered = len(ranks) * (len(lengths) // len(ranks))
    for epoch in range(len(ranks[0]["batches"])):
        seen = sorted(i for rank in ranks for batch in rank["batches"][epoch] for i in batch)
        assert len(seen) == len(set(seen)) == covered, (epoch, seen)
        assert set(seen) == set(GlobalOrderSampler(lengths, seed=0).order(epoch)[:covered])
        for rank in ranks:
            assert all(len(b) * max(lengths[i] for i in b) <= max_tokens for b in rank["batches"][epoch])
    for rank in ranks:
        assert rank["counts"] == ranks[0]["counts"] == [len(epoch) for epoch in rank["batches"]]
    assert ranks[0]["batches"][0] != ranks[0]["batches"][1]


@pytest.mark.parametrize("max_tokens", [6, 10, 18])
def test_one_device_updates_are_the_float64_groups_of_the_fixed_m_run_and_every_epoch_is_read_once(
    max_tokens: int,
) -> None:
    examples = _examples(44)  # B = 4 · 2 = 8: five full groups and one of 4 per epoch
    expected = _reference(examples, b=8, replicas=1, epochs=2)
    strategy = AccumulationStrategy(token_batches=_tokens(examples, max_tokens))
    trainer, model, watch = _fit(strategy, examples, m=4, a=2, max_epochs=2)
    diff = float((params_vector(model) - expected).abs().max())
    print(f"max_tokens={max_tokens}, D=1: epochs of {watch.counts} micro-batches, |params - float64| = {diff:.1e}")
    assert diff < 1e-12
    _check_epochs([{"batches": watch.batches, "counts": watch.counts}], _lengths(examples), max_tokens)
    ledger = trainer.strategy.ledger  # type: ignore[attr-defined]
    assert (ledger.samples, ledger.updates_applied, ledger.microbatches) == (88, 12, sum(watch.counts))
    assert trainer.accumulate_grad_batches == 2  # given back
    assert isinstance(trainer.strategy.token_sampler, TokenBatchSampler)  # type: ignore[attr-defined]
    # The fixed-m run with `global_order=True` reaches the same parameters.
    _, fixed, _ = _fit(AccumulationStrategy(global_order=True), examples, m=4, a=2, max_epochs=2)
    assert float((params_vector(fixed) - params_vector(model)).abs().max()) < 1e-12


def _ramp(epoch: int, position: int) -> int:
    return 4 if position < 16 else 8  # a batch by the position in the epoch (a samples-axis schedule)


def test_a_batch_that_is_a_function_of_the_position_is_planned_whole_and_exact() -> None:
    examples = _examples(44)
    strategy = AccumulationStrategy(token_batches=_tokens(examples, 8, samples_per_update=_ramp))
    trainer, model, watch = _fit(strategy, examples, m=4, a=1, max_epochs=2)
    order = [GlobalOrderSampler(examples, seed=0).order(epoch) for epoch in (0, 1)]
    spans = [(0, 4), (4, 8), (8, 12), (12, 16), (16, 24), (24, 32), (32, 40), (40, 44)]
    expected = sgd_reference(TinyLM(seed=59), [[examples[i] for i in o[a:b]] for o in order for a, b in spans], lr=LR)
    assert float((params_vector(model) - expected).abs().max()) < 1e-12
    assert watch.counts == [len(epoch) for epoch in watch.batches] and trainer.strategy.ledger.updates_applied == 16  # type: ignore[attr-defined]


#: Three-stage ramps, on each axis, over two epochs of 44 examples (B a multiple of m·D = 4 for the fixed-m run).
RAMPS = {
    "samples": BatchSchedule({0: 4, 12: 8, 48: 16}, axis="samples", lr_scaling="sqrt"),
    "tokens": BatchSchedule({0: 4, 24: 8, 120: 16}, axis="tokens"),
    "updates": BatchSchedule({0: 4, 4: 8, 7: 16}, axis="updates"),
}


def _scheduled_groups(examples: list[Any], schedule: BatchSchedule, replicas: int = 1, epochs: int = 2) -> list[Any]:
    """The fixed-m scheduled run's groups with `global_order=True`, as (epoch, position, B, indices, lr factor): each
    epoch's order (the tail rule) in blocks of the stage's B at the run's count where the block starts."""
    covered, lengths, count, groups = replicas * (len(examples) // replicas), _lengths(examples), 0, []
    for epoch in range(epochs):
        order, position = GlobalOrderSampler(examples, seed=0).order(epoch)[:covered], 0
        while position < covered:
            stage = schedule.stage_at(count)
            group = order[position : position + stage.samples]
            groups.append((epoch, position, stage.samples, group, schedule.lr_factor(stage)))
            position += stage.samples
            count += {"samples": len(group), "tokens": sum(lengths[i] for i in group), "updates": 1}[schedule.axis]
    return groups


def _scheduled_reference(examples: list[Any], groups: list[Any], skip: tuple[int, ...] = ()) -> torch.Tensor:
    """float64 SGD from TinyLM(seed=59): one token-weighted update per group (but those in `skip`), at its stage's
    learning rate."""
    model = TinyLM(seed=59).double()
    for k, (_, _, _, indices, factor) in enumerate(groups):
        grad, offset = token_weighted_grad(model, [examples[i] for i in indices]), 0
        with torch.no_grad():
            for p in model.parameters():
                p -= 0 if k in skip else LR * factor * grad[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
    return params_vector(model)


def _scheduled_sizes(examples: list[Any], groups: list[Any], max_tokens: int, epoch: int) -> list[int]:
    """The micro-batches of each group of `epoch` of the token plan of the scheduled run's groups."""
    samples = {position: b for e, position, b, _, _ in groups if e == epoch}
    sampler = TokenBatchSampler(examples, _lengths(examples), max_tokens, lambda _, position: samples[position])
    sampler.set_epoch(epoch)
    return sampler.group_sizes()


@pytest.mark.parametrize("axis", ["samples", "tokens", "updates"])
def test_a_batch_schedule_gives_each_group_its_stages_b_and_the_fixed_m_scheduled_runs_update(axis: str) -> None:
    examples, schedule = _examples(44), RAMPS[axis]
    groups = _scheduled_groups(examples, schedule)
    expected = _scheduled_reference(examples, groups)
    # The fixed-m scheduled run (m = 4) reaches the hand loop's parameters: the reference is that run's.
    _, fixed, _ = _fit(AccumulationStrategy(batch_schedule=schedule, global_order=True), examples, 4, 1, max_epochs=2)
    assert float((params_vector(fixed) - expected).abs().max()) < 1e-12
    for max_tokens in (6, 12):
        strategy = AccumulationStrategy(token_batches=_tokens(examples, max_tokens), batch_schedule=schedule)
        trainer, model, watch = _fit(strategy, examples, 4, 1, max_epochs=2)
        diff = float((params_vector(model) - expected).abs().max())
        print(f"{axis} ramp, max_tokens={max_tokens}: B {[g[2] for g in groups]}, |params - float64| = {diff:.1e}")
        assert diff < 1e-12
        stages = trainer.strategy.batch_stages  # type: ignore[attr-defined]
        assert [s["samples_per_update"] for s in stages] == [4, 8, 16]
        assert sum(s["attempts"] for s in stages) == len(groups)
        assert watch.counts == [sum(_scheduled_sizes(examples, groups, max_tokens, e)) for e in (0, 1)]
        _check_epochs([{"batches": watch.batches, "counts": watch.counts}], _lengths(examples), max_tokens)


def test_a_resume_inside_a_stage_continues_the_ramp_exactly(tmp_path: Path) -> None:
    examples, path, schedule = _examples(44), tmp_path / "ramp.ckpt", RAMPS["tokens"]
    tokens = _tokens(examples, 8)

    def run(**kwargs: Any) -> tuple[L.Trainer, L.LightningModule, Watch]:
        strategy = AccumulationStrategy(token_batches=tokens, batch_schedule=schedule)
        return _fit(strategy, examples, 4, 1, TinyLM(lr=LR, seed=59).double(), max_epochs=2, **kwargs)

    trainer, whole, watch = run()
    groups = _scheduled_groups(examples, schedule)
    sizes, k = _scheduled_sizes(examples, groups, 8, 0), [g[2] for g in groups].index(8)  # stage 1's first group
    at = sum(sizes[:k]) + 1  # its second micro-batch (of 3 or more)
    assert sizes[k] > 2
    with pytest.raises(_Stop):
        run(callbacks=(_CheckpointAndStop(path, at),))
    state = _loader_state(path)
    assert (state["epoch"], state["position"], state["done"], state["samples"]) == (0, groups[k][1], 2, 8)
    resumed_trainer, model, resumed = run(ckpt_path=path)
    assert resumed.batches == [watch.batches[0][at + 1 :], watch.batches[1]]
    diff = float((params_vector(model) - params_vector(whole)).abs().max())
    print(f"tokens ramp resumed inside group {k} (stage 1): |params - uninterrupted| = {diff:.1e}")
    assert diff < 1e-12
    assert resumed_trainer.strategy.batch_stages == trainer.strategy.batch_stages  # type: ignore[attr-defined]


def test_a_tokens_ramp_refuses_lengths_that_are_not_the_reported_tokens() -> None:
    examples = _examples(44)
    tokens = TokenBatches(max_tokens=14, lengths=[n + 1 for n in _lengths(examples)])  # a causal shift's off-by-one
    strategy = AccumulationStrategy(token_batches=tokens, batch_schedule=RAMPS["tokens"])
    match = r"`batch_schedule=` on tokens beside `token_batches=`: epoch 0's plan put the group at position 4 after"
    with pytest.raises(RuntimeError, match=match + r" \d+ tokens of the run, but the ledger counts \d+\. .* `lengths`"):
        _fit(strategy, examples, 4, 1)


@pytest.mark.parametrize("policy", ["drop", "rescale"])
def test_an_epochs_last_group_of_fewer_than_b_rows_is_partial_as_at_fixed_m(policy: str) -> None:
    examples = _examples(44)  # B = 8: each epoch ends with a group of 4 rows, dropped or updated
    groups = _scheduled_groups(examples, BatchSchedule({0: 8}, axis="samples"))
    expected = _scheduled_reference(examples, groups, skip=(5, 11) if policy == "drop" else ())
    fixed_trainer, fixed, _ = _fit(
        AccumulationStrategy(global_order=True, partial_group=policy), examples, 4, 2, max_epochs=2
    )
    strategy = AccumulationStrategy(token_batches=_tokens(examples, 10), partial_group=policy)
    trainer, model, watch = _fit(strategy, examples, 4, 2, max_epochs=2)
    diffs = [float((params_vector(m) - expected).abs().max()) for m in (model, fixed)]
    print(f"partial_group={policy!r}: |params - float64| tokens, fixed m = {diffs}")
    assert max(diffs) < 1e-12
    ledger, fixed_ledger = trainer.strategy.ledger, fixed_trainer.strategy.ledger  # type: ignore[attr-defined]
    assert (ledger.partial_groups, ledger.dropped_samples, ledger.updates_attempted) == (
        2,
        8 if policy == "drop" else 0,
        10 if policy == "drop" else 12,
    )
    assert (fixed_ledger.samples, fixed_ledger.dropped_samples) == (ledger.samples, ledger.dropped_samples)
    assert sum(len(b) for e in watch.batches for b in e) == 88  # the dropped groups' micro-batches ran


def _validating(**loop: Any) -> Watch:
    examples = _examples(40)
    strategy = AccumulationStrategy(token_batches=_tokens(examples, 8))
    val = DataLoader(ListDataset(examples[:4]), batch_size=4)
    options = {"max_epochs": 3, "val_dataloaders": val, "enable_progress_bar": True, **loop}
    _, _, watch = _fit(strategy, examples, 4, 2, model=EvalLM(lr=LR, seed=59), **options)
    return watch


@pytest.mark.parametrize("interval", [1.0, 0.5, 3])
def test_each_epochs_length_end_validation_points_and_progress_total_follow_its_plan(interval: float) -> None:
    watch = _validating(val_check_interval=interval)
    lengths = [len(epoch) for epoch in watch.batches]
    print(f"val_check_interval={interval}: epochs of {lengths} micro-batches, validation at {watch.validations}")
    assert len(set(lengths)) > 1  # the epochs' lengths differ
    assert watch.counts == watch.totals == lengths  # Lightning's count and the progress bar's total, every epoch
    every = [max(1, int(n * interval)) if isinstance(interval, float) else interval for n in lengths]
    expected = [(e, b) for e, n in enumerate(lengths) for b in range(n) if (b + 1) % every[e] == 0]
    assert watch.validations == expected
    if interval == 1.0:  # the end of every epoch, validated
        assert watch.validations == [(e, n - 1) for e, n in enumerate(lengths)]


@pytest.mark.parametrize(("limit", "steps"), [(5, -1), (0.5, -1), (1.0, 7)])
def test_limit_train_batches_counts_micro_batches_and_max_steps_updates(limit: float, steps: int) -> None:
    full = _validating()
    watch = _validating(limit_train_batches=limit, max_steps=steps)
    lengths = [len(epoch) for epoch in full.batches]
    if steps == -1:
        expected = [min(n, limit) if isinstance(limit, int) else int(n * limit) for n in lengths]
        assert [len(epoch) for epoch in watch.batches] == watch.counts == watch.totals == expected
        assert watch.batches == [epoch[:n] for epoch, n in zip(full.batches, expected, strict=True)]
    else:
        first, second = _epoch_sizes(full, 0), _epoch_sizes(full, 1)  # 5 groups of 8 examples per epoch
        assert [len(epoch) for epoch in watch.batches] == [sum(first), sum(second[:2])]  # 7 updates


def _epoch_sizes(watch: Watch, epoch: int) -> list[int]:
    examples = _examples(40)
    sampler = TokenBatchSampler(examples, _lengths(examples), 8, 8)
    sampler.set_epoch(epoch)
    assert list(sampler) == watch.batches[epoch]
    return sampler.group_sizes()


class _Stepping(TinyLM):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        optimizer = super().configure_optimizers()
        torch.optim.lr_scheduler.OneCycleLR(optimizer, 1.0, total_steps=self.trainer.estimated_stepping_batches)
        return optimizer


def test_estimated_stepping_batches_is_refused_with_the_runs_updates_per_epoch() -> None:
    examples = _examples(44)
    strategy = AccumulationStrategy(token_batches=_tokens(examples, 10))
    match = r"under `token_batches=`: .* An epoch makes 6 \(one per B = m·A·D examples .*`AxisLR`"
    with pytest.raises(RuntimeError, match=match):
        _fit(strategy, examples, 4, 2, model=_Stepping(lr=LR))


class _Stop(Exception):
    pass


class _CheckpointAndStop(CheckpointAt):
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        super().on_train_batch_end(trainer, pl_module, *args)
        if trainer.fit_loop.epoch_loop.batch_idx == self.at:
            raise _Stop


def _loader_state(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=True)["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]


def _plan(examples: list[Any], tokens: TokenBatches, b: int, epoch: int, replicas: int = 1) -> list[int]:
    sampler = TokenBatchSampler(examples, tokens.lengths, tokens.max_tokens, b, num_replicas=replicas)
    sampler.set_epoch(epoch)
    return sampler.group_sizes()


def test_a_resume_inside_a_group_on_one_device_continues_it_exactly(tmp_path: Path) -> None:
    examples, path = _examples(44), tmp_path / "mid.ckpt"
    tokens = _tokens(examples, 8)

    def run(**kwargs: Any) -> tuple[L.LightningModule, Watch]:
        model = TinyLM(lr=LR, seed=59).double()  # float64 throughout: a checkpoint's weights restore unrounded
        _, model, watch = _fit(
            AccumulationStrategy(token_batches=tokens), examples, 4, 2, model, max_epochs=2, **kwargs
        )
        return model, watch

    whole, watch = run()
    at = _plan(examples, tokens, 8, epoch=0)[0] + 1  # the second micro-batch of group 1
    with pytest.raises(_Stop):
        run(callbacks=(_CheckpointAndStop(path, at),))
    state = _loader_state(path)
    assert (state["epoch"], state["position"], state["done"], state["microbatches"]) == (0, 8, 2, at + 1)
    model, resumed = run(ckpt_path=path)
    assert resumed.counts == watch.counts  # the resumed epoch's count is the whole epoch's, as Lightning counts it
    assert resumed.batches == [watch.batches[0][at + 1 :], watch.batches[1]]
    diff = float((params_vector(model) - params_vector(whole)).abs().max())
    print(f"resumed inside group 1 after {state['done']} micro-batches: |params - uninterrupted| = {diff:.1e}")
    assert diff < 1e-12


def test_a_resume_between_groups_of_other_sizes_says_nothing_of_accumulate_grad_batches(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    examples, path = _examples(44), tmp_path / "boundary.ckpt"
    tokens = _tokens(examples, 8)
    sizes = _plan(examples, tokens, 8, epoch=0)
    assert sizes[1] != sizes[2]  # the group closed at the checkpoint and the next hold other micro-batch counts
    with pytest.raises(_Stop):
        stop = _CheckpointAndStop(path, sum(sizes[:2]) - 1)  # at group 1's end
        _fit(AccumulationStrategy(token_batches=tokens), examples, 4, 2, callbacks=(stop,))
    with caplog.at_level("INFO"):
        _fit(AccumulationStrategy(token_batches=tokens), examples, 4, 2, ckpt_path=path)
    # Before: "resumed with accumulate_grad_batches 5 -> 6", the closed group's count against the next one's.
    assert "Restored all states" in caplog.text and "accumulate_grad_batches" not in caplog.text


@pytest.mark.ddp
@pytest.mark.timeout(900)
def test_two_processes_match_the_float64_groups_read_every_position_once_and_resume_from_one(tmp_path: Path) -> None:
    examples = _examples(45)  # on 2 replicas the 45th position of each epoch's order is left out (the tail rule)
    expected = _reference(examples, b=8, replicas=2, epochs=2)
    for max_tokens in (6, 12):  # m = 2, A = 2, D = 2: B = 8
        name, tokens = f"ddp{max_tokens}", _tokens(examples, max_tokens)
        stats = TokenBatchSampler(examples, tokens.lengths, max_tokens, 8, num_replicas=2, seed=0).group_stats()
        assert any(len(set(group["microbatch_samples"])) > 1 for group in stats)  # a replica's micro-batch is short
        ddp = forked_ddp(token_batches=tokens)
        _fit(ddp, examples, 2, 2, devices=2, use_distributed_sampler=True, max_epochs=2, record=(str(tmp_path), name))
        ranks = load_ranks(str(tmp_path), name)
        diffs = [float((rank["params"] - expected).abs().max()) for rank in ranks]
        print(
            f"max_tokens={max_tokens}, D=2: epochs of {ranks[0]['counts']} micro-batches, |params - float64| = {diffs}"
        )
        assert max(diffs) < 1e-12
        _check_epochs(ranks, _lengths(examples), max_tokens)
    # A checkpoint of one device (m = 4, A = 2) at the end of group 2 resumes on two processes (m = 2, A = 2).
    examples, path = examples[:44], tmp_path / "boundary.ckpt"
    tokens = _tokens(examples, 8)
    at = sum(_plan(examples, tokens, 8, epoch=0)[:2]) - 1
    with pytest.raises(_Stop):
        _fit(AccumulationStrategy(token_batches=tokens), examples, 4, 2, callbacks=(_CheckpointAndStop(path, at),))
    assert (_loader_state(path)["position"], _loader_state(path)["done"]) == (16, 0)
    resumed = {"devices": 2, "use_distributed_sampler": True, "max_epochs": 2, "record": (str(tmp_path), "resumed")}
    _fit(forked_ddp(token_batches=tokens), examples, 2, 2, ckpt_path=path, **resumed)
    ranks = load_ranks(str(tmp_path), "resumed")
    order = GlobalOrderSampler(examples, seed=0)
    assert sorted(i for rank in ranks for batch in rank["batches"][0] for i in batch) == sorted(order.order(0)[16:])
    # The same checkpoint resumed on one device: Lightning restores its float64 weights into the float32 module
    # before `precision="64-true"` converts it, so both resumed runs start from the same rounded weights.
    _, one, _ = _fit(AccumulationStrategy(token_batches=tokens), examples, 4, 2, ckpt_path=path, max_epochs=2)
    diffs = [float((rank["params"] - params_vector(one)).abs().max()) for rank in ranks]
    print(f"1 -> 2 processes at a group boundary: |params - 1 -> 1 resume| = {diffs}")
    assert max(diffs) < 1e-12
    assert float((params_vector(one) - _reference(examples, 8, 1, epochs=2)).abs().max()) < 1e-6
    # Inside a group, under another D: refused before training.
    inside = tmp_path / "inside.ckpt"
    with pytest.raises(_Stop):
        _fit(AccumulationStrategy(token_batches=tokens), examples, 4, 2, callbacks=(_CheckpointAndStop(inside, 0),))
    with pytest.raises(Exception, match=r"open after 1 micro-batches per replica on 1 replicas; this sampler deals"):
        _fit(
            forked_ddp(token_batches=tokens), examples, 2, 2, ckpt_path=inside, devices=2, use_distributed_sampler=True
        )


@pytest.mark.ddp
@pytest.mark.timeout(900)
def test_two_processes_follow_the_ramp_with_the_float64_groups_of_the_fixed_m_scheduled_run(tmp_path: Path) -> None:
    examples = _examples(45)  # on 2 replicas the 45th position of each epoch's order is left out (the tail rule)
    for axis in ("samples", "tokens"):
        groups = _scheduled_groups(examples, RAMPS[axis], replicas=2)
        expected = _scheduled_reference(examples, groups)
        for max_tokens in (6, 12):  # m = 2, D = 2
            name = f"{axis}{max_tokens}"
            ddp = forked_ddp(token_batches=_tokens(examples, max_tokens), batch_schedule=RAMPS[axis])
            options = {"devices": 2, "use_distributed_sampler": True, "max_epochs": 2, "record": (str(tmp_path), name)}
            _fit(ddp, examples, 2, 1, **options)
            ranks = load_ranks(str(tmp_path), name)
            diffs = [float((rank["params"] - expected).abs().max()) for rank in ranks]
            print(
                f"{axis} ramp, max_tokens={max_tokens}, D=2: B {[g[2] for g in groups]}, |params - float64| = {diffs}"
            )
            assert max(diffs) < 1e-12
            _check_epochs(ranks, _lengths(examples), max_tokens)
            assert ranks[0]["ledger"]["updates_attempted"] == len(groups)


class _ShardedLM(TinyLM):
    """TinyLM in float64, its two layers sharded by FSDP2 over the data-parallel mesh."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        for module in (self.embed, self.head):
            fully_shard(module.double(), mesh=self.device_mesh["data_parallel"])  # type: ignore[index]


def _fsdp_worker(rank: int, folder: str) -> None:
    examples = _examples(44)
    for max_tokens in (6, 12):
        strategy = ModelParallelAccumulationStrategy(
            tensor_parallel_size=1, token_batches=_tokens(examples, max_tokens)
        )
        options = {"devices": 2, "use_distributed_sampler": True, "max_epochs": 2, "precision": "32-true"}
        _fit(strategy, examples, 2, 2, _ShardedLM(lr=LR, seed=59), record=(folder, f"fsdp{max_tokens}"), **options)


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_fsdp2_on_two_processes_matches_the_float64_groups(tmp_path: Path) -> None:
    run_ddp(_fsdp_worker, str(tmp_path))
    examples = _examples(44)
    expected = _reference(examples, b=8, replicas=2, epochs=2)
    for max_tokens in (6, 12):
        ranks = load_ranks(str(tmp_path), f"fsdp{max_tokens}")
        diffs = [float((rank["params"] - expected).abs().max()) for rank in ranks]
        print(f"FSDP2, max_tokens={max_tokens}, D=2: |params - float64| = {diffs}")
        assert max(diffs) < 1e-12
        _check_epochs(ranks, _lengths(examples), max_tokens)


def _fabric_loop(fabric: L.Fabric, loader: Any, epochs: int = 2) -> tuple[torch.Tensor, list[list[int]]]:
    """A LitGPT-style loop: the groups as the sampler cuts them, one exact update each; the params and the groups."""
    model = TinyLM(seed=59)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
    sampler, groups = loader.batch_sampler, []
    for _ in range(epochs):
        for size, batches in sampler.groups(loader):
            groups.append([])
            for i, batch in enumerate(batches):
                with fabric.no_backward_sync(model, enabled=i < len(batches) - 1):
                    logits, labels = model(batch["input_ids"]), batch["labels"]
                    loss = torch.nn.functional.cross_entropy(
                        logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE
                    )
                    fabric.backward(fabric.strategy.accumulate(loss, num_tokens=(labels != IGNORE).sum()))
                groups[-1] += batch["index"].tolist()
            fabric.strategy.close_group(optimizer, group_size=size)
            optimizer.step()
            optimizer.zero_grad()
    return params_vector(model), groups


def _fabric_worker(rank: int, folder: str) -> None:
    examples = _examples(44)
    strategy = FabricDDPAccumulationStrategy(token_batches=_tokens(examples, 8, samples_per_update=8))
    fabric = L.Fabric(strategy=strategy, devices=2, accelerator="cpu", precision="64-true")
    fabric.launch()  # the processes exist (run_ddp)
    params, groups = _fabric_loop(fabric, fabric.setup_dataloaders(_loader(examples, 2)))
    torch.save({"params": params, "groups": groups}, os.path.join(folder, f"fabric-rank{rank}.pt"))


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_a_fabric_loop_matches_the_float64_groups_on_one_device_and_two_processes(tmp_path: Path) -> None:
    examples = _examples(44)
    tokens = _tokens(examples, 8, samples_per_update=8)
    one = L.Fabric(strategy=FabricAccumulationStrategy(token_batches=tokens), accelerator="cpu", precision="64-true")
    train, evaluation = one.setup_dataloaders(_loader(examples, 4), _loader(examples, 4, shuffle=False))
    assert isinstance(train.batch_sampler, TokenBatchSampler) and isinstance(evaluation.sampler, SequentialSampler)
    params, groups = _fabric_loop(one, train)
    assert float((params - _reference(examples, 8, 1, epochs=2)).abs().max()) < 1e-12
    order = [GlobalOrderSampler(examples, seed=0).order(epoch) for epoch in (0, 1)]
    assert [sorted(g) for g in groups] == [sorted(o[s : s + 8]) for o in order for s in range(0, 44, 8)]
    # The sampler used directly, in a plain loader (no distributed sampler to put in): the same run.
    direct = TokenBatchSampler(examples, tokens.lengths, 8, 8, seed=0)
    plain = L.Fabric(strategy="accum", accelerator="cpu", precision="64-true")
    loader = plain.setup_dataloaders(
        DataLoader(ListDataset(examples), batch_sampler=direct), use_distributed_sampler=False
    )
    assert torch.equal(_fabric_loop(plain, loader)[0], params)
    run_ddp(_fabric_worker, str(tmp_path))
    expected = _reference(examples, 8, 2, epochs=2)
    ranks = [torch.load(tmp_path / f"fabric-rank{r}.pt", weights_only=True) for r in (0, 1)]
    diffs = [float((rank["params"] - expected).abs().max()) for rank in ranks]
    print(f"Fabric: one device |params - float64| = {float((params - _reference(examples, 8, 1, 2)).abs().max()):.1e},"
          f" two processes {diffs}")  # fmt: skip
    assert max(diffs) < 1e-12
    assert [sorted(a + b) for a, b in zip(ranks[0]["groups"], ranks[1]["groups"], strict=True)] == [
        sorted(o[s : s + 8]) for o in order for s in range(0, 44, 8)
    ]


class _Stream(IterableDataset):  # type: ignore[type-arg]
    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(_examples(8))


class _Manual(TinyLM):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


def _trainer_fit(tokens: Any, loader: Any = None, a: int = 2, model: Any = None, **strategy: Any) -> None:
    trainer = make_trainer(strategy=AccumulationStrategy(token_batches=tokens, **strategy), accumulate_grad_batches=a)
    trainer.fit(model or TinyLM(), loader if loader is not None else _loader(_examples(16), 4))


LENGTHS = _lengths(_examples(16))


def _one_on_two() -> DataLoader:
    """One example, dealt to 2 replicas by a distributed sampler: N < D."""
    data = ListDataset(_examples(1))
    return DataLoader(data, batch_size=1, sampler=DistributedSampler(data, num_replicas=2, rank=0))


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        (lambda: _trainer_fit(TokenBatches(3, LENGTHS)), ValueError, r"rows are longer than `max_tokens=3` \(the lon"),
        (lambda: _trainer_fit(TokenBatches(9, LENGTHS[:-1])), ValueError, r"`lengths` has 15 entries but the dataset"),
        (
            lambda: _trainer_fit(TokenBatches(9, LENGTHS), DataLoader(_Stream(), batch_size=2)),
            TypeError,
            r"`dataset` must be map-style .* got _Stream\. .* not a streamed one\), or bucket a stream yourself",
        ),
        (
            lambda: _trainer_fit(TokenBatches(9, LENGTHS, samples_per_update=16)),
            ValueError,
            r"samples_per_update=16\)`: B must be .* batch_size 4 × accumulate_grad_batches 2 × 1 replica\(s\) = 8",
        ),
        (
            lambda: _trainer_fit(TokenBatches(9, LENGTHS, samples_per_update=lambda e, p: 8)),
            ValueError,
            r"samples_per_update=<function.*`: .* \(a function of the position needs accumulate_grad_batches=1\)",
        ),
        (
            lambda: _trainer_fit(TokenBatches(9, LENGTHS), DataLoader(ListDataset(_examples(16)), sampler=[0, 1])),
            ValueError,
            r"reads a training loader in one seeded order: .* got list and BatchSampler on 1 replica\(s\)\. Pass",
        ),
        (
            lambda: _trainer_fit(TokenBatches(9, LENGTHS), a=1, model=_Manual()),
            ValueError,
            r"`automatic_optimization = ",
        ),
        (lambda: TokenBatches(9, LENGTHS, max_samples=0), ValueError, r"`max_samples` must be an int >= 1, got 0"),
        (lambda: TokenBatches(9, LENGTHS, count="x"), ValueError, r"`count` must be one of 'padded', 'sum'; got 'x'"),
        (
            lambda: AccumulationStrategy(
                token_batches=TokenBatches(9, LENGTHS, samples_per_update=8), batch_schedule={0: 8}
            ),
            ValueError,
            r"`TokenBatches\(samples_per_update=8\)` beside `batch_schedule=`: the schedule's stages set each",
        ),
        (lambda: AccumulationStrategy(token_batches={"max_tokens": 9}), TypeError, r"`token_batches` must be a `li"),
        (
            lambda: L.Fabric(
                strategy=FabricAccumulationStrategy(token_batches=TokenBatches(9, LENGTHS))
            ).setup_dataloaders(_loader(_examples(16), 4)),
            ValueError,
            r"`TokenBatches\(samples_per_update=None\)`: .* 4 × the loop.s A × 1 replica\(s\)\. Pass it",
        ),
        (lambda: TokenBatches(9, [3]).loader(_one_on_two(), 2, 0, 0, 1), ValueError, r"`num_replicas=2` exceeds the d"),
    ],
)
def test_bad_input_is_a_clear_error_before_training(bad: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        bad()
