"""A tiny Hugging Face GPT-2 built from a config (no download) inside a LightningModule, and its data.

Import it after ``pytest.importorskip("transformers")`` (``transformers`` is imported only when a model is built,
so that collecting this file works without it).
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from helpers import fit
from torch import Tensor

from lightning_accum import supervised_tokens

if TYPE_CHECKING:
    import transformers

IGNORE = -100
VOCAB = 256


def tiny_gpt2(seed: int = 0) -> transformers.GPT2LMHeadModel:
    """Two layers, width 16, byte vocabulary, dropout off (so that split invariance is exact)."""
    import transformers

    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=16,
        n_head=2,
        n_positions=32,
        vocab_size=VOCAB,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


def sequences(count: int, seed: int = 0, min_len: int = 3, max_len: int = 12) -> list[dict[str, Tensor]]:
    """Unpadded byte sequences of random lengths; ``labels`` are the ``input_ids`` (the model shifts them)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(1, VOCAB, (rng.randint(min_len, max_len),), generator=gen)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return out


def pad_collate(items: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Right-pad to the longest sequence of the micro-batch: ids and mask with 0, labels with -100."""
    length = max(len(item["input_ids"]) for item in items)
    batch: dict[str, Tensor] = {}
    for key, fill in (("input_ids", 0), ("attention_mask", 0), ("labels", IGNORE)):
        batch[key] = torch.stack(
            [torch.cat([item[key], item[key].new_full((length - len(item[key]),), fill)]) for item in items]
        )
    return batch


class HFCausalLM(L.LightningModule):
    """``training_step`` returns what ``count`` says.

    - ``"helper"``: ``{"loss": out.loss, "num_tokens": supervised_tokens(labels, shift=True)}`` (the shifted count);
    - ``"naive"``: ``{"loss": out.loss, "num_tokens": (labels != -100).sum()}`` (one token too many per sequence);
    - ``"loss"``: ``out.loss`` only;
    - ``"output"``: the ``ModelOutput`` itself;
    - ``"none"``: ``{"loss": out.loss}`` (for ``count_tokens=`` on the strategy).
    """

    def __init__(self, count: str = "helper", lr: float = 0.5, seed: int = 0) -> None:
        super().__init__()
        self.model = tiny_gpt2(seed)
        self.count = count
        self.lr = lr

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Any:
        out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
        if self.count == "helper":
            return {"loss": out.loss, "num_tokens": supervised_tokens(batch["labels"], shift=True)}
        if self.count == "naive":
            return {"loss": out.loss, "num_tokens": (batch["labels"] != IGNORE).sum()}
        if self.count == "loss":
            return out.loss
        if self.count == "output":
            return out
        return {"loss": out.loss}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def fit_hf(
    model: L.LightningModule,
    data: list[dict[str, Tensor]],
    batch_size: int,
    accumulate: int,
    strategy: Any = "accum",
    callbacks: list[L.Callback] | None = None,
    **trainer_kwargs: Any,
) -> L.Trainer:
    """One epoch of ``Trainer.fit`` over ``data`` in order, micro-batches padded to their own longest sequence."""
    return fit(model, data, batch_size, accumulate, strategy, callbacks, collate_fn=pad_collate, **trainer_kwargs)
