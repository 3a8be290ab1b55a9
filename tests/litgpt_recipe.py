"""LitGPT's own fine-tuning scripts with the recipe's patch applied (``examples/litgpt/*.patch``), run at a reduced
size: the helpers of ``tests/project/test_litgpt_recipe.py`` and, as a script, one run in its own processes.

``python tests/litgpt_recipe.py --script lora --patched DIR --checkpoint DIR --devices 2 --micro-batch-size 2
--out DIR`` imports the patched ``litgpt/finetune/lora.py`` (or ``full.py``) from ``--patched`` and calls its own
``fit`` (LitGPT's loop, as patched) and ``validate`` on a float64 LitGPT model, in a Fabric built as the patched
``setup`` builds it (two processes: Fabric's launcher runs this script again in each). It writes the trained
parameters, the ledger and the validation losses (the patched ``validate``, and LitGPT's own mean of batch means
computed beside it) to ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

ROOT = Path(__file__).resolve().parents[1]
PATCHES = ROOT / "examples" / "litgpt"
IGNORE = -100
VOCAB = 64
LENGTH = 24
GLOBAL_BATCH = 8
UPDATES = 4
WARMUP = 2
LR = 2e-2


def litgpt_script(script: str) -> Path:
    """The installed ``litgpt/finetune/<script>.py``."""
    import litgpt

    return Path(litgpt.__file__).parent / "finetune" / f"{script}.py"


def apply_patch(script: str, into: Path) -> Path:
    """Copy the installed LitGPT script to ``into/litgpt/finetune/`` and apply the recipe's patch there, the way a
    user applies it in a LitGPT checkout (``git apply examples/litgpt/<script>.patch``). Returns the patched file."""
    target = into / "litgpt" / "finetune" / f"{script}.py"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(litgpt_script(script), target)
    subprocess.run(["git", "apply", str(PATCHES / f"{script}.patch")], cwd=into, check=True, capture_output=True)
    return target


def load_script(path: Path, name: str) -> ModuleType:
    """Import a (patched) LitGPT script from its file."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def model_config(script: str) -> Any:
    """A two-layer LitGPT config (LoRA on the query and value projections for ``lora``)."""
    common = dict(
        name="tiny", block_size=LENGTH, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=16
    )
    if script == "lora":
        from litgpt.lora import Config

        return Config(**common, lora_r=2, lora_alpha=4, lora_query=True, lora_value=True)
    from litgpt.config import Config as BaseConfig

    return BaseConfig(**common)


def build_model(script: str) -> torch.nn.Module:
    """The float64 model, seeded (the same on every rank and in the reference)."""
    torch.manual_seed(0)
    if script == "lora":
        from litgpt.lora import GPT, mark_only_lora_as_trainable

        model = GPT(model_config(script)).to(torch.float64)
        torch.manual_seed(1)
        with torch.no_grad():  # LoRA's B starts at zero; a nonzero B makes the first update reach every LoRA weight
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
        mark_only_lora_as_trainable(model)
        return model
    from litgpt.model import GPT as BaseGPT

    return BaseGPT(model_config(script)).to(torch.float64)


class Instructions(Dataset):
    """Prompt + response sequences of varying length, the prompt masked out of the labels (LitGPT's SFT data), with
    LitGPT's ``token_counts`` (seeded, generated: no download)."""

    def __init__(self, count: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.samples: list[dict[str, Any]] = []
        for _ in range(count):
            length = int(torch.randint(6, LENGTH + 1, (), generator=generator))
            prompt = int(torch.randint(1, length - 2, (), generator=generator))
            input_ids = torch.randint(1, VOCAB, (length,), generator=generator)
            labels = input_ids.clone()
            labels[:prompt] = IGNORE
            counts = {"raw": length - prompt, "raw_plus_prompt_template": length}
            self.samples.append({"input_ids": input_ids, "labels": labels, "token_counts": counts})

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.samples[index]


def train_set() -> Instructions:
    return Instructions(GLOBAL_BATCH * UPDATES, seed=3)


def val_set() -> Instructions:
    return Instructions(10, seed=4)


def loader(dataset: Dataset, batch_size: int) -> DataLoader:
    from litgpt.data.base import get_sft_collate_fn

    return DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=get_sft_collate_fn())


def token_losses(model: torch.nn.Module, samples: list[dict[str, Any]]) -> tuple[Tensor, int]:
    """Σ over the samples' supervised (shifted) tokens of the cross-entropy, and their count: sample by sample."""
    total, tokens = torch.zeros((), dtype=torch.float64), 0
    for sample in samples:
        logits = model(sample["input_ids"][None])[0, :-1]
        labels = sample["labels"][1:]
        total = total + torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")
        tokens += int((labels != IGNORE).sum())
    return total, tokens


def reference(script: str) -> dict[str, Any]:
    """Outside the package, in float64: each update the mean over the group's supervised tokens (sample by sample),
    AdamW and LitGPT's schedule as the script's ``fit`` steps them; then the validation set's token-weighted loss."""
    model = build_model(script)
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=LR)
    scheduler = schedule(script, optimizer)
    samples = train_set().samples
    for update in range(UPDATES):
        total, tokens = token_losses(model, samples[update * GLOBAL_BATCH : (update + 1) * GLOBAL_BATCH])
        last_loss = float(total.detach() / tokens)
        (total / tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    with torch.no_grad():
        total, tokens = token_losses(model, val_set().samples)
    return {"parameters": trainable_vector(model), "val_loss": float(total / tokens), "last_loss": last_loss}


def schedule(script: str, optimizer: torch.optim.Optimizer) -> Any:
    """LitGPT's own warm-up and cosine (``get_lr_scheduler`` of the installed script; the patch leaves it alone):
    the first update at a rate of 0, as LitGPT's warm-up starts there."""
    module = load_script(litgpt_script(script), f"litgpt_{script}")
    return module.get_lr_scheduler(optimizer, warmup_steps=WARMUP, max_steps=UPDATES + WARMUP)


def trainable_vector(model: torch.nn.Module) -> Tensor:
    return torch.cat([p.detach().flatten().to("cpu") for p in model.parameters() if p.requires_grad])


def write_tokenizer(directory: Path) -> None:
    """A word-level tokenizer over the ids (LitGPT's ``Tokenizer`` reads ``tokenizer.json``; ``fit`` builds one)."""
    from tokenizers import Tokenizer, models

    directory.mkdir(parents=True, exist_ok=True)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(directory / "tokenizer.json"))
    config = '{"bos_token": null, "eos_token": null, "tokenizer_class": "PreTrainedTokenizerFast"}'
    (directory / "tokenizer_config.json").write_text(config)


def _run(args: argparse.Namespace) -> None:
    import dataclasses

    import lightning as L
    from litgpt.args import EvalArgs, TrainArgs

    if args.plain:  # LitGPT's own script, unpatched, under Fabric's own strategy
        script = load_script(litgpt_script(args.script), f"litgpt_{args.script}")
    else:
        script = load_script(Path(args.patched) / "litgpt" / "finetune" / f"{args.script}.py", f"patched_{args.script}")
    devices = args.devices
    if args.plain:
        strategy: Any = "auto"
    elif devices > 1:  # as the patched `setup` builds it
        strategy = (
            script.FabricModelParallelAccumulationStrategy(
                parallelize_fn=script.parallelize_fn, data_parallel_size=devices, tensor_parallel_size=1
            )
            if args.script == "lora"
            else "accum_fsdp"
        )
    else:
        strategy = "accum"
    fabric = L.Fabric(devices=devices, strategy=strategy, precision="32-true", accelerator="cpu", loggers=[])
    fabric.launch()
    model = build_model(args.script)
    train = TrainArgs(
        global_batch_size=GLOBAL_BATCH,
        micro_batch_size=args.micro_batch_size,
        max_steps=UPDATES,
        epochs=100,
        log_interval=1,
        save_interval=None,
        lr_warmup_steps=WARMUP,
    )
    evaluation = EvalArgs(interval=10_000, max_iters=100, initial_validation=False, final_validation=False)
    train_loader, val_loader = fabric.setup_dataloaders(
        loader(train_set(), args.micro_batch_size), loader(val_set(), 3)
    )
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR))
    scheduler = schedule(args.script, optimizer)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.script == "lora":
        script.fit(
            fabric=fabric, model=model, optimizer=optimizer, scheduler=scheduler, train_dataloader=train_loader,
            val_dataloader=val_loader, devices=devices, checkpoint_dir=Path(args.checkpoint), out_dir=out,
            train=train, eval=evaluation, data=None,
        )  # fmt: skip
    else:
        state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "iter_num": 0, "step_count": 0}
        script.fit(
            fabric=fabric, state=state, train_dataloader=train_loader, val_dataloader=val_loader, devices=devices,
            resume=False, checkpoint_dir=Path(args.checkpoint), out_dir=out, train=train, eval=evaluation,
            data=None,
        )  # fmt: skip
    val_loss = script.validate(fabric, model, val_loader, dataclasses.replace(evaluation, max_iters=len(val_loader)))
    with torch.no_grad():  # LitGPT's own validate: the mean of each replica's batch means, then the replicas' mean
        means = [
            script.chunked_cross_entropy(model(b["input_ids"])[..., :-1, :], b["labels"][..., 1:], chunk_size=0)
            for b in val_loader
        ]
        plain = fabric.all_reduce(torch.stack(means).mean(), reduce_op="mean")
    full = {name: p.full_tensor() if hasattr(p, "full_tensor") else p for name, p in model.named_parameters()}
    if fabric.global_rank == 0:
        ledger = getattr(fabric.strategy, "ledger", None)  # None under the plain script's strategy
        last = ledger.last_group if ledger is not None else None
        torch.save(
            {
                "parameters": torch.cat([p.detach().flatten().cpu() for p in full.values() if p.requires_grad]),
                "val_loss": float(val_loss),
                "plain_val_loss": float(plain),
                "strategy": type(fabric.strategy).__name__,
                "ledger": None
                if ledger is None
                else {"updates": ledger.updates_applied, "tokens": ledger.tokens, "samples": ledger.samples},
                "last_loss": None if last is None else last.loss,
            },
            out / "result.pt",
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--script", choices=["lora", "full"], required=True)
    parser.add_argument("--patched", default="", help="the folder holding the patched litgpt/finetune/")
    parser.add_argument("--plain", action="store_true", help="LitGPT's own script, unpatched, Fabric's strategy")
    parser.add_argument("--checkpoint", required=True, help="the folder holding the tokenizer")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    _run(args)


if __name__ == "__main__":
    main()
