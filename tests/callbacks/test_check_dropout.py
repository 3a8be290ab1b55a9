"""AccumulationCheck compares like with like whatever reads the dropout: Hugging Face models built from their default
configs (attention dropout on, the default SDPA attention, which passes `dropout_p` from the attention module's own
`training` flag) pass when the step is right, and the check still names the unshifted count, the missing weighting and
the loss divided by A twice on the same models."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor, nn

from lightning_accum import AccumulationCheck, AccumulationCheckError, supervised_tokens

transformers = pytest.importorskip("transformers")
import hf_models as hf  # noqa: E402  (after the importorskip)

A = 4


def gpt2_default() -> Any:
    """GPT-2's own dropouts (0.1 on residuals, embeddings and attention) and its default attention implementation."""
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, n_positions=32, vocab_size=hf.VOCAB)
    assert config.attn_pdrop == 0.1 and config.resid_pdrop == 0.1
    return transformers.GPT2LMHeadModel(config)


def llama_with_attention_dropout() -> Any:
    config = transformers.LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=hf.VOCAB,
        max_position_embeddings=32,
        attention_dropout=0.1,  # as Llama / Mistral fine-tuning configs set it
    )
    return transformers.LlamaForCausalLM(config)


MODELS = {"gpt2": gpt2_default, "llama": llama_with_attention_dropout}


class CausalLM(L.LightningModule):
    """`count`: "helper" (the shifted count, right), "naive" (unshifted), "loss" (no count), "divided" (÷A twice)."""

    def __init__(self, build: str, count: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = MODELS[build]()
        self.count = count

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Any:
        out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
        if self.count == "naive":
            return {"loss": out.loss, "num_tokens": (batch["labels"] != hf.IGNORE).sum()}
        if self.count == "loss":
            return out.loss
        loss = out.loss / self.trainer.accumulate_grad_batches if self.count == "divided" else out.loss
        return {"loss": loss, "num_tokens": supervised_tokens(batch["labels"], shift=True)}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _check(build: str, count: str, batch_size: int = 2) -> AccumulationCheck:
    check = AccumulationCheck()
    hf.fit_hf(CausalLM(build, count), hf.sequences(16, seed=3), batch_size=batch_size, accumulate=A, callbacks=[check])
    return check


@pytest.mark.parametrize("build", sorted(MODELS))
def test_a_right_step_passes_with_the_models_default_dropout(build: str) -> None:
    model = CausalLM(build, "helper")
    dropouts = [m for m in model.modules() if isinstance(m, nn.Dropout) and m.p > 0]
    uses_attention_probability = build == "llama"  # Llama's attention dropout is a float, not a module
    assert dropouts or uses_attention_probability
    check = _check(build, "helper")
    assert check.result is not None and check.result.passed, check.result
    assert check.result.relative_error < 1e-5


@pytest.mark.parametrize("build", sorted(MODELS))
def test_the_check_restores_every_training_flag_and_probability(build: str) -> None:
    check = AccumulationCheck()
    module = CausalLM(build, "helper")
    before = [(name, m.training, getattr(m, "p", None)) for name, m in module.named_modules()]
    trainer = hf.fit_hf(module, hf.sequences(8, seed=4), batch_size=2, accumulate=A, callbacks=[check], max_steps=1)
    assert trainer.state.finished
    after = [(name, m.training, getattr(m, "p", None)) for name, m in module.named_modules()]
    assert after == before


@pytest.mark.parametrize("build", sorted(MODELS))
@pytest.mark.parametrize(
    ("count", "diagnosis"),
    [
        ("naive", r"the token count is off by the shift"),
        ("divided", r"divided by `A` twice|ratio"),
    ],
)
def test_the_mistakes_are_still_caught_on_the_same_models(build: str, count: str, diagnosis: str) -> None:
    with pytest.raises(AccumulationCheckError, match=diagnosis):
        _check(build, count)


@pytest.mark.parametrize("build", sorted(MODELS))
def test_missing_token_weighting_is_still_caught(build: str) -> None:
    with pytest.raises(AccumulationCheckError, match=r"token weighting is missing"):
        _check(build, "loss", batch_size=1)


class RandomStep(hf.HFCausalLM):
    """A step that draws random numbers the check cannot switch off (random augmentation, say)."""

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        noise = 1.0 + torch.rand(())  # drawn by the step itself: no module or probability the check can turn off
        return {"loss": out["loss"] * noise, "num_tokens": out["num_tokens"]}


def test_randomness_the_check_cannot_switch_off_is_said_not_blamed_on_the_step() -> None:
    check = AccumulationCheck()
    with pytest.warns(UserWarning, match=r"the one-batch gradient itself changes with the random seed"):
        hf.fit_hf(RandomStep(), hf.sequences(16, seed=3), batch_size=2, accumulate=A, callbacks=[check])
    assert check.result is not None and check.result.passed  # no false alarm: said, not blamed on the weighting
    assert check.result.relative_error > 1e-2
