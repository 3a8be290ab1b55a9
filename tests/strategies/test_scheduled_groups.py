"""A batch schedule in a Trainer: the same updates at every split, each the float64 token-weighted gradient of its
group from a hand loop that applies the stages; the errors; the stages reached."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from helpers import (
    ListDataset,
    RankStridedSampler,
    TinyLM,
    fit,
    full_params,
    group_tokens,
    hand_groups,
    hand_trail,
    make_examples,
    make_trainer,
    params_vector,
    random_lengths,
    relative_error,
    run_ddp,
    sgd_reference,
    token_weighted_grad,
)
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_accum import BatchSchedule, DDPAccumulationStrategy, ModelParallelAccumulationStrategy
from lightning_accum.strategies import AccumulationStrategy

EXAMPLES = make_examples(random_lengths(40, seed=59), seed=59)
#: Three stages on the tokens axis: 4, then 8, then 16 samples per update (about 140 tokens per epoch of 40).
STAGES = {0: 4, 30: 8, 120: 16}
EPOCHS = 2
LR = 0.5


class UpdateTrail(L.Callback):
    """The parameters after each update of the fit (after a resume: each update it runs), and each group's size;
    saved with the stages reached and the ledger to `path` at the fit's end when given."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self.params: list[Tensor] = []
        self.sizes: list[int] = []
        self.before = 0  # the updates a resumed checkpoint's ledger counts already

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.before = trainer.strategy.ledger.updates_attempted  # type: ignore[attr-defined]

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.strategy.ledger.updates_attempted - self.before > len(self.params):  # type: ignore[attr-defined]
            self.params.append(full_params(pl_module))  # gathered from FSDP2's shards (a collective) where sharded
            self.sizes.append(int(trainer.accumulate_grad_batches))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.path is not None:
            stages = trainer.strategy.batch_stages  # type: ignore[attr-defined]
            ledger = trainer.strategy.ledger.state_dict()  # type: ignore[attr-defined]
            state = {"params": self.params, "sizes": self.sizes, "stages": stages, "ledger": ledger}
            torch.save(state, f"{self.path}-{trainer.global_rank}.pt")


def test_gradient_accumulation_scheduler_keeps_groups_exact_on_both_sides() -> None:
    # Epoch 0 with A = 2, epoch 1 with A = 3 (Lightning's GradientAccumulationScheduler): 6 micro-batches of 2.
    examples = make_examples(random_lengths(12, seed=30), seed=30)
    model = TinyLM(lr=0.5)
    groups = [examples[0:4], examples[4:8], examples[8:12], examples[0:6], examples[6:12]]
    expected = sgd_reference(model, groups, lr=0.5)
    scheduler = GradientAccumulationScheduler({0: 2, 1: 3})
    trainer = fit(model, examples, batch_size=2, accumulate=1, callbacks=[scheduler], max_epochs=2)
    assert relative_error(params_vector(model), expected) < 1e-5
    ledger = trainer.strategy.ledger
    assert (ledger.updates_applied, ledger.partial_groups, ledger.microbatches) == (5, 0, 12)


class ShardedTinyLM(TinyLM):
    """TinyLM whose `configure_model` shards both its layers with FSDP2 (`fully_shard`) over the data-parallel mesh."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        for module in (self.embed, self.head):
            fully_shard(module, mesh=self.device_mesh["data_parallel"])


def _fit(
    strategy: Any,
    batch_size: int,
    devices: int = 1,
    trail: UpdateTrail | None = None,
    model: TinyLM | None = None,
    **kw: Any,
) -> Any:
    model = model or TinyLM(lr=LR, seed=59)
    trail = trail or UpdateTrail()
    trainer = make_trainer(
        strategy=strategy, devices=devices, max_epochs=EPOCHS, callbacks=[trail, *kw.pop("callbacks", [])], **kw
    )
    sampler = RankStridedSampler(len(EXAMPLES)) if devices > 1 else None
    trainer.fit(model, DataLoader(ListDataset(EXAMPLES), batch_size=batch_size, sampler=sampler))
    return trainer, trail


def _ddp_run(rank: int, folder: str) -> None:
    strategy = DDPAccumulationStrategy(batch_schedule=BatchSchedule(STAGES, axis="tokens"))
    _fit(strategy, batch_size=1, devices=2, trail=UpdateTrail(f"{folder}/d2"))


def _targets(schedule: BatchSchedule, groups: list[list[Any]]) -> list[int]:
    """Each hand group's target batch B: its stage's, at the tokens of the groups before it (the partial one too)."""
    return [schedule.stage_at(sum(group_tokens(g) for g in groups[:i])).samples for i in range(len(groups))]


def _stages_reached(schedule: BatchSchedule, groups: list[list[Any]]) -> list[tuple[int, int, int]]:
    """(stage, tokens, updates) per stage the hand groups reach: what `batch_stages` should record."""
    by_stage: dict[int, list[int]] = {}
    for i, group in enumerate(groups):
        index = schedule.stage_at(sum(group_tokens(g) for g in groups[:i])).index
        by_stage.setdefault(index, [0, 0])
        by_stage[index][0] += group_tokens(group)
        by_stage[index][1] += 1
    return [(k, *v) for k, v in by_stage.items()]


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_three_stages_give_the_same_updates_at_every_split_and_each_is_the_float64_group_gradient(
    tmp_path: Path,
) -> None:
    schedule = BatchSchedule(STAGES, axis="tokens")
    expected = hand_trail(TinyLM(lr=LR, seed=59), EXAMPLES, schedule, EPOCHS, LR)
    groups = hand_groups(EXAMPLES, schedule, EPOCHS)
    assert {len(g) for g in groups} == {4, 8, 16} and len(groups[-1]) < 16  # every stage, and a partial last group
    runs = {}
    for m in (4, 2):
        trainer, trail = _fit(AccumulationStrategy(batch_schedule=schedule), batch_size=m)
        runs[(m, 1)] = trail.params, trail.sizes, trainer.strategy.batch_stages
        assert trainer.accumulate_grad_batches == 1 and type(trainer.accumulate_grad_batches) is int  # given back
    run_ddp(_ddp_run, str(tmp_path))
    ranks = [torch.load(tmp_path / f"d2-{r}.pt", weights_only=True) for r in (0, 1)]
    runs[(1, 2)] = ranks[0]["params"], ranks[0]["sizes"], ranks[0]["stages"]
    assert torch.equal(torch.stack(ranks[0]["params"]), torch.stack(ranks[1]["params"]))
    worst = {}
    for (m, d), (params, sizes, stages) in runs.items():
        assert len(params) == len(expected), (m, d)
        # Each group's size in micro-batches per replica is its target B / (m · D) (the partial one keeps its target).
        assert sizes == [b // (m * d) for b in _targets(schedule, groups)], (m, d)
        worst[(m, d)] = max(relative_error(p, e) for p, e in zip(params, expected, strict=True))
        assert worst[(m, d)] < 1e-5, (m, d, worst)
        # The stages reached, with the tokens and updates each one's groups consumed (the hand loop's).
        assert [(s["stage"], s["tokens"], s["updates"]) for s in stages] == _stages_reached(schedule, groups)
    print("max relative error per (m, D) against the float64 hand loop:", worst)


def _fsdp_runs(rank: int, folder: str) -> None:
    # `tensor_parallel_size=1`: what `strategy="accum_fsdp"` selects (FSDP2 over every device), with the schedule.
    for mode in ("every_microbatch", "last_microbatch"):
        strategy = ModelParallelAccumulationStrategy(
            tensor_parallel_size=1, gradient_sync=mode, batch_schedule=BatchSchedule(STAGES, axis="tokens")
        )
        model = ShardedTinyLM(lr=LR, seed=59)
        _fit(strategy, batch_size=1, devices=2, trail=UpdateTrail(f"{folder}/{mode}"), model=model)


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_fsdp2_under_three_stages_gives_each_update_the_float64_group_gradient_in_both_sync_modes(
    tmp_path: Path,
) -> None:
    # (m, D) = (1, 2), each rank reading every second example in order; both layers sharded by `fully_shard`, so
    # each update's gradient is reduce-scattered (every micro-batch, or the group's last one only) before the close.
    schedule = BatchSchedule(STAGES, axis="tokens")
    expected = hand_trail(TinyLM(lr=LR, seed=59), EXAMPLES, schedule, EPOCHS, LR)
    groups = hand_groups(EXAMPLES, schedule, EPOCHS)
    run_ddp(_fsdp_runs, str(tmp_path))
    for mode in ("every_microbatch", "last_microbatch"):
        for rank in (0, 1):
            run = torch.load(tmp_path / f"{mode}-{rank}.pt", weights_only=True)
            assert run["sizes"] == [b // 2 for b in _targets(schedule, groups)], (mode, rank)  # A = B / (1 · 2)
            worst = max(relative_error(p, e) for p, e in zip(run["params"], expected, strict=True))
            print(f"FSDP2 ({mode}), rank {rank}: max relative error per update against the float64 loop = {worst:.1e}")
            assert len(run["params"]) == len(expected) and worst < 1e-5, (mode, rank, worst)
            assert [(s["stage"], s["tokens"], s["updates"]) for s in run["stages"]] == _stages_reached(schedule, groups)


def test_the_stage_learning_rate_factor_applies_to_its_updates_only() -> None:
    schedule = BatchSchedule(STAGES, axis="tokens", lr_scaling="sqrt")
    expected = hand_trail(TinyLM(lr=LR, seed=59), EXAMPLES, schedule, EPOCHS, LR)
    trainer, trail = _fit(AccumulationStrategy(batch_schedule=schedule), batch_size=2)
    assert max(relative_error(p, e) for p, e in zip(trail.params, expected, strict=True)) < 1e-5
    assert trainer.optimizers[0].param_groups[0]["lr"] == LR  # the factor never stays in the optimizer


def test_a_schedule_on_samples_from_a_string_in_the_strategy() -> None:
    schedule = BatchSchedule("0:4 16:8 48:16", axis="samples")
    trainer, trail = _fit(AccumulationStrategy(batch_schedule=schedule), batch_size=2)
    ledger = trainer.strategy.ledger
    assert ledger.samples == EPOCHS * len(EXAMPLES)
    # Samples 0-15: 4 groups of 4; 16-47: groups of 8 (three in epoch 1, one in epoch 2); from 48 on, groups of 16.
    assert trail.sizes == [2, 2, 2, 2, 4, 4, 4, 4, 8, 8]


def test_errors_before_and_at_the_first_batch() -> None:
    schedule = BatchSchedule({0: 4, 30: 6, 120: 16}, axis="tokens")
    with pytest.raises(
        ValueError, match=r"stage 1 \(from 30 tokens\) holds 6 samples .* m × D = 4 × 1 = 4 .* Use 4 or 8"
    ):
        _fit(AccumulationStrategy(batch_schedule=schedule), batch_size=4)
    with pytest.raises(ValueError, match=r"but the Trainer has `accumulate_grad_batches=2`\. Remove"):
        _fit(AccumulationStrategy(batch_schedule=STAGES), batch_size=2, accumulate_grad_batches=2)
    with pytest.raises(ValueError, match=r"`GradientAccumulationScheduler` .* would both set"):
        _fit(
            AccumulationStrategy(batch_schedule=STAGES), batch_size=2, callbacks=[GradientAccumulationScheduler({0: 1})]
        )
    model = TinyLM(lr=LR, seed=59, report="samples")
    trainer = make_trainer(strategy=AccumulationStrategy(batch_schedule=STAGES), max_epochs=1)
    with pytest.raises(RuntimeError, match=r"BatchSchedule\(axis='tokens'\) needs token counts"):
        trainer.fit(model, DataLoader(ListDataset(EXAMPLES), batch_size=2))


def test_the_ramp_is_on_tensorboards_tokens_axis_and_in_the_report(tmp_path: Path) -> None:
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lightning_accum import AccumulationReport, AxisLogger
    from lightning_accum.callbacks.report import format_report

    schedule = BatchSchedule(STAGES, axis="tokens")
    report = AccumulationReport(path=str(tmp_path / "report.json"))
    logger = TensorBoardLogger(str(tmp_path), name="tb", version=0)
    callbacks = [AxisLogger(axis="tokens"), report]
    trainer, _trail = _fit(
        AccumulationStrategy(batch_schedule=schedule),
        batch_size=2,
        logger=logger,
        log_every_n_steps=1,
        callbacks=callbacks,
    )
    events = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"scalars": 0})
    events.Reload()
    batch = [(e.step, e.value) for e in events.Scalars("accum/global_batch")]
    stage = [int(e.value) for e in events.Scalars("accum/batch_stage")]
    # One point per update at the tokens seen after it, holding that update's stage batch.
    groups = hand_groups(EXAMPLES, schedule, EPOCHS)
    seen = [sum(group_tokens(g) for g in groups[: i + 1]) for i in range(len(groups))]
    targets = [schedule.stage_at(x - group_tokens(g)).samples for x, g in zip(seen, groups, strict=True)]
    assert batch == [(x, float(b)) for x, b in zip(seen, targets, strict=True)]
    assert stage == [schedule.stage_at(x - group_tokens(g)).index for x, g in zip(seen, groups, strict=True)]
    record = trainer.strategy.batch_stages
    assert [s["stage"] for s in record] == [0, 1, 2] and sum(
        s["tokens"] for s in record
    ) == trainer.strategy.ledger.tokens
    text = format_report(report.build(trainer, "completed", None, gather=False))
    assert re.search(r"batch_schedule\.stages\[2\] +from 120 tokens: 16 samples/update, \d+ updates", text)


def test_a_schedule_costs_no_host_read_per_micro_batch_and_one_per_update() -> None:
    # The stage is read from the ledger's host counters at a group's first batch: no device read is added. The
    # counter classifies micro-batches by `trainer.accumulate_grad_batches`, the scheduled group's size.
    from host_reads import MicroBatchSyncCounter

    counter = MicroBatchSyncCounter()
    trainer, _ = _fit(AccumulationStrategy(batch_schedule=BatchSchedule(STAGES, axis="tokens")), 2, callbacks=[counter])
    ledger = trainer.strategy.ledger
    assert len(trainer.strategy.batch_stages) == 3  # every stage reached
    assert counter.non_final_batches > 0 and counter.non_final.package_ops > 0
    assert counter.non_final.hits == []
    assert len(counter.final.hits) == ledger.updates_attempted and all("tolist" in h for h in counter.final.hits)


class _SavesAt(L.Callback):
    """Writes a checkpoint from `on_train_batch_end` of one batch (epoch, index): between micro-batches."""

    def __init__(self, path: str, epoch: int, batch_idx: int) -> None:
        self.path, self.at = path, (epoch, batch_idx)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        if (trainer.current_epoch, i) == self.at:
            trainer.save_checkpoint(self.path)


@pytest.mark.parametrize(("epoch", "batch_idx"), [(0, 11), (1, 12)], ids=["stage-2-mid-group", "stage-3-mid-group"])
def test_a_resume_inside_a_stage_and_a_group_continues_the_same_schedule(
    tmp_path: Path, epoch: int, batch_idx: int
) -> None:
    # The stage is a function of the ledger's position, which the checkpoint carries, and a group open at the
    # checkpoint keeps its size: the resumed run forms the same groups and ends on the uninterrupted run's parameters.
    from helpers import ResumableLoader

    def run(path: str | None = None, save: L.Callback | None = None) -> tuple[Any, TinyLM, UpdateTrail]:
        model = TinyLM(lr=LR, seed=59)
        trail = UpdateTrail()
        trainer = make_trainer(
            strategy=AccumulationStrategy(batch_schedule=BatchSchedule(STAGES, axis="tokens")),
            max_epochs=EPOCHS,
            callbacks=[trail, *([save] if save else [])],
        )
        trainer.fit(model, ResumableLoader(ListDataset(EXAMPLES), batch_size=2), ckpt_path=path)
        return trainer, model, trail

    whole, whole_model, _ = run()
    path = str(tmp_path / "mid.ckpt")
    run(save=_SavesAt(path, epoch, batch_idx))
    entry = torch.load(path, weights_only=True)["lightning_accum"]
    assert entry["open_group_microbatches"] > 0  # written inside a group
    resumed, model, _ = run(path)
    assert relative_error(params_vector(model), params_vector(whole_model)) < 1e-6
    assert resumed.strategy.ledger == whole.strategy.ledger  # type: ignore[attr-defined]
    assert resumed.strategy.batch_stages == whole.strategy.batch_stages  # the checkpoint's record, continued


def test_the_checkpoints_record_of_the_stages_continues_under_any_schedule_and_is_checked(tmp_path: Path) -> None:
    # The record of the stages (what each one's groups consumed) is history the ledger does not hold: the entry
    # carries it. Written after epoch 0 (stages 0, 1 and 2 reached); resumed for epoch 1.
    path = tmp_path / "epoch.ckpt"

    def fit(stages: dict[int, int], epochs: int, ckpt_path: Path | None = None) -> Any:
        trainer = make_trainer(strategy=AccumulationStrategy(batch_schedule=stages), max_epochs=epochs)
        trainer.fit(TinyLM(lr=LR, seed=59), DataLoader(ListDataset(EXAMPLES), batch_size=4), ckpt_path=ckpt_path)
        return trainer

    first = fit(STAGES, epochs=1)
    first.save_checkpoint(path)
    written = first.strategy.batch_stages
    assert torch.load(path, weights_only=True)["lightning_accum"]["batch_stages"] == written
    assert [s["stage"] for s in written] == [0, 1, 2]

    def resume(stages: dict[int, int]) -> Any:
        return fit(stages, epochs=2, ckpt_path=path).strategy

    same = resume(STAGES)
    assert same.batch_stages[:2] == written[:2] and same.batch_stages[2]["updates"] > written[2]["updates"]
    assert sum(s["tokens"] for s in same.batch_stages) == same.ledger.tokens
    # Another schedule (stage 1 holds 16 samples from 30 tokens): the record keeps the stages the run reached and adds
    # the new schedule's stage, whose groups hold what came after the resume.
    other = resume({0: 4, 30: 16})
    assert [s["stage"] for s in other.batch_stages] == [0, 1, 2, 1] and other.batch_stages[:3] == written
    assert other.batch_stages[-1]["samples_per_update"] == 16
    assert other.batch_stages[-1]["tokens"] == other.ledger.tokens - sum(s["tokens"] for s in written)
    # A damaged record is the entry's error, naming the key.
    state = torch.load(path, weights_only=True)
    state["lightning_accum"]["batch_stages"][1]["tokens"] = -1
    torch.save(state, path)
    with pytest.raises(
        ValueError, match=r"`batch_stages\[1\]` should be a dict of ints >= 0 with the keys \['accumulate_grad_batches'"
    ):
        resume(STAGES)


def _resume_on_two_processes(rank: int, folder: str, names: list[str]) -> None:
    # m = 2 on D = 2 (m × D = 4, as the run that wrote the checkpoints), Lightning's distributed sampler replaced by
    # the global order; each checkpoint resumed by its own fit in these two processes.
    for name in names:
        strategy = DDPAccumulationStrategy(batch_schedule=BatchSchedule(STAGES, axis="tokens"), global_order=True)
        trainer = make_trainer(
            strategy=strategy,
            devices=2,
            use_distributed_sampler=True,
            precision="64-true",
            max_epochs=EPOCHS,
            callbacks=[UpdateTrail(f"{folder}/{name}")],
        )
        loader = DataLoader(ListDataset(EXAMPLES), batch_size=2, shuffle=True)
        trainer.fit(TinyLM(lr=LR, seed=59).double(), loader, ckpt_path=f"{folder}/{name}.ckpt")


#: Where the one-device run (m = 4) writes its checkpoints, (epoch, micro-batch): after the group of micro-batches 3-4
#: of epoch 0 (stage 1 goes on after it), and after micro-batch 5 of epoch 1, the second of the group 4-7 (stage 2).
_CHECKPOINTS = {"between-groups": (0, 4), "mid-group": (1, 5)}


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_a_checkpoint_of_one_process_inside_a_stage_and_inside_a_group_resumes_on_two_in_the_same_updates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Shuffled, `global_order=True`: both runs read one seeded order (`PL_GLOBAL_SEED`, 0 when unset, as in the forked
    # workers), the one-device run 4 examples per micro-batch, each of the two processes 2, so a group of A
    # micro-batches holds the same 4·A positions of the order on both. The model is float64 from the start, so the
    # checkpoint's weights are restored without rounding and the runs agree to float64 rounding.
    from lightning_accum import GlobalOrderSampler

    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    schedule = BatchSchedule(STAGES, axis="tokens")
    orders = [GlobalOrderSampler(EXAMPLES, seed=0).order(epoch) for epoch in range(EPOCHS)]
    expected = hand_trail(TinyLM(lr=LR, seed=59), EXAMPLES, schedule, EPOCHS, LR, orders)
    saves = [_SavesAt(str(tmp_path / f"{name}.ckpt"), *at) for name, at in _CHECKPOINTS.items()]
    model = TinyLM(lr=LR, seed=59).double()
    whole = make_trainer(
        strategy=AccumulationStrategy(batch_schedule=schedule, global_order=True),
        precision="64-true",
        max_epochs=EPOCHS,
        callbacks=[trail := UpdateTrail(), *saves],
    )
    whole.fit(model, DataLoader(ListDataset(EXAMPLES), batch_size=4, shuffle=True))
    assert len(trail.params) == len(expected) == 10
    assert max(relative_error(p, e) for p, e in zip(trail.params, expected, strict=True)) < 1e-12
    assert [s["stage"] for s in whole.strategy.batch_stages] == [0, 1, 2]
    entries = {name: torch.load(tmp_path / f"{name}.ckpt", weights_only=True) for name in _CHECKPOINTS}
    # (a) between groups: nothing open; 4 updates done (3 of stage 0, 1 of stage 1). (b) 2 of the 4 micro-batches of
    # update 9 (stage 2) done, their gradient carried; epoch 1 at position 6 · 4 = 24 of the order.
    assert entries["between-groups"]["lightning_accum"]["open_group_microbatches"] == 0
    assert entries["between-groups"]["lightning_accum"]["ledger"]["updates_applied"] == 4
    assert entries["mid-group"]["lightning_accum"]["open_group_microbatches"] == 2
    assert entries["mid-group"]["lightning_accum"]["ledger"]["updates_applied"] == 8
    loader_state = entries["mid-group"]["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert loader_state == [{"epoch": 1, "position": 24, "seed": 0, "shuffle": True, "length": 40}]
    run_ddp(_resume_on_two_processes, str(tmp_path), list(_CHECKPOINTS))
    for name in _CHECKPOINTS:
        ranks = [torch.load(tmp_path / f"{name}-{r}.pt", weights_only=True) for r in (0, 1)]
        done = entries[name]["lightning_accum"]["ledger"]["updates_attempted"]
        for rank in ranks:
            # Every update after the resume is the uninterrupted run's update, and of the same group size.
            assert len(rank["params"]) == len(trail.params) - done, name
            worst = max(relative_error(p, e) for p, e in zip(rank["params"], trail.params[done:], strict=True))
            print(f"1 -> 2 processes from the {name} checkpoint: max relative error per update = {worst:.1e}")
            assert worst < 1e-12, name
            assert rank["sizes"] == trail.sizes[done:], name
            ledger = whole.strategy.ledger
            assert (rank["ledger"]["updates_applied"], rank["ledger"]["tokens"], rank["ledger"]["samples"]) == (
                ledger.updates_applied,
                ledger.tokens,
                ledger.samples,
            ), name
            assert rank["stages"] == whole.strategy.batch_stages, name


def test_a_token_budget_its_cadences_and_a_rate_on_tokens_keep_their_meaning_under_a_schedule(tmp_path: Path) -> None:
    # A Horizon (stop, validate and checkpoint on tokens) and an AxisLR (the rate a function of tokens) beside a
    # three-stage schedule with the square-root factor: the points are the first updates reaching each multiple, as
    # without a schedule, and every update is the float64 hand loop's at rate LR · rule(tokens before) · factor(stage).
    from horizon_helpers import HorizonLM, Trace, loaders, trainer_for
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_accum import Horizon

    stop, every_val, every_ckpt = 300, 70, 100

    def rule(tokens: int) -> float:
        return 1.0 / (1.0 + tokens / 150)

    schedule = BatchSchedule(STAGES, axis="tokens", lr_scaling="sqrt")
    groups = hand_groups(EXAMPLES, schedule, epochs=4)
    counts = [sum(group_tokens(g) for g in groups[: i + 1]) for i in range(len(groups))]
    done = next(i for i, c in enumerate(counts) if c >= stop) + 1
    groups, counts = groups[:done], counts[:done]

    def firsts(every: int) -> list[int]:
        return sorted({next(c for c in counts if c >= k * every) for k in range(1, counts[-1] // every + 1)})

    assert len({schedule.stage_at(c - group_tokens(g)).index for c, g in zip(counts, groups, strict=True)}) == 3
    reference = TinyLM(lr=LR, seed=3).double()
    for count, group in zip(counts, groups, strict=True):
        before = count - group_tokens(group)
        rate = LR * rule(before) * schedule.lr_factor(schedule.stage_at(before))
        grad = token_weighted_grad(reference, group)
        with torch.no_grad():
            offset = 0
            for p in reference.parameters():
                p -= rate * grad[offset : offset + p.numel()].view_as(p)
                offset += p.numel()

    trace = Trace()
    budget = Horizon(axis="tokens", stop_at=stop, validate_every=every_val, checkpoint_every=every_ckpt)
    callbacks = [trace, budget, ModelCheckpoint(dirpath=tmp_path, save_top_k=0)]
    trainer = trainer_for(
        1, callbacks, strategy=AccumulationStrategy(batch_schedule=schedule), enable_checkpointing=True
    )
    model = HorizonLM(lr_lambda=rule, lr=LR, seed=3)
    trainer.fit(model, *loaders(EXAMPLES, 2))

    assert trainer.strategy.ledger.tokens == counts[-1] and len(trace.updates) == len(groups)
    before = [c - group_tokens(g) for c, g in zip(counts, groups, strict=True)]
    assert [u["tokens_before"] for u in trace.updates] == before
    # Lightning also validates when training is asked to stop: one run at the budget.
    assert trace.validations == sorted({*firsts(every_val), counts[-1]})
    assert sorted(int(p.stem.split("=")[1]) for p in tmp_path.glob("tokens=*.ckpt")) == firsts(every_ckpt)
    assert relative_error(params_vector(model), params_vector(reference)) < 1e-5


def test_the_partial_group_policy_compares_an_epochs_last_group_with_its_own_stages_size() -> None:
    # 38 examples, micro-batches of 2, batches of 4 samples until 30 samples are seen, then 8. The group starting at
    # sample 32 is in the second stage: it holds 6 of its 8 samples (3 micro-batches of 4), a partial group of its own
    # size (not 3 micro-batches where the first stage's groups hold 2), and `partial_group="drop"` drops it.
    examples = make_examples(random_lengths(38, seed=7), seed=7)
    schedule = BatchSchedule("0:4 30:8", axis="samples")
    model = TinyLM(lr=LR, seed=59)
    groups = [examples[i : i + 4] for i in range(0, 32, 4)] + [examples[i : i + 8] for i in range(0, 32, 8)]
    expected = sgd_reference(model, groups, lr=LR)
    strategy = AccumulationStrategy(batch_schedule=schedule, partial_group="drop")
    trail = UpdateTrail()
    trainer = make_trainer(strategy=strategy, max_epochs=2, callbacks=[trail])
    trainer.fit(model, DataLoader(ListDataset(examples), batch_size=2))
    ledger = strategy.ledger
    assert (ledger.updates_applied, ledger.partial_groups, ledger.dropped_samples) == (12, 2, 12)
    assert (ledger.dropped_microbatches, ledger.samples) == (6, 64)
    assert trail.sizes == [2] * 8 + [4] * 4
    assert relative_error(params_vector(model), expected) < 1e-5


class _CountsSteps(TinyLM):
    """Counts the training batches Lightning started and the `training_step` calls (the check's included)."""

    def __init__(self) -> None:
        super().__init__(lr=LR, seed=59)
        self.started, self.steps = 0, 0

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.started += 1

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Any:
        self.steps += 1
        return super().training_step(batch, batch_idx)


def test_a_stage_batch_not_divisible_by_m_d_is_an_error_at_set_up_before_any_training_step() -> None:
    # m = 4 from the loader's batch_size: stage 1's 6 samples are no multiple of m × D = 4. The error comes at the
    # strategy's on_train_start, before Lightning starts a batch, and before AccumulationCheck's one-batch comparison
    # (a callback's on_train_start, which runs training_step, and runs before the strategy's).
    from lightning_accum import AccumulationCheck

    schedule = BatchSchedule({0: 4, 30: 6, 120: 16}, axis="tokens")
    message = (
        r"stage 1 \(from 30 tokens\) holds 6 samples per update, not a multiple of m × D = 4 × 1 = 4 .* Use 4 or 8"
    )
    for callbacks in ([], [AccumulationCheck()]):
        model = _CountsSteps()
        trainer = make_trainer(strategy=AccumulationStrategy(batch_schedule=schedule), callbacks=callbacks)
        with pytest.raises(ValueError, match=message):
            trainer.fit(model, DataLoader(ListDataset(EXAMPLES), batch_size=4))
        assert (model.started, model.steps) == (0, 0), callbacks
    # A loader without `batch_size` (a batch sampler) tells m with its first batch: checked there, as before.
    from torch.utils.data import BatchSampler, SequentialSampler

    model = _CountsSteps()
    trainer = make_trainer(strategy=AccumulationStrategy(batch_schedule=schedule))
    sampler = BatchSampler(SequentialSampler(range(len(EXAMPLES))), batch_size=4, drop_last=False)
    with pytest.raises(ValueError, match=message):
        trainer.fit(model, DataLoader(ListDataset(EXAMPLES), batch_sampler=sampler))
    assert (model.started, model.steps) == (1, 0)


def _resumable_run(
    schedule: BatchSchedule | None, path: str | None = None, save: L.Callback | None = None, **trainer_kw: Any
) -> tuple[Any, TinyLM, UpdateTrail]:
    from helpers import ResumableLoader

    model = TinyLM(lr=LR, seed=59)
    trail = UpdateTrail()
    trainer = make_trainer(
        strategy=AccumulationStrategy(batch_schedule=schedule),
        max_epochs=EPOCHS,
        callbacks=[trail, *([save] if save else [])],
        **trainer_kw,
    )
    trainer.fit(model, ResumableLoader(ListDataset(EXAMPLES), batch_size=2), ckpt_path=path)
    return trainer, model, trail


def test_batch_stages_survive_a_resume_inside_a_stage_and_stay_with_the_fit_that_resumes(tmp_path: Path) -> None:
    # The checkpoint's entry carries the per-stage record: a run resumed inside stage 1 (and inside a group) reports
    # the uninterrupted run's stages, attempts, updates, samples and tokens, not only what came after the resume.
    schedule = BatchSchedule(STAGES, axis="tokens")
    whole, _, _ = _resumable_run(schedule)
    expected = whole.strategy.batch_stages
    assert [s["stage"] for s in expected] == [0, 1, 2]
    assert [s["accumulate_grad_batches"] for s in expected] == [2, 4, 8]  # m = 2: A = B / 2
    path = str(tmp_path / "mid.ckpt")
    _resumable_run(schedule, save=_SavesAt(path, 0, 11))
    entry = torch.load(path, weights_only=True)["lightning_accum"]
    assert entry["open_group_microbatches"] > 0 and [s["stage"] for s in entry["batch_stages"]] == [0, 1]
    resumed, _, _ = _resumable_run(schedule, path)
    assert resumed.strategy.batch_stages == expected
    # A checkpoint's record reaches only the fit that resumes from it: `validate(ckpt_path=...)` restores weights only,
    # and a later fit without `ckpt_path` starts its record from nothing.
    trainer = make_trainer(strategy=AccumulationStrategy(batch_schedule=schedule), max_epochs=EPOCHS)
    from helpers import EvalLM

    model = EvalLM(lr=LR, seed=59)
    trainer.validate(model, DataLoader(ListDataset(EXAMPLES[:4]), batch_size=2), ckpt_path=path, verbose=False)
    assert trainer.strategy.batch_stages == []
    trainer.fit(TinyLM(lr=LR, seed=59), DataLoader(ListDataset(EXAMPLES), batch_size=2))
    assert trainer.strategy.batch_stages == expected
    # A damaged record is an error naming it, before anything trains.
    damaged = torch.load(path, weights_only=True)
    damaged["lightning_accum"]["batch_stages"][1]["updates"] = -1
    torch.save(damaged, tmp_path / "damaged.ckpt")
    with pytest.raises(ValueError, match=r"damaged: `batch_stages\[1\]` should be a dict of ints >= 0 with the keys"):
        _resumable_run(schedule, str(tmp_path / "damaged.ckpt"))
    # An entry written before the record was saved (no `batch_stages`) still loads: the record starts empty there.
    del entry["batch_stages"]
    old = torch.load(path, weights_only=True)
    old["lightning_accum"] = entry
    torch.save(old, tmp_path / "old.ckpt")
    resumed_old, _, _ = _resumable_run(schedule, str(tmp_path / "old.ckpt"))
    assert resumed_old.strategy.ledger == whole.strategy.ledger  # type: ignore[attr-defined]
    after = resumed_old.strategy.batch_stages
    assert [s["stage"] for s in after] == [1, 2] and after[1] == expected[2]  # stage 1's record: after the resume


def test_a_checkpoint_of_a_run_without_a_schedule_resumes_into_the_stage_its_position_falls_in(tmp_path: Path) -> None:
    # Written at an update boundary by a run of fixed A = 2 (4 samples per update) after 20 examples; resumed under a
    # schedule, the first group has the size of the stage at the checkpoint's tokens, and the record starts there.
    schedule = BatchSchedule(STAGES, axis="tokens")
    path = str(tmp_path / "plain.ckpt")
    _resumable_run(None, save=_SavesAt(path, 0, 9), accumulate_grad_batches=2)
    position = torch.load(path, weights_only=True)["lightning_accum"]["ledger"]["tokens"]
    stage = schedule.stage_at(position)
    assert stage.index == 1  # the test's premise: the position lies inside stage 1
    resumed, _, trail = _resumable_run(schedule, path)
    assert trail.sizes[0] == stage.samples // 2  # A = 8 / 2
    record = resumed.strategy.batch_stages
    assert [s["stage"] for s in record] == [1, 2]
    assert sum(s["tokens"] for s in record) == resumed.strategy.ledger.tokens - position
    assert resumed.strategy.ledger.samples == EPOCHS * len(EXAMPLES)
