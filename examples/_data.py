"""Shared by the recipes: a tiny language model and variable-length, padded sequences (padding is not supervised):
random tokens (:class:`RandomSequences`), or a pattern the model can learn (:class:`CountingSequences`)."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset

IGNORE_INDEX = -100


class RandomSequences(Dataset):
    """``count`` sequences of 1..``seq_len`` supervised tokens, right-padded to ``seq_len`` (seeded)."""

    def __init__(self, count: int = 256, seq_len: int = 16, vocab: int = 64, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(0, vocab, (count, seq_len), generator=generator)
        lengths = torch.randint(1, seq_len + 1, (count,), generator=generator)
        self.labels = self.input_ids.roll(-1, dims=1)  # predict the next token
        self.labels[torch.arange(seq_len) >= lengths[:, None]] = IGNORE_INDEX

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {"input_ids": self.input_ids[index], "labels": self.labels[index]}

    def supervised_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())


class CountingSequences(RandomSequences):
    """Like :class:`RandomSequences`, but each sequence counts up from a random token (modulo ``vocab``) with 10 % of
    its tokens replaced by random ones: a next-token rule the model can learn, so the loss falls well below
    ``log(vocab)``."""

    def __init__(self, count: int = 256, seq_len: int = 16, vocab: int = 64, seed: int = 0) -> None:
        super().__init__(count, seq_len, vocab, seed)
        generator = torch.Generator().manual_seed(seed + 10**6)
        start = torch.randint(0, vocab, (count, 1), generator=generator)
        counting = (start + torch.arange(seq_len + 1)) % vocab
        noise = torch.rand(count, seq_len + 1, generator=generator) < 0.1
        counting[noise] = torch.randint(0, vocab, (int(noise.sum()),), generator=generator)
        supervised = self.labels != IGNORE_INDEX  # the lengths drawn by RandomSequences
        self.input_ids = counting[:, :-1]
        self.labels = counting[:, 1:].masked_fill(~supervised, IGNORE_INDEX)


class TinyLM(L.LightningModule):
    """Embedding, one hidden layer, a head; returns the micro-batch's mean loss and its supervised tokens."""

    def __init__(self, vocab: int = 64, width: int = 32, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, width)
        self.hidden = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.hidden(self.embed(input_ids))))

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        logits = self(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX)
        return {"loss": loss, "num_tokens": (batch["labels"] != IGNORE_INDEX).sum()}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])
