"""A Hugging Face causal LM with exact accumulation: GPT-2 built from a config (nothing is downloaded).

A Hugging Face ``*ForCausalLM`` model shifts the labels inside its loss: ``out.loss`` is the mean over
``(labels[..., 1:] != -100).sum()`` positions, one token per sequence fewer than ``(labels != -100).sum()``.
So the LightningModule returns the model's output as it is, and the strategy counts with the preset
``lightning_accum.causal_lm_tokens`` (the shifted count of ``batch["labels"]``)::

    def training_step(self, batch, batch_idx):
        return self.model(**batch)  # a ModelOutput: its "loss" is the mean over the shifted labels

    strategy = lightning_accum.AccumulationStrategy(count_tokens=lightning_accum.causal_lm_tokens)

The data are byte sequences of varying length cut from the help-topic text every CPython installation
ships (``pydoc_data.topics``); each micro-batch is right-padded to its longest sequence (padding labels are
-100). The same examples are trained with several splits of one effective batch (``m × A`` sequences per
update); ``AccumulationCheck`` checks the first update of each, and their parameters agree at the end.

Run ``python examples/hf_causal_lm.py`` (``--help`` lists the sizes); it needs ``pip install transformers``
(the ``hf`` extra of this package).
"""

from __future__ import annotations

import argparse
import random
from pydoc_data.topics import topics
from typing import Any

import lightning as L
import torch
import transformers
from torch import Tensor
from torch.utils.data import DataLoader

import lightning_accum
from lightning_accum import AccumulationCheck, AccumulationStrategy, causal_lm_tokens

IGNORE_INDEX = -100


def byte_sequences(count: int, max_len: int, seed: int, min_len: int = 8) -> list[dict[str, Tensor]]:
    """``count`` unpadded byte sequences of ``min_len``..``max_len`` bytes; the labels are the input ids."""
    text = "\n\n".join(topics[key] for key in sorted(topics)).encode("utf-8")
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        length = rng.randint(min_len, max_len)
        start = rng.randrange(0, len(text) - length)
        ids = torch.tensor(list(text[start : start + length]), dtype=torch.long)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return out


def pad_collate(items: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Right-pad to the micro-batch's longest sequence: ids and mask with 0, labels with -100 (not supervised)."""
    length = max(len(item["input_ids"]) for item in items)
    batch = {}
    for key, fill in (("input_ids", 0), ("attention_mask", 0), ("labels", IGNORE_INDEX)):
        batch[key] = torch.stack(
            [torch.cat([item[key], item[key].new_full((length - len(item[key]),), fill)]) for item in items]
        )
    return batch


class CausalLM(L.LightningModule):
    """GPT-2 from a config: 2 layers, width 32, byte vocabulary. Dropout is off so the splits compare exactly."""

    def __init__(self, max_len: int, lr: float = 1e-3, seed: int = 0) -> None:
        super().__init__()
        config = transformers.GPT2Config(
            n_layer=2,
            n_embd=32,
            n_head=2,
            n_positions=max_len,
            vocab_size=256,
            bos_token_id=0,
            eos_token_id=0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        torch.manual_seed(seed)
        self.model = transformers.GPT2LMHeadModel(config)
        self.lr = lr

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Any:
        # The ModelOutput is a mapping with "loss"; the strategy's count_tokens gives its weight.
        return self.model(**batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=512, help="training sequences (one epoch)")
    parser.add_argument("--effective-batch", type=int, default=16, help="sequences per update, m × A")
    parser.add_argument("--updates", type=int, default=20, help="updates per run (at most one epoch)")
    parser.add_argument("--max-len", type=int, default=64, help="longest sequence in bytes")
    parser.add_argument("--quiet", action="store_true", help="no progress bars or model summaries")
    args = parser.parse_args(argv)

    data = byte_sequences(args.sequences, args.max_len, seed=0)
    batch = args.effective_batch
    updates = min(args.updates, args.sequences // batch)
    used = data[: updates * batch]
    tokens = sum(int(causal_lm_tokens(pad_collate([e]))) for e in used)
    splits = [(batch, 1), (max(batch // 4, 1), min(4, batch)), (1, batch)]
    print(f"transformers {transformers.__version__}, lightning_accum {lightning_accum.__version__}")
    print(f"{updates} updates of {batch} sequences; {tokens:,} supervised tokens (the shifted count)")

    result: dict[str, Any] = {"params": {}, "updates": updates, "check": "passed"}
    for m, accumulate in splits:
        name = f"m{m}_a{accumulate}"
        print(f"== {name}: m × A × D = {m} × {accumulate} × 1 = {m * accumulate} sequences per update")
        model = CausalLM(args.max_len)
        check = AccumulationCheck()  # raises AccumulationCheckError if the first update is not exact
        trainer = L.Trainer(
            strategy=AccumulationStrategy(count_tokens=causal_lm_tokens),
            accelerator="cpu",
            devices=1,
            accumulate_grad_batches=accumulate,
            max_steps=updates,
            callbacks=[check],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=not args.quiet,
            enable_model_summary=not args.quiet,
        )
        trainer.fit(model, DataLoader(used, batch_size=m, shuffle=False, collate_fn=pad_collate))  # type: ignore[arg-type]
        ledger = trainer.strategy.ledger  # type: ignore[attr-defined]
        assert check.result is not None
        if not check.result.passed:
            result["check"] = "failed"
        result["params"][name] = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
        print(
            f"   {ledger.updates_applied} updates, {ledger.tokens:,} tokens, last loss {ledger.last_group.loss:.6f},"
            f" check error {check.result.relative_error:.1e}"
        )
    first_name, first = next(iter(result["params"].items()))
    for name, params in result["params"].items():
        difference = float((params - first).norm() / first.norm())
        print(f"parameters of {name} vs {first_name}: relative difference {difference:.1e}")
    return result


if __name__ == "__main__":
    main()
