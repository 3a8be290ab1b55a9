"""evaluation_loss: an evaluation's sums kept and reset, the empty set, bad input, and no host read per batch."""

from __future__ import annotations

import gc
import math
import re
import weakref
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import IGNORE
from host_reads import HostReadProbe
from test_fabric_evaluation import EXAMPLES, batches, evaluate, mean_loss, one_device, reference, stack

from lightning_accum import EvaluationRecord, FabricAccumulationStrategy


def test_compute_keeps_the_sums_and_reset_starts_the_next_evaluation() -> None:
    fabric, model = one_device()
    evaluation = fabric.strategy.evaluation()
    evaluate(model, batches(EXAMPLES[:10], 4), evaluation)
    first = evaluation.compute()
    assert evaluation.compute() == first  # as a torchmetrics metric: compute does not empty the sums
    assert abs(first.loss - reference(EXAMPLES[:10])) < 1e-12 * first.loss
    evaluate(model, batches(EXAMPLES[10:], 4), evaluation)  # without reset: the set grows
    assert abs(evaluation.compute().loss - reference(EXAMPLES)) < 1e-12 * first.loss
    evaluation.reset()
    evaluation.add(torch.tensor(1.0, dtype=torch.float64), num_samples=3)  # a new evaluation: its own unit
    assert evaluation.compute() == EvaluationRecord(loss=1.0, unit="samples", units=3, batches=1)
    other = fabric.strategy.evaluation()  # a new, empty one
    with pytest.warns(UserWarning, match="no batch was added"):
        assert other is not evaluation and other.compute().batches == 0


def test_an_empty_set_and_a_set_without_units_are_nan_with_a_warning() -> None:
    fabric, model = one_device()
    evaluation = fabric.strategy.evaluation()
    with pytest.warns(UserWarning, match=r"`evaluation.compute\(\)` is NaN: no batch was added on any replica"):
        record = evaluation.compute()
    assert math.isnan(record.loss) and (record.unit, record.units, record.batches) == (None, 0, 0)
    unsupervised = [e for e in EXAMPLES if not (e["labels"] != IGNORE).any()]
    evaluate(model, batches(unsupervised, 1), evaluation)
    with pytest.warns(UserWarning, match=r"is NaN: the set holds no tokens at all"):
        record = evaluation.compute()
    assert math.isnan(record.loss) and (record.unit, record.units, record.batches) == ("tokens", 0, 2)
    assert math.isnan(record.perplexity)  # type: ignore[arg-type]


BAD_COUNTS = [True, 2.5, torch.tensor(3.0), torch.tensor([2, 3]), -1, torch.tensor(True)]


@pytest.mark.parametrize("count", BAD_COUNTS, ids=lambda c: repr(c).replace(" ", ""))
def test_add_refuses_what_accumulate_refuses_with_the_same_message(count: Any) -> None:
    fabric, model = one_device()
    loss = mean_loss(model, stack(EXAMPLES[:2]))
    with pytest.raises((TypeError, ValueError)) as accumulate:
        fabric.strategy.accumulate(loss, num_tokens=count)
    with pytest.raises(accumulate.type, match="^" + re.escape(str(accumulate.value)) + "$"):
        fabric.strategy.evaluation().add(loss.detach(), num_tokens=count)


def test_a_loss_that_is_not_one_value_and_a_missing_or_mixed_count_are_errors() -> None:
    fabric, _ = one_device()
    evaluation = fabric.strategy.evaluation()
    with pytest.raises(TypeError, match=r"takes the batch's mean loss as a tensor, got float"):
        evaluation.add(2.0, num_tokens=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"got a tensor of shape \(2,\)"):
        evaluation.add(torch.ones(2), num_tokens=3)
    evaluation.add(torch.tensor(2.0), num_tokens=3)
    with pytest.raises(ValueError, match=r"by tokens \(fixed by this evaluation's first batch\).*no `num_tokens`"):
        evaluation.add(torch.tensor(2.0), num_samples=4)  # mixing units in one evaluation
    tokens_only = L.Fabric(strategy=FabricAccumulationStrategy(normalize="tokens"), accelerator="cpu")
    with pytest.raises(ValueError, match=r"by tokens \(`normalize='tokens'`\), but this batch reports no `num_tokens`"):
        tokens_only.strategy.evaluation().add(torch.tensor(2.0), batch=stack(EXAMPLES[:2]))  # samples only


def test_a_negative_tensor_count_is_refused_by_compute() -> None:
    fabric, _ = one_device()
    evaluation = fabric.strategy.evaluation()
    evaluation.add(torch.tensor(2.0), num_tokens=torch.tensor(-3))  # refused without a host read: at compute
    with pytest.raises(
        ValueError, match=r"negative `num_tokens`, `num_samples` or `num_documents` was reported to `evaluation.add`"
    ):
        evaluation.compute()


def test_add_reads_nothing_on_the_host_keeps_no_graph_and_compute_reads_once() -> None:
    fabric, model = one_device()
    evaluation = fabric.strategy.evaluation()
    loader = batches(EXAMPLES, 4)
    with HostReadProbe() as probe:
        for batch in loader:  # outside no_grad: losses that require grad, counts as tensors and as ints
            hidden = torch.tanh(model.embed(batch["input_ids"]))  # kept by the graph for the backward
            graph = weakref.ref(hidden)
            loss = F.cross_entropy(model.head(hidden).flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE)
            evaluation.add(loss, num_tokens=(batch["labels"] != IGNORE).sum(), batch=batch)
            evaluation.add(loss.detach() * 0 + 1, num_tokens=0)  # an empty batch adds nothing
            del hidden, loss
            gc.collect()
            assert graph() is None  # the sums hold no reference to the loss's graph
    assert probe.hits == [] and probe.package_ops > 0
    with HostReadProbe() as probe:
        record = evaluation.compute()
    assert len(probe.hits) == 1 and probe.hits[0].startswith("tolist at lightning_accum.evaluation_loss")
    assert abs(record.loss - reference(EXAMPLES)) < 1e-12 * record.loss and record.batches == 2 * len(loader)
