"""Shared by the recipes: a tiny language model and variable-length, padded sequences (padding is not supervised)."""

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
