"""A LitGPT model trained exactly in a Fabric loop written the way LitGPT's ``finetune/full.py`` writes it.

The model is LitGPT's ``GPT`` built from a ``Config`` (no download), the loss LitGPT's own ``chunked_cross_entropy``
over the shifted targets, and the loop LitGPT's: ``is_accumulating``, ``fabric.no_backward_sync``, ``fabric.backward``,
``optimizer.step()``. These lines differ from LitGPT's (marked ``# lightning_accum``):

* the strategy: ``L.Fabric(strategy="accum")`` or ``"accum_ddp"`` instead of ``"auto"`` / ``"ddp"``;
* the backward: ``fabric.backward(fabric.strategy.accumulate(loss, num_tokens=supervised_tokens(targets, shift=True)))``
  instead of ``fabric.backward(loss / gradient_accumulation_iters)`` — the micro-batch weighted by its supervised
  tokens, not by ``1 / A``: the update is the mean over the group's tokens on every replica, whatever the split;
* the close: ``record = fabric.strategy.close_group(optimizer)`` right before ``optimizer.step()``, and the scheduler
  stepped only when ``record.applied`` (LitGPT steps it on every attempt, a skipped fp16 update included);
* the counts: ``fabric.strategy.ledger.tokens`` (supervised tokens, exact over the replicas) instead of
  ``iter_num × micro_batch_size × max_seq_length``, and :func:`~lightning_accum.log_on_axis` to log on it.

Validation weighs every batch by its tokens and adds the sums over the replicas once (LitGPT averages batch means).

Run it as ``python examples/litgpt_fabric.py`` (one device) or with ``--devices 2`` (two processes, spawned); it
prints m, A, D and the effective batch first. ``pip install ".[litgpt]"`` installs litgpt with pins that
agree with the ``[hf]`` extra.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from litgpt.config import Config
from litgpt.model import GPT
from litgpt.utils import chunked_cross_entropy
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

import lightning_accum
from lightning_accum import log_on_axis, supervised_tokens

IGNORE_INDEX = -100
VOCAB = 128


class Instructions(Dataset):
    """Prompt + response sequences, the prompt masked out of the targets (as LitGPT's SFT data masks it), padded to
    ``length``: the supervised tokens of a sample range from a few to most of it (seeded, generated: no download)."""

    def __init__(self, count: int, length: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(1, VOCAB, (count, length), generator=generator)
        self.labels = self.input_ids.clone()
        prompt = torch.randint(1, length - 2, (count,), generator=generator)
        end = torch.minimum(prompt + torch.randint(2, length, (count,), generator=generator), torch.tensor(length))
        positions = torch.arange(length)
        self.labels[(positions < prompt[:, None]) | (positions >= end[:, None])] = IGNORE_INDEX

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {"input_ids": self.input_ids[index], "labels": self.labels[index]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--micro-batch-size", type=int, default=4, help="m: sequences per micro-batch per replica")
    parser.add_argument("--accumulate", type=int, default=4, help="A: micro-batches per update")
    parser.add_argument("--devices", type=int, default=1, help="D: processes (data-parallel replicas)")
    parser.add_argument("--updates", type=int, default=8, help="optimizer updates")
    parser.add_argument("--length", type=int, default=32, help="sequence length")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32", help="parameter dtype")
    parser.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate")
    parser.add_argument("--out", default="runs/litgpt_fabric", help="where the result and the logs go")
    parser.add_argument("--plain", action="store_true", help="LitGPT's own lines: loss / A, Fabric's own strategy")
    return parser.parse_args(argv)


def validate(fabric: L.Fabric, model: GPT, loader: DataLoader) -> float:
    """The validation loss weighted by its supervised tokens over every replica (LitGPT: a mean of batch means)."""
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=fabric.device)  # Σ tokens × loss, Σ tokens
    with torch.no_grad():
        for batch in loader:
            input_ids, targets = batch["input_ids"], batch["labels"]
            logits = model(input_ids)
            loss = chunked_cross_entropy(logits[..., :-1, :], targets[..., 1:], chunk_size=0)
            tokens = supervised_tokens(targets, shift=True)
            sums += torch.stack([loss.double() * tokens, tokens.double()])
    model.train()
    total = fabric.all_reduce(sums, reduce_op="sum")  # one collective for the whole set
    return float(total[0] / total[1])


def fit(fabric: L.Fabric, args: argparse.Namespace) -> dict[str, Any]:
    m, accumulate, devices = args.micro_batch_size, args.accumulate, fabric.world_size
    fabric.print(
        f"m = {m}, A = {accumulate}, D = {devices}: {m} × {accumulate} × {devices} = {m * accumulate * devices}"
        f" sequences per update, {args.updates} updates"
    )
    fabric.seed_everything(0)
    config = Config(n_layer=2, n_head=2, n_embd=32, block_size=args.length, vocab_size=VOCAB, padded_vocab_size=VOCAB)
    model = GPT(config).to(getattr(torch, args.dtype))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: 1.0 / (1.0 + 0.1 * update))
    model, optimizer = fabric.setup(model, optimizer)
    per_update = m * accumulate * devices
    # Unshuffled: the distributed sampler strides, so the replicas of one update read the one-device update's examples.
    train = DataLoader(Instructions(per_update * args.updates, args.length, seed=1), batch_size=m)
    val = DataLoader(Instructions(24, args.length, seed=2), batch_size=4)  # 24: an even share for 1, 2, 3, 4 replicas
    train, val = fabric.setup_dataloaders(train, val)

    state = {"iter_num": 0, "step_count": 0}
    start = time.perf_counter()
    losses = []
    for batch in train:
        state["iter_num"] += 1
        input_ids, targets = batch["input_ids"], batch["labels"]
        is_accumulating = state["iter_num"] % accumulate != 0
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            logits = model(input_ids)
            # shift the targets such that output n predicts token n+1
            loss = chunked_cross_entropy(logits[..., :-1, :], targets[..., 1:])
            if args.plain:  # LitGPT's line: every micro-batch weighs 1 / A
                fabric.backward(loss / accumulate)
            else:  # lightning_accum: weighted by its supervised tokens (the shifted count), not by 1 / A
                fabric.backward(
                    fabric.strategy.accumulate(loss, num_tokens=supervised_tokens(targets, shift=True), batch=batch)
                )
        if not is_accumulating and args.plain:
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            state["step_count"] += 1
        elif not is_accumulating:
            record = fabric.strategy.close_group(optimizer)  # lightning_accum: the exact group mean, then decide
            optimizer.step()
            optimizer.zero_grad()
            if record.applied:  # lightning_accum: the schedule follows applied updates
                scheduler.step()
            state["step_count"] += 1
            losses.append(record.loss)
            log_on_axis(fabric, {"train_loss": record.loss, "lr": optimizer.param_groups[0]["lr"]})  # lightning_accum
    val_loss = validate(fabric, model, val)
    seconds = time.perf_counter() - start
    if args.plain:
        fabric.print(f"{state['step_count']} updates, validation {val_loss:.4f}, {seconds:.1f} s")
        result: dict[str, Any] = {"val_loss": val_loss, "updates": state["step_count"]}
    else:
        log_on_axis(fabric, {"val_loss": val_loss})
        ledger = fabric.strategy.ledger
        fabric.print(
            f"{ledger.updates_applied} updates, {ledger.tokens:,} supervised tokens, last loss {losses[-1]:.4f},"
            f" validation {val_loss:.4f} (perplexity {math.exp(val_loss):.2f}), {seconds:.1f} s"
        )
        result = {"losses": losses, "val_loss": val_loss, "tokens": ledger.tokens, "updates": ledger.updates_applied}
    if fabric.is_global_zero:  # the parameters go to a file: a spawned worker returns only small values
        parameters = torch.cat([p.detach().reshape(-1).double().cpu() for p in model.parameters()])
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "result.json").write_text(json.dumps({**result, "parameters": parameters.tolist()}))
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.plain:
        strategy = "auto" if args.devices == 1 else "ddp_spawn"
    else:
        strategy = "accum" if args.devices == 1 else "accum_ddp_spawn"  # lightning_accum: exact accumulation
    logger = L.fabric.loggers.CSVLogger(args.out, name="csv")
    fabric = L.Fabric(strategy=strategy, devices=args.devices, accelerator="cpu", loggers=logger)
    result: dict[str, Any] = fabric.launch(fit, args)
    return result


if __name__ == "__main__":
    assert lightning_accum.__version__
    main()
