"""Token counts of Hugging Face losses: the helper against the loss itself, split invariance, the "auto" hint."""

from __future__ import annotations

import importlib.util
import inspect
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import lightning_accum
from lightning_accum import AccumulationStrategy, TokenWeightingWarning, causal_lm_tokens, supervised_tokens
from lightning_accum.tokens import find_labels, ignored_label_key, seq2seq_tokens, token_weighting_hint

transformers = pytest.importorskip("transformers")

from hf_models import IGNORE, VOCAB, HFCausalLM, fit_hf, pad_collate, sequences, tiny_gpt2  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


def params(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).to(torch.float64) for p in module.parameters()])


# ---------------------------------------------------------------------------- the count itself


def test_helper_count_times_loss_is_the_summed_shifted_cross_entropy() -> None:
    model = tiny_gpt2().double()
    batch = pad_collate(sequences(6, seed=1))
    batch["labels"][0, :3] = IGNORE  # an ignored prompt, as well as the padding
    out = model(**batch)
    logits = out.logits.double()
    # The reference: every position t predicts label t + 1, in float64, summed.
    summed = F.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1), ignore_index=IGNORE, reduction="sum"
    )
    count = supervised_tokens(batch["labels"], shift=True)
    assert count.dtype == torch.int64 and count.ndim == 0 and count.device == batch["labels"].device
    assert abs(float(out.loss.detach()) * int(count) - float(summed.detach())) <= 1e-6 * float(summed.detach())
    # The naive count has one token too many for every sequence whose first label is supervised (here 5 of 6).
    naive = (batch["labels"] != IGNORE).sum()
    assert int(naive) - int(count) == int((batch["labels"][:, 0] != IGNORE).sum()) == 5
    assert abs(float(out.loss.detach()) * int(naive) - float(summed.detach())) > 1e-2 * float(summed.detach())


def test_seq2seq_loss_averages_over_every_label_position() -> None:
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config)
    batch = pad_collate(sequences(4, seed=2))
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    summed = F.cross_entropy(
        out.logits.double().reshape(-1, VOCAB), batch["labels"].reshape(-1), ignore_index=IGNORE, reduction="sum"
    )
    count = seq2seq_tokens(batch)
    assert int(count) == int(supervised_tokens(batch["labels"], shift=False)) == int((batch["labels"] != IGNORE).sum())
    assert abs(float(out.loss.detach()) * int(count) - float(summed.detach())) <= 1e-6 * float(summed.detach())


def test_count_errors_name_the_argument_and_the_fix() -> None:
    with pytest.raises(TypeError, match=r"`labels` must hold integer label ids, got dtype torch.float32"):
        supervised_tokens(torch.zeros(2, 3), shift=True)
    with pytest.raises(TypeError, match=r"`labels` must be a tensor of label ids, got list"):
        supervised_tokens([1, 2], shift=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"must have a sequence dimension to shift.*`shift=False`"):
        supervised_tokens(torch.tensor(3), shift=True)
    assert int(supervised_tokens(torch.tensor(3), shift=False)) == 1
    with pytest.raises(KeyError, match=r"`causal_lm_tokens` reads `batch\['labels'\]`.*\['input_ids', 'target'\]"):
        causal_lm_tokens({"input_ids": torch.zeros(1, 2), "target": torch.zeros(1, 2, dtype=torch.long)})


def test_the_shift_has_no_default_and_its_error_names_both_cases() -> None:
    # A default undercounted the README's already-shifted labels by 13 % without a word (issue #66): the caller says.
    labels = torch.tensor([[5, 6, 7], [8, 9, -100]])
    both = r"needs `shift=True` or `shift=False` \(got {}\): `shift=True` if the loss compares `logits\[\.\.\., :-1\]`"
    both += r" with `labels\[\.\.\., 1:\]`.*`shift=False` if the labels are already shifted.*causal_lm_tokens"
    with pytest.raises(TypeError, match=both.format("none")):
        supervised_tokens(labels)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=both.format("1")):
        supervised_tokens(labels, shift=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="positional"):
        supervised_tokens(labels, True)  # type: ignore[misc]
    assert str(inspect.signature(supervised_tokens).parameters["shift"].default) == "<required>"
    assert (int(supervised_tokens(labels, shift=True)), int(supervised_tokens(labels, shift=False))) == (3, 5)


def test_labels_are_found_by_key_and_dtype() -> None:
    batch = {
        "input_ids": torch.zeros(2, 3, dtype=torch.long),
        "label_weights": torch.ones(2, 3),  # floating point: not labels
        "extra": [{"targets": torch.tensor([[1, IGNORE]])}],
    }
    assert [key for key, _ in find_labels(batch)] == ["targets"]
    assert ignored_label_key(batch) == "targets"
    assert ignored_label_key(batch, ignore_index=-1) is None
    assert token_weighting_hint("batches", batch) is not None
    assert token_weighting_hint("samples", {"labels": torch.tensor([[1, 2]])}) is None


# ---------------------------------------------------------------------------- in a run


@pytest.mark.parametrize("how", ["num_tokens", "count_tokens"])
def test_split_invariance_with_the_helper(how: str) -> None:
    data = sequences(16, seed=3)
    runs = {}
    for m, a in [(8, 1), (4, 2), (2, 4)]:
        model = HFCausalLM(count="helper" if how == "num_tokens" else "none", seed=0)
        strategy = AccumulationStrategy(count_tokens=causal_lm_tokens) if how == "count_tokens" else "accum"
        trainer = fit_hf(model, data, batch_size=m, accumulate=a, strategy=strategy)
        assert trainer.strategy.ledger.updates_applied == 2
        assert trainer.strategy.ledger.tokens == sum(len(e["labels"]) - 1 for e in data)
        runs[(m, a)] = params(model)
    for split in [(4, 2), (2, 4)]:
        assert relative_error(runs[split], runs[(8, 1)]) <= 1e-5, split


def test_the_naive_count_breaks_split_invariance() -> None:
    # What the helper fixes: counting the first label of every sequence makes the update depend on the split.
    data = sequences(16, seed=3)
    runs = {}
    for m, a in [(8, 1), (2, 4)]:
        model = HFCausalLM(count="naive", seed=0)
        fit_hf(model, data, batch_size=m, accumulate=a)
        runs[(m, a)] = params(model)
    assert relative_error(runs[(2, 4)], runs[(8, 1)]) > 1e-4


@pytest.mark.parametrize("count", ["output", "loss"])
def test_auto_warns_once_when_ignored_labels_are_weighted_by_samples(count: str) -> None:
    data = sequences(8, seed=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit_hf(HFCausalLM(count=count), data, batch_size=2, accumulate=2)
    hints = [w for w in caught if issubclass(w.category, TokenWeightingWarning)]
    assert len(hints) == 1, [str(w.message) for w in caught]
    text = str(hints[0].message)
    assert "weighted by samples" in text and "token weighting is probably intended" in text
    assert "count_tokens=lightning_accum.causal_lm_tokens" in text
    assert trainer.strategy.ledger.normalization == "samples" and trainer.strategy.ledger.updates_applied == 2


def test_no_hint_without_ignored_positions_or_with_a_count() -> None:
    data = sequences(4, seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TokenWeightingWarning)
        fit_hf(HFCausalLM(count="loss"), data, batch_size=1, accumulate=2)  # m = 1: no padding, nothing ignored
        fit_hf(HFCausalLM(count="helper"), data, batch_size=2, accumulate=2)
        fit_hf(
            HFCausalLM(count="loss"),
            data,
            batch_size=2,
            accumulate=2,
            strategy=AccumulationStrategy(normalize="samples"),
        )


# ---------------------------------------------------------------------------- the example


def test_example_in_a_reduced_size(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("hf_causal_lm", ROOT / "examples" / "hf_causal_lm.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example
    spec.loader.exec_module(example)
    result = example.main(
        ["--sequences", "16", "--effective-batch", "8", "--updates", "2", "--max-len", "24", "--quiet"]
    )
    printed = capsys.readouterr().out
    assert "m × A × D" in printed and "supervised tokens" in printed
    assert result["check"] == "passed" and result["updates"] == 2
    # The splits of the example agree: same examples, same updates.
    first, *others = result["params"].values()
    for other in others:
        assert relative_error(other, first) <= 1e-5
    assert lightning_accum.causal_lm_tokens is causal_lm_tokens  # the package face exports the preset


@pytest.mark.parametrize(
    ("accumulate", "as_int"), [(1, False), (2, False), (2, True)], ids=["sole-tensor", "group-tensor", "group-int"]
)
def test_a_token_count_above_the_label_positions_is_warned_once(accumulate: int, as_int: bool) -> None:
    # A count of supervised tokens is at most `labels.numel()`: one above it counts something else (here every
    # position twice). Compared in the group's one read (tensors) or on the host (ints): no read per micro-batch.
    from helpers import ListDataset, TinyLM, make_examples, random_lengths

    class OverCounts(TinyLM):
        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
            out = super().training_step(batch, batch_idx)
            count = 2 * batch["labels"].numel() if batch_idx == 3 else out["num_tokens"]
            out["num_tokens"] = int(count) if as_int else torch.as_tensor(count)
            return out

    trainer = fit_trainer(accumulate, epochs=2)
    loader = torch.utils.data.DataLoader(ListDataset(make_examples(random_lengths(12, seed=3), seed=3)), batch_size=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(OverCounts(), loader)
    said = [str(w.message) for w in caught if "than their batch has label positions" in str(w.message)]
    update = 3 // accumulate + 1
    assert said == [said[0]] and said[0].startswith(f"lightning_accum: 1 micro-batch(es) of update {update} "), said


def test_a_token_count_within_the_label_positions_says_nothing() -> None:
    # Every label position supervised (the most a count can be): no warning (the suite turns warnings into errors).
    from helpers import ListDataset, TinyLM, make_examples

    trainer = fit_trainer(2, epochs=1)
    examples = make_examples([6] * 8)  # SEQ = 6: every position carries a label
    trainer.fit(TinyLM(), torch.utils.data.DataLoader(ListDataset(examples), batch_size=2))
    assert trainer.strategy.ledger.tokens == 8 * 6


def fit_trainer(accumulate: int, epochs: int) -> Any:
    """A one-device Trainer of the exact strategy, without logger, checkpoints or bars."""
    from helpers import make_trainer

    return make_trainer(strategy=AccumulationStrategy(), accumulate_grad_batches=accumulate, max_epochs=epochs)
