"""Documents inside packed rows: `document_mean_loss` against a float64 reference computed document by document, and
real `Trainer.fit` / Fabric runs whose every update is the mean over the group's documents of each one's mean token
loss, on one process and two."""

from __future__ import annotations

import copy
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import (
    IGNORE,
    VOCAB,
    CheckpointAt,
    ListDataset,
    ResumableLoader,
    TinyLM,
    fit,
    forked_ddp,
    make_examples,
    make_trainer,
    params_vector,
    random_lengths,
    relative_error,
)
from host_reads import MicroBatchSyncCounter
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import Tensor
from torch.utils.data import DataLoader

import lightning_accum
from lightning_accum import (
    AccumulationCheck,
    AccumulationCheckError,
    AccumulationReport,
    AccumulationStrategy,
    AxisLogger,
    AxisLR,
    AxisProgressBar,
    Horizon,
    document_mean_loss,
    log_on_axis,
    supervised_tokens,
)

T = 12  # positions per packed row
KEYS = ("input_ids", "labels", "position_ids")


# ---------------------------------------------------------------------------- data and the reference


def pack(rows: list[list[int]], seed: int) -> list[dict[str, Tensor]]:
    """Rows of documents of the given lengths in Hugging Face's `DataCollatorWithFlattening` layout (labels: -100 at
    each document's first token, then its tokens; `position_ids` restarting at 0 for each document), each padded to T
    (label -100, positions from 0: a document without a supervised token)."""
    gen = torch.Generator().manual_seed(seed)
    packed = []
    for lengths in rows:
        ids: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        for length in lengths:
            document = torch.randint(0, VOCAB, (length,), generator=gen).tolist()
            ids, labels, positions = ids + document, [*labels, IGNORE, *document[1:]], positions + list(range(length))
        pad = T - len(ids)
        ids, labels, positions = ids + [0] * pad, labels + [IGNORE] * pad, positions + list(range(pad))
        packed.append({key: torch.tensor(value) for key, value in zip(KEYS, (ids, labels, positions), strict=True)})
    return packed


def spans(starts: list[bool]) -> list[range]:
    """The positions of each document of one row, from where documents start."""
    begins = [t for t, start in enumerate(starts) if start or t == 0]
    return [range(a, b) for a, b in zip(begins, [*begins[1:], len(starts)], strict=True)]


def document_means(
    logits: Tensor, labels: Tensor, starts: Tensor, shift: bool = True, ignore: int = IGNORE
) -> list[Tensor]:
    """Each document's mean token loss, document by document (rows of `logits` (R, T, V), `labels` and `starts` (R,
    T)); documents without a supervised token are left out. With `shift` the label at t is predicted at t - 1."""
    means = []
    for row_logits, row_labels, row_starts in zip(logits, labels, starts, strict=True):
        for document in spans(row_starts.tolist()):
            losses = [
                F.cross_entropy(row_logits[t - 1 if shift else t], row_labels[t])
                for t in document
                if (t >= 1 or not shift) and int(row_labels[t]) != ignore
            ]
            if losses:
                means.append(torch.stack(losses).mean())
    return means


def reference_loss(model: torch.nn.Module, rows: list[dict[str, Tensor]]) -> Tensor:
    """The mean over the documents of `rows` of each document's mean token loss, in the model's dtype."""
    ids = torch.stack([row["input_ids"] for row in rows])
    labels = torch.stack([row["labels"] for row in rows])
    starts = torch.stack([row["position_ids"] for row in rows]) == 0
    return torch.stack(document_means(model(ids), labels, starts)).mean()


def reference_updates(model: torch.nn.Module, groups: list[list[dict[str, Tensor]]], lr: float) -> list[Tensor]:
    """float64 SGD, one update per group of rows on the groups' document means: the parameters after each update."""
    ref = copy.deepcopy(model).double()
    after = []
    for group in groups:
        ref.zero_grad()
        reference_loss(ref, group).backward()
        with torch.no_grad():
            for p in ref.parameters():
                p -= lr * p.grad
        after.append(params_vector(ref))
    return after


def error(actual: Tensor, expected: Tensor) -> float:
    """The relative error, of values that may carry a graph."""
    return relative_error(actual.detach(), expected.detach())


def update_errors(start: Tensor, after: list[Tensor] | Tensor, expected: list[Tensor]) -> list[float]:
    """The relative error of the parameters' change from `start` after each update, against the reference's."""
    assert len(after) == len(expected)
    return [relative_error(a - start, b - start) for a, b in zip(after, expected, strict=True)]


def chunks(rows: list[Any], size: int) -> list[list[Any]]:
    return [rows[i : i + size] for i in range(0, len(rows), size)]


def documents_in(rows: list[dict[str, Tensor]]) -> int:
    """Documents with a supervised (shifted) token, counted row by row."""
    labels = torch.stack([row["labels"] for row in rows])
    starts = torch.stack([row["position_ids"] for row in rows]) == 0
    return len(document_means(torch.zeros(*labels.shape, VOCAB, dtype=torch.float64), labels, starts))


# 14 rows of 1 to 4 documents (a document of one token has no supervised label, padding none).
ROWS = pack(
    [[12], [3, 4, 5], [2, 2, 3, 4], [6, 5], [2, 9], [4, 4, 4], [1, 3, 2, 5], [10], [5, 2, 2], [7, 4], [2, 2, 2, 2], [11], [3, 8], [4, 2, 6]],  # noqa: E501
    seed=3,
)  # fmt: skip
SHORT = pack([[2, 2, 3, 2, 3]] * 8, seed=4)  # five short documents per row
LONG = pack([[12], [11], [10], [12]] * 2, seed=5)  # one long document per row
UNEQUAL = [row for pair in zip(SHORT, LONG, strict=True) for row in pair]  # rank 0 reads SHORT, rank 1 LONG


# ---------------------------------------------------------------------------- the function alone


def test_the_rows_are_hugging_faces_flattening_layout() -> None:
    transformers = pytest.importorskip("transformers")
    gen = torch.Generator().manual_seed(4)
    features = [{"input_ids": torch.randint(0, VOCAB, (n,), generator=gen).tolist()} for n in (3, 2, 3)]
    collated = transformers.DataCollatorWithFlattening(return_position_ids=True)(features)
    ours = pack([[3, 2, 3]], seed=4)[0]
    ours = {key: value[:8] for key, value in ours.items()}  # without the padding
    for key in ("input_ids", "labels", "position_ids"):
        assert collated[key][0].tolist() == ours[key].tolist(), key


def _random(shape: tuple[int, ...], seed: int, ignored: float = 0.3) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, VOCAB, dtype=torch.float64, generator=gen, requires_grad=True)
    labels = torch.randint(0, VOCAB, shape, generator=gen)
    labels[torch.rand(shape, generator=gen) < ignored] = IGNORE
    return logits, labels


@pytest.mark.parametrize("shift", [True, False])
@pytest.mark.parametrize("delimited_by", ["position_ids", "document_ids"])
def test_the_loss_is_the_mean_of_the_documents_means_computed_one_by_one(shift: bool, delimited_by: str) -> None:
    logits, labels = _random((3, 9), seed=1)
    positions = torch.tensor(
        [[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 1, 0, 1, 2, 0, 1, 0]]
    )  # 3, 1 and 5 documents
    labels[0, 3:5] = IGNORE  # the second document of row 0 has no supervised token: it does not count
    starts = positions == 0
    ids = torch.cumsum(starts.reshape(-1), 0).view(starts.shape) % 2  # ids alternate: only changes start documents
    delimiter = {"position_ids": positions} if delimited_by == "position_ids" else {"document_ids": ids}
    out = document_mean_loss(logits, labels, shift=shift, **delimiter)
    means = document_means(logits, labels, starts, shift=shift)
    assert int(out["num_documents"]) == len(means) < int(starts.sum())
    assert error(out["loss"], torch.stack(means).mean()) < 1e-14
    assert int(out["num_tokens"]) == int(supervised_tokens(labels, shift=shift))
    (grad,) = torch.autograd.grad(out["loss"], logits)
    (expected,) = torch.autograd.grad(torch.stack(means).mean(), logits)
    assert error(grad, expected) < 1e-13
    # Plain token weighting is another objective on the same positions.
    shifted = (logits[:, :-1], labels[:, 1:]) if shift else (logits, labels)
    tokens = F.cross_entropy(shifted[0].flatten(0, 1), shifted[1].flatten(), ignore_index=IGNORE)
    assert error(tokens, out["loss"]) > 1e-3


def test_rows_without_delimiters_another_ignore_index_and_ids_repeated_across_rows() -> None:
    logits, labels = _random((2, 6), seed=2, ignored=0.0)
    labels[0, 2] = labels[1, 5] = -1
    # Without position_ids or document_ids every row is one document (a row of one document).
    out = document_mean_loss(logits, labels, ignore_index=-1)
    means = document_means(logits, labels, torch.zeros(2, 6, dtype=torch.bool), ignore=-1)
    assert int(out["num_documents"]) == 2 and error(out["loss"], torch.stack(means).mean()) < 1e-14
    assert int(out["num_tokens"]) == 10 - 2
    # Equal ids in two rows are two documents: a document cut across rows counts as two, each part averaged alone.
    labels = labels.clamp(min=0)
    cut = document_mean_loss(logits, labels, document_ids=torch.tensor([[1, 1, 1, 2, 2, 2], [2, 2, 3, 3, 3, 3]]))
    starts = torch.tensor([[1, 0, 0, 1, 0, 0], [1, 0, 1, 0, 0, 0]], dtype=torch.bool)
    assert int(cut["num_documents"]) == 4
    assert error(cut["loss"], torch.stack(document_means(logits, labels, starts)).mean()) < 1e-14


def test_an_empty_micro_batch_is_zero_with_a_zero_gradient_and_half_logits_average_in_float32() -> None:
    for shape in ((0, 5), (2, 1), (2, 4)):  # no row; rows whose shift leaves no position; every label ignored
        logits = torch.randn(*shape, VOCAB, requires_grad=True)
        out = document_mean_loss(logits, torch.full(shape, IGNORE), position_ids=torch.zeros(shape, dtype=torch.long))
        out["loss"].backward()
        assert (float(out["loss"].detach()), int(out["num_documents"]), int(out["num_tokens"])) == (0.0, 0, 0)
        assert logits.grad is not None and not logits.grad.any()
    logits, labels = _random((2, 7), seed=3)
    out = document_mean_loss(logits.detach().to(torch.bfloat16), labels)
    assert out["loss"].dtype == torch.float32
    expected = torch.stack(document_means(logits.detach().bfloat16().float(), labels, torch.zeros(2, 7).bool())).mean()
    assert error(out["loss"], expected) < 1e-6


def test_bad_input_says_what_was_expected_and_what_was_given() -> None:
    logits, labels = _random((2, 6), seed=4)
    with pytest.raises(ValueError, match=r"`position_ids` must have the labels' shape \(2, 6\) .* got \(2, 5\)"):
        document_mean_loss(logits, labels, position_ids=torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"Pass `position_ids` or `document_ids`, not both"):
        document_mean_loss(logits, labels, position_ids=torch.zeros(2, 6, dtype=torch.long), document_ids=labels)
    with pytest.raises(TypeError, match=r"`labels` must hold integer label ids, got dtype torch.float32"):
        document_mean_loss(logits, labels.float())
    with pytest.raises(TypeError, match=r"`document_ids` must hold integers, got dtype torch.float32"):
        document_mean_loss(logits, labels, document_ids=labels.float())
    with pytest.raises(ValueError, match=r"labels \(2, 6\) need logits \(2, 6, 'V'\), got \(2, 5, 11\)"):
        document_mean_loss(logits[:, :5], labels)
    engine = lightning_accum.AccumulationEngine(normalize="documents")
    with pytest.raises(ValueError, match=r"normalizes by documents .* reports no document count\. Return .*document_"):
        engine.add_microbatch({"loss": torch.tensor(1.0), "num_tokens": 3}, None, accumulate=1)


@pytest.mark.parametrize("sole", [True, False], ids=["one micro-batch (c = w)", "the general close"])
def test_a_group_without_any_document_is_skipped_as_empty(sole: bool) -> None:
    engine, said = lightning_accum.AccumulationEngine(), []
    engine.bind(warn=lambda message, category=UserWarning: said.append(message))
    out = document_mean_loss(torch.randn(2, 4, VOCAB, requires_grad=True), torch.full((2, 4), IGNORE))
    engine.add_microbatch(out, batch=None, accumulate=1, sole=sole)
    outcome = engine.close_group(accumulate=1)
    assert (outcome.action, outcome.record.skip_reason, outcome.record.documents) == ("skip", "empty", 0)
    assert engine.unit == "documents" and "its group holds no documents at all" in said[0]


# ---------------------------------------------------------------------------- Trainer runs


class PackedLM(TinyLM):
    """TinyLM over packed rows: the mean over documents (`document_mean_loss`), or plain token weighting."""

    def __init__(self, objective: str = "documents", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.objective = objective

    def step_output(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        logits = self(batch["input_ids"])
        if self.objective == "documents":
            return document_mean_loss(logits, batch["labels"], position_ids=batch["position_ids"])
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=IGNORE)
        return {"loss": loss, "num_tokens": supervised_tokens(batch["labels"], shift=True)}

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Any:
        return self.step_output(batch)


class EvaluatedLM(PackedLM):
    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Any:
        return self.step_output(batch)


class ManualPackedLM(PackedLM):
    """The same through the manual API: `strategy.accumulate(**document_mean_loss(...))`, a group closed every A."""

    def __init__(self, accumulate: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False
        self.accumulate = accumulate

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        strategy, optimizer = self.trainer.strategy, self.optimizers()
        self.manual_backward(strategy.accumulate(**self.step_output(batch)))  # type: ignore[attr-defined]
        if (batch_idx + 1) % self.accumulate == 0 or self.trainer.is_last_batch:
            strategy.close_group(optimizer, group_size=self.accumulate)  # type: ignore[attr-defined]
            optimizer.step()
            optimizer.zero_grad()


class ParamsAfterUpdates(L.Callback):
    """Saves each rank's parameters after every attempted update, its ledger, and the documents Lightning saw in the
    steps' outputs, to `folder/{name}-rank{r}.pt`."""

    def __init__(self, folder: Path, name: str) -> None:
        self.folder, self.name = str(folder), name
        self.after: list[Tensor] = []
        self.seen = self.reported = 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        ledger = trainer.strategy.ledger  # type: ignore[attr-defined]
        if ledger.updates_attempted != self.seen:
            self.seen = ledger.updates_attempted
            self.after.append(params_vector(pl_module))
        if isinstance(outputs, dict) and "num_documents" in outputs:
            self.reported += int(outputs["num_documents"])

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        ledger = trainer.strategy.ledger  # type: ignore[attr-defined]
        state = {"after": torch.stack(self.after), "ledger": ledger.state_dict(), "reported": self.reported}
        torch.save(state, os.path.join(self.folder, f"{self.name}-rank{trainer.global_rank}.pt"))

    def load(self, rank: int = 0) -> dict[str, Any]:
        return torch.load(os.path.join(self.folder, f"{self.name}-rank{rank}.pt"), weights_only=True)


def _fit(
    tmp_path: Path, name: str, model: PackedLM, rows: list[dict[str, Tensor]], m: int, accumulate: int, **kw: Any
) -> dict[str, Any]:
    recorder = ParamsAfterUpdates(tmp_path, name)
    fit(model, rows, batch_size=m, accumulate=accumulate, callbacks=[recorder], precision="64-true", **kw)
    return recorder.load()


@pytest.mark.parametrize(
    ("m", "accumulate", "how"), [(1, 4, "auto"), (2, 3, "auto"), (4, 1, "auto"), (2, 3, "manual"), (4, 2, "sliced")]
)
def test_every_update_is_the_mean_over_the_groups_documents(tmp_path: Path, m: int, accumulate: int, how: str) -> None:
    # 14 rows: (1, 4), (2, 3) and (4, 2) end with a partial group (updated with its real denominator); (4, 1) takes the
    # one-micro-batch path (c = w); "manual" closes the groups through the manual API, "sliced" runs every loader batch
    # as slices of one row (`microbatch_size=1`).
    model = ManualPackedLM(accumulate, lr=0.5) if how == "manual" else PackedLM(lr=0.5)
    strategy = AccumulationStrategy(microbatch_size=1) if how == "sliced" else "accum"
    start, expected = params_vector(model), reference_updates(model, chunks(ROWS, m * accumulate), lr=0.5)
    run = _fit(tmp_path, "documents", model, ROWS, m, 1 if how == "manual" else accumulate, strategy=strategy)
    errors = update_errors(start, run["after"], expected)
    print(f"m={m} A={accumulate} {how}: the change's largest relative error {max(errors):.1e}")
    assert max(errors) < 1e-12
    ledger = run["ledger"]
    assert ledger["normalization"] == "documents" and ledger["documents"] == documents_in(ROWS)
    # What Lightning sees of each step's output (a sliced batch's: the sum over its slices).
    assert run["reported"] == (0 if how == "manual" else documents_in(ROWS))
    assert ledger["tokens"] == sum(int(supervised_tokens(row["labels"], shift=True)) for row in ROWS)
    assert ledger["last_group"]["documents"] == documents_in(chunks(ROWS, m * accumulate)[-1])


def test_plain_token_weighting_is_another_update(tmp_path: Path) -> None:
    model = PackedLM(lr=0.5)
    start = params_vector(model)
    documents = reference_updates(model, chunks(ROWS, 6), lr=0.5)[-1]
    tokens = _fit(tmp_path, "tokens", PackedLM(objective="tokens", lr=0.5), ROWS, 2, 3)["after"][-1]
    difference = relative_error(tokens - start, documents - start)
    print(f"token weighting vs the mean over documents: the parameters' change differs by {difference:.1%}")
    assert difference > 0.05


def test_no_host_read_per_micro_batch_and_one_per_update() -> None:
    counter = MicroBatchSyncCounter()
    trainer = fit(PackedLM(lr=0.5), ROWS[:12], batch_size=1, accumulate=4, callbacks=[counter])
    assert counter.non_final_batches == 9 and counter.non_final.package_ops > 9 * 10  # the loss ran in the package
    assert counter.non_final.hits == []
    assert len(counter.final.hits) == 3 and all("tolist" in hit for hit in counter.final.hits)
    assert trainer.strategy.ledger.updates_applied == 3  # type: ignore[attr-defined]


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_two_processes_update_with_the_mean_over_every_replicas_documents(tmp_path: Path) -> None:
    # m = 2, A = 2, D = 2: each update sees 8 consecutive rows, rank 0 the ones of many short documents, rank 1 the
    # ones of one long document each: a mean of the replicas' own document means would weigh them alike.
    model = PackedLM(lr=0.5)
    start, expected = params_vector(model), reference_updates(model, chunks(UNEQUAL, 8), lr=0.5)
    # Each replica's own mean over its documents, averaged over the replicas (as DDP averages), is another update.
    per_replica = copy.deepcopy(model).double()
    (reference_loss(per_replica, UNEQUAL[0:8:2]) + reference_loss(per_replica, UNEQUAL[1:8:2])).div(2).backward()
    averaged = params_vector(per_replica) - 0.5 * torch.cat([p.grad.reshape(-1) for p in per_replica.parameters()])
    recorder = ParamsAfterUpdates(tmp_path, "ddp")
    fit(model, UNEQUAL, 2, 2, strategy=forked_ddp(), devices=2, callbacks=[recorder], precision="64-true")
    ranks = [recorder.load(rank) for rank in (0, 1)]
    for rank in ranks:
        errors = update_errors(start, rank["after"], expected)
        print(f"D=2: the change's largest relative error {max(errors):.1e} over {len(errors)} updates")
        assert len(errors) == 2 and max(errors) < 1e-12, errors
    assert ranks[0]["ledger"] == ranks[1]["ledger"]
    assert ranks[0]["ledger"]["documents"] == documents_in(UNEQUAL)
    assert documents_in(UNEQUAL[0::2]) > 2 * documents_in(UNEQUAL[1::2])  # the replicas' documents differ
    assert relative_error(averaged - start, expected[0] - start) > 0.05


class DocumentMeansByTokens(PackedLM):
    """The mean over documents weighted by the micro-batch's tokens: neither objective."""

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Any:
        out = self.step_output(batch)
        return {"loss": out["loss"], "num_tokens": out["num_tokens"]}


def test_the_pre_flight_check_passes_on_documents_and_fails_on_their_means_weighted_by_tokens() -> None:
    check = AccumulationCheck()
    fit(PackedLM(lr=0.5), ROWS[:8], batch_size=2, accumulate=4, callbacks=[check])
    assert check.result is not None and check.result.passed and check.result.relative_error < 1e-5
    with pytest.raises(AccumulationCheckError, match=r"AccumulationCheck failed"):
        fit(DocumentMeansByTokens(lr=0.5), ROWS[:8], batch_size=2, accumulate=4, callbacks=[AccumulationCheck()])


# ---------------------------------------------------------------------------- the documents axis


def _lr(count: int) -> float:
    return 1.0 / (1.0 + count / 10)


class ScheduledLM(PackedLM):
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        scheduler = AxisLR(optimizer, axis="documents", lr_lambda=_lr)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def test_the_ledger_logger_horizon_schedule_report_and_bar_count_documents(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    groups = chunks(ROWS, 4)  # m = 2, A = 2
    per_update = [documents_in(group) for group in groups]
    cumulative = [sum(per_update[: i + 1]) for i in range(len(per_update))]
    budget = cumulative[1] + 1  # reached by the third update, which stops the run
    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    report = AccumulationReport(path=tmp_path)
    callbacks = [
        AxisLogger(axis="documents"),
        Horizon(axis="documents", stop_at=budget),
        report,
        AxisProgressBar(axis="documents", plain=True, interval=3600.0),
    ]
    trainer = make_trainer(
        accumulate_grad_batches=2,
        max_epochs=3,  # the budget ends it in the first epoch
        logger=logger,
        log_every_n_steps=1,
        callbacks=callbacks,
        enable_progress_bar=True,
    )
    trainer.fit(ScheduledLM(lr=0.5), DataLoader(ListDataset(ROWS), batch_size=2))
    ledger = trainer.strategy.ledger  # type: ignore[attr-defined]
    assert (ledger.updates_attempted, ledger.documents, ledger.normalization) == (3, cumulative[2], "documents")

    events = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"scalars": 0})
    events.Reload()
    logged = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert logged["accum/documents"] == [(x, float(x)) for x in cumulative[:3]]
    assert [(x, int(v)) for x, v in logged["accum/documents_per_update"]] == list(
        zip(cumulative, per_update, strict=True)
    )[:3]
    assert [x for x, _ in logged["accum/loss"]] == cumulative[:3]
    # AxisLR: each update's rate is the base times lr_lambda(the documents the updates before it consumed).
    rates = [v for _, v in logged["accum/lr"]]
    assert rates == pytest.approx([0.5 * _lr(x) for x in [0, *cumulative[:2]]], rel=1e-6)

    record = json.loads(Path(report.written_to or "").read_text())
    assert record["documents"] == {
        "total": cumulative[2],
        "per_update_min": min(per_update[:3]),
        "per_update_mean": pytest.approx(cumulative[2] / 3),
        "per_update_max": max(per_update[:3]),
        "dropped": 0,
    }
    line = capsys.readouterr().out
    assert re.search(rf"documents {cumulative[2]}/{budget} \(\d+\.\d%\) \| [\d.]+k? doc/s", line), line


def test_the_documents_axis_in_a_run_without_document_counts_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match=r"AxisLogger\(axis='documents'\) needs document counts, .*document_mean_"):
        fit(TinyLM(), make_examples([3, 4, 2, 5]), batch_size=2, accumulate=1, callbacks=[AxisLogger(axis="documents")])


def test_a_fabric_loop_accumulates_documents_and_logs_on_their_axis(tmp_path: Path) -> None:
    model = PackedLM(lr=0.5)
    start, expected = params_vector(model), reference_updates(model, chunks(ROWS, 4), lr=0.5)  # m = 2, A = 2
    # A float64 model (Fabric's "64-true" hands the forward's output back in float32).
    fabric = L.Fabric(strategy="accum", accelerator="cpu", loggers=[])
    net = copy.deepcopy(model).double()
    module, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.5))
    seen, counts = [], []
    for i, batch in enumerate(DataLoader(ListDataset(ROWS), batch_size=2)):
        out = document_mean_loss(module(batch["input_ids"]), batch["labels"], position_ids=batch["position_ids"])
        fabric.backward(fabric.strategy.accumulate(**out))
        if (i + 1) % 2 == 0 or i == 6:  # 7 micro-batches: the last group is partial
            fabric.strategy.close_group(optimizer, group_size=2)
            optimizer.step()
            optimizer.zero_grad()
            seen.append(params_vector(module))
            counts.append(log_on_axis(fabric, {"loss": 0.0}, axis="documents"))
    assert max(update_errors(start, seen, expected)) < 1e-12
    assert counts == [documents_in(ROWS[: 4 * (k + 1)]) for k in range(4)]


# ---------------------------------------------------------------------------- evaluation and checkpoints


def test_the_validation_loss_is_the_mean_over_the_sets_documents() -> None:
    model, rows = EvaluatedLM(), ROWS[:7]  # batches of 5 and 2 rows
    with torch.no_grad():
        reference = copy.deepcopy(model).double()
        expected = float(reference_loss(reference, rows))
        batches = [(len(chunk), float(reference_loss(reference, chunk))) for chunk in chunks(rows, 5)]
    loader = DataLoader(ListDataset(rows), batch_size=5)
    (metrics,) = make_trainer(precision="64-true").validate(model, loader, verbose=False)
    assert metrics["accum/val_loss"] == pytest.approx(expected, rel=1e-12, abs=0)
    assert "accum/val_perplexity" not in metrics  # a mean over documents is no per-token cross-entropy
    # Lightning's `self.log(..., batch_size=rows)` of each batch's loss: a mean of the batches' means.
    lightning = sum(size * loss for size, loss in batches) / len(rows)
    assert abs(lightning - expected) > 3e-3 * expected  # 6.8e-3 here


def test_a_fabric_evaluation_of_packed_rows_is_the_mean_over_the_sets_documents() -> None:
    model, rows = EvaluatedLM(), ROWS[:7]
    with torch.no_grad():
        net = copy.deepcopy(model).double()
        expected = float(reference_loss(net, rows))
        fabric = L.Fabric(strategy="accum", accelerator="cpu", loggers=[])
        module = fabric.setup_module(net)
        evaluation = fabric.strategy.evaluation()
        for batch in DataLoader(ListDataset(rows), batch_size=5):  # batches of 5 and 2 rows
            logits = module(batch["input_ids"])
            evaluation.add(**document_mean_loss(logits, batch["labels"], position_ids=batch["position_ids"]))
        record = evaluation.compute()
    # Weighted by documents ("auto": the batches report them), not by the tokens they also report.
    assert (record.unit, record.documents) == ("documents", documents_in(rows))
    assert record.loss == pytest.approx(expected, rel=1e-12, abs=0)


def test_a_checkpoint_written_before_documents_were_counted_resumes_exactly(tmp_path: Path) -> None:
    examples = make_examples(random_lengths(12, seed=6), seed=6)

    def loader() -> ResumableLoader:
        return ResumableLoader(ListDataset(examples), batch_size=2)

    written = tmp_path / "now.ckpt"
    make_trainer(accumulate_grad_batches=3, callbacks=[CheckpointAt(written, 4)]).fit(TinyLM(), loader())
    state = torch.load(written, weights_only=True)
    entry = state["lightning_accum"]
    ledger, sums = entry["ledger"], entry["open_group"]["sums"]  # written inside the second group
    for holder, key in ((ledger, "documents"), (ledger, "dropped_documents"), (ledger["last_group"], "documents")):
        del holder[key]
    del sums["documents_hi"], sums["documents_lo"]
    torch.save(state, tmp_path / "before.ckpt")  # the entry as a version without documents wrote it
    runs = []
    for name in ("now", "before"):
        model, trainer = TinyLM(), make_trainer(accumulate_grad_batches=3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Lightning's notes on a mid-epoch resume
            trainer.fit(model, loader(), ckpt_path=tmp_path / f"{name}.ckpt")
        runs.append((params_vector(model), trainer.strategy.ledger))  # type: ignore[attr-defined]
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]
    assert runs[1][1].documents == 0 and runs[1][1].updates_applied == 2


def test_a_group_weighted_by_documents_resumes_exactly_from_inside(tmp_path: Path) -> None:
    def run(callbacks: list[L.Callback], ckpt: Path | None = None) -> tuple[Tensor, Any]:
        # A float64 model, not `precision="64-true"`: Lightning restores a checkpoint's weights into the module before
        # that precision converts it, so they come back rounded to float32.
        model = PackedLM(lr=0.5).double()
        trainer = make_trainer(accumulate_grad_batches=3, callbacks=callbacks)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Lightning's notes on a mid-epoch resume
            trainer.fit(model, ResumableLoader(ListDataset(ROWS), batch_size=2), ckpt_path=ckpt)
        return params_vector(model), trainer.strategy.ledger  # type: ignore[attr-defined]

    start = params_vector(PackedLM(lr=0.5))
    whole, ledger = run([CheckpointAt(tmp_path / "inside.ckpt", 4)])  # the 2nd micro-batch of the 2nd group
    entry = torch.load(tmp_path / "inside.ckpt", weights_only=True)["lightning_accum"]
    assert entry["open_group"]["sums"]["units"] == documents_in(ROWS[6:10]) > 0  # the group's documents so far
    resumed, resumed_ledger = run([], tmp_path / "inside.ckpt")
    assert relative_error(resumed - start, whole - start) < 1e-12
    assert resumed_ledger.documents == ledger.documents == documents_in(ROWS)
    assert resumed_ledger.last_group.documents == ledger.last_group.documents
