"""Exact evaluation in Fabric loops: `fabric.strategy.evaluation()` against the float64 loss of the set (Σ token losses
/ Σ supervised tokens) at several splits on one device and over two processes, where the mean of batch means (LitGPT's
`validate()`) moves with the split (reuse, the empty set, bad input: tests/test_evaluation_loss.py)."""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import IGNORE, TinyLM, make_examples, random_lengths
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_accum import EvaluationRecord, FabricDDPAccumulationStrategy

#: 25 sequences of 0 to 6 supervised tokens (the 5th and the 12th without any): batches of very different weights.
LENGTHS = random_lengths(25, seed=5)
LENGTHS[4] = LENGTHS[11] = 0
EXAMPLES = make_examples(LENGTHS, seed=5)
TOKENS = sum(LENGTHS)


def stack(examples: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    return {key: torch.stack([e[key] for e in examples]) for key in examples[0]}


def batches(examples: list[dict[str, Tensor]], size: int) -> list[dict[str, Tensor]]:
    return [stack(examples[i : i + size]) for i in range(0, len(examples), size)]


def model64() -> TinyLM:
    return TinyLM(seed=3).double()


def reference(examples: list[dict[str, Tensor]]) -> float:
    """The set's loss in float64, outside the package: every token loss of the set summed, over its tokens."""
    model, batch = model64(), stack(examples)
    with torch.no_grad():
        logits = model(batch["input_ids"]).flatten(0, 1)
        total = F.cross_entropy(logits, batch["labels"].flatten(), ignore_index=IGNORE, reduction="sum")
    return float(total) / int((batch["labels"] != IGNORE).sum())


def mean_loss(model: Any, batch: dict[str, Tensor]) -> Tensor:
    """The batch's mean cross-entropy over its supervised tokens (NaN for a batch without any)."""
    return F.cross_entropy(model(batch["input_ids"]).flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE)


def evaluate(model: Any, loader: list[dict[str, Tensor]], evaluation: Any) -> list[float]:
    """A Fabric validation loop: each batch added to `evaluation`; returns the batch means (what LitGPT averages)."""
    means = []
    with torch.no_grad():
        for batch in loader:
            loss = mean_loss(model, batch)
            evaluation.add(loss, num_tokens=(batch["labels"] != IGNORE).sum())
            means.append(float(loss))
    return means


def one_device() -> tuple[L.Fabric, Any]:
    fabric = L.Fabric(strategy="accum", accelerator="cpu")
    return fabric, fabric.setup_module(model64())


# ---------------------------------------------------------------------- one device


def test_one_device_gives_the_float64_loss_of_the_set_at_every_split_where_the_mean_of_batch_means_moves() -> None:
    expected = reference(EXAMPLES)
    fabric, model = one_device()
    for size in (1, 3, 4, 25):
        evaluation = fabric.strategy.evaluation()
        means = evaluate(model, batches(EXAMPLES, size), evaluation)
        record = evaluation.compute()
        assert record == EvaluationRecord(loss=record.loss, unit="tokens", units=TOKENS, batches=len(means))
        assert abs(record.loss - expected) < 1e-12 * expected, (size, record.loss, expected)
        assert record.perplexity == pytest.approx(math.exp(expected), rel=1e-12)
        mean_of_means = sum(means) / len(means)  # LitGPT's `validate()`: `losses.mean()`
        if size == 1:
            assert math.isnan(mean_of_means)  # a batch without supervised tokens is 0/0 there; it weighs 0 here
        elif size < 25:
            assert abs(mean_of_means - expected) > 1e-3, size


def test_litgpts_own_validate_is_the_mean_of_batch_means_and_differs() -> None:
    full = pytest.importorskip("litgpt.finetune.full")
    from litgpt import Config
    from litgpt.args import EvalArgs
    from litgpt.model import GPT
    from litgpt.utils import chunked_cross_entropy

    from lightning_accum import supervised_tokens

    torch.manual_seed(0)
    config = Config(n_layer=1, n_head=2, n_embd=8, block_size=8, vocab_size=16, padded_vocab_size=16)
    fabric = L.Fabric(strategy="accum", accelerator="cpu")
    model = fabric.setup_module(GPT(config).double())
    examples = make_examples([6, 1, 1, 5, 2, 6, 1, 4, 6], seed=8)  # shifted inside the loss: 0 to 5 tokens each
    loader = batches(examples, 3)
    evaluation = fabric.strategy.evaluation()
    with torch.no_grad():
        for batch in loader:
            logits = model(batch["input_ids"])
            loss = chunked_cross_entropy(logits[..., :-1, :], batch["labels"][..., 1:], chunk_size=0)
            evaluation.add(loss, num_tokens=supervised_tokens(batch["labels"], shift=True))
        whole = stack(examples)
        logits = model(whole["input_ids"])[..., :-1, :].flatten(0, 1)
        labels = whole["labels"][..., 1:].flatten()
        expected = float(F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")) / int(
            (labels != IGNORE).sum()
        )
    litgpt = float(full.validate(fabric, model, loader, EvalArgs(max_iters=len(loader)), verbose=False))
    assert abs(evaluation.compute().loss - expected) < 1e-12 * expected
    assert abs(litgpt - expected) > 1e-2, (litgpt, expected)


# ---------------------------------------------------------------------- two processes


def _worker(fabric: L.Fabric, folder: str) -> None:
    rank = fabric.global_rank
    model = fabric.setup_module(model64())
    out: dict[str, Any] = {}
    evaluation = fabric.strategy.evaluation()
    for size in (2, 3):  # the ranks share the set unevenly: 13 and 12 examples, 7 (5) and 6 (4) batches
        evaluation.reset()
        out[f"means{size}"] = evaluate(model, batches(EXAMPLES[rank::2], size), evaluation)
        out[f"split{size}"] = evaluation.compute()
    evaluation.reset()  # rank 1 adds no batch at all: it joins the one all-reduce, and nothing hangs
    evaluate(model, batches(EXAMPLES, 4) if rank == 0 else [], evaluation)
    out["one_rank"] = evaluation.compute()
    evaluation.reset()
    evaluation.add(torch.tensor(1.0), **({"num_tokens": 3} if rank == 0 else {"num_samples": 3}))
    out["units"] = _error(evaluation.compute)
    evaluation.reset()
    evaluation.add(torch.tensor(1.0), num_tokens=torch.tensor(-1 if rank == 1 else 2))
    out["negative"] = _error(evaluation.compute)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric.setup_dataloaders(DataLoader(EXAMPLES[:7], batch_size=2))  # 7 examples on 2 ranks: one repeated
        fabric.setup_dataloaders(DataLoader(EXAMPLES[:8], batch_size=2))  # 8: nothing to pad
        fabric.setup_dataloaders(DataLoader(EXAMPLES[:7], batch_size=2, shuffle=True))  # a training loader
    out["padded"] = [str(w.message) for w in caught if "lightning_accum" in str(w.message)]
    torch.save(out, Path(folder) / f"rank{rank}.pt")


def _error(call: Any) -> str:
    try:
        call()
    except (RuntimeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


@pytest.mark.ddp
@pytest.mark.timeout(300)
@pytest.mark.skipif(sys.platform == "win32", reason="gloo spawn on Linux/macOS")
def test_two_processes_give_every_rank_the_float64_loss_of_the_whole_set(tmp_path: Path) -> None:
    strategy = FabricDDPAccumulationStrategy(start_method="forkserver")
    L.Fabric(strategy=strategy, devices=2, accelerator="cpu").launch(_worker, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(2)]
    expected = reference(EXAMPLES)
    for key in ("split2", "split3", "one_rank"):
        zero, one = ranks[0][key], ranks[1][key]
        assert zero == one, key  # the same record, bit for bit, on every rank
        assert abs(zero.loss - expected) < 1e-12 * expected, (key, zero.loss, expected)
        assert (zero.unit, zero.units) == ("tokens", TOKENS)
    assert ranks[0]["split2"].batches == 13 and ranks[0]["split3"].batches == 9 and ranks[0]["one_rank"].batches == 7
    for size in (2, 3):  # each rank's mean of batch means (LitGPT's, which has no all-reduce) is another number
        own = [sum(r[f"means{size}"]) / len(r[f"means{size}"]) for r in ranks]
        assert all(abs(value - expected) > 1e-3 for value in own if not math.isnan(value)), own
    for rank in ranks:
        assert rank["units"].startswith("RuntimeError: Ranks weighted their evaluation batches by different units")
        assert rank["negative"].startswith(
            "ValueError: A negative `num_tokens`, `num_samples` or `num_documents` was reported"
        )
    # Fabric's sampler pads the set of 7 (rank 1 reads example 0 again): named as the Trainer names it (before: no
    # word, and the set's loss -1.8e-2 off). Rank zero warns, once; a shuffled (training) loader is not named.
    assert len(ranks[0]["padded"]) == 1 and ranks[1]["padded"] == []
    assert "counts 1 example(s) twice" in ranks[0]["padded"][0] and "pads the 7 examples" in ranks[0]["padded"][0]
