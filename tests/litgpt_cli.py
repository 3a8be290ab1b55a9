"""LitGPT's scripts as their users run them: the ``litgpt`` command's ``main()`` (``python -m litgpt finetune_lora
CHECKPOINT --devices 2 ...``) with the recipe's patches applied to a copy of the installed litgpt package, on a tiny
checkpoint and data written here (no download). The helpers of ``tests/test_litgpt_cli.py`` and of
``examples/litgpt/recipe.py``.

* :func:`patched_litgpt` copies the installed ``litgpt`` package into a folder and ``git apply``-s
  ``examples/litgpt/*.patch`` there, as a user patches a LitGPT checkout; that folder goes first on ``PYTHONPATH``.
  ``plain=True`` gives the same folder without the patches (LitGPT's own scripts).
* :func:`write_checkpoint` writes a two-layer LitGPT checkpoint (``model_config.yaml``, ``lit_model.pth`` in
  float64, a word-level ``tokenizer.json``) and :func:`write_data` LitGPT's JSON data (``train.json``, ``val.json``):
  the train set is one global batch, so every update reads all of it whatever the sampler's order (one process reads
  LitGPT's shuffled order, several read Fabric's ``DistributedSampler``'s).
* :func:`run_litgpt` runs ``python -m litgpt_float64 <command> ...``: the ``litgpt`` command's own ``main()`` in a
  process whose default dtype is float64 (Fabric's ``"64-true"`` returns the model's outputs in the default dtype,
  float32, and the sharded strategy refuses it: ``--precision 32-true`` with float64 as the default dtype builds
  the model, its loss and its gradients in float64). Fabric's launcher starts the other processes with the same
  command.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
PATCHES = ROOT / "examples" / "litgpt"
SCRIPTS = {"lora": "finetune/lora.py", "full": "finetune/full.py", "pretrain": "pretrain.py"}
VOCAB = 64
GLOBAL_BATCH = 8
UPDATES = 4
PRETRAIN_LENGTH = 16

FLOAT64_MAIN = '''"""The `litgpt` command (`litgpt.__main__.main`) with float64 as torch's default dtype."""

import torch

torch.set_default_dtype(torch.float64)

from litgpt.__main__ import main  # noqa: E402

if __name__ == "__main__":
    main()
'''


TOKEN_ROWS = '''"""`TokenRows`: a LitGPT data module for `litgpt pretrain` over rows of token ids saved with
`torch.save` (an int64 tensor of shape (rows, max_seq_length + 1) in `train.pt` and `val.pt`), read in order.
LitGPT's own pretraining data modules read litdata's optimized datasets; this one needs nothing else (`--data
tiny_data.TokenRows --data.path DIR`)."""

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from litgpt.data import DataModule


@dataclass
class TokenRows(DataModule):
    path: Path = Path("data")
    batch_size: int = field(init=False, repr=False, default=1)
    seq_length: int = field(init=False, repr=False, default=2048)

    def connect(self, tokenizer=None, batch_size: int = 1, max_seq_length: int | None = None) -> None:
        self.batch_size = batch_size
        self.seq_length = max_seq_length + 1  # the inputs and the targets shifted by one

    def _loader(self, name: str) -> DataLoader:
        rows = torch.load(Path(self.path) / f"{name}.pt")[:, : self.seq_length]
        return DataLoader(list(rows), batch_size=self.batch_size, shuffle=False)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")
'''


def patched_litgpt(into: Path, plain: bool = False) -> Path:
    """A copy of the installed ``litgpt`` package in ``into/litgpt`` with the recipe's patches applied (``git
    apply``, as in a LitGPT checkout; fails if a patch no longer applies), and ``into/litgpt_float64.py``. Returns
    ``into`` (the folder to put first on ``PYTHONPATH``)."""
    import litgpt

    into.mkdir(parents=True, exist_ok=True)
    shutil.copytree(Path(litgpt.__file__).parent, into / "litgpt", ignore=shutil.ignore_patterns("__pycache__"))
    if not plain:
        for script in SCRIPTS:
            patch = PATCHES / f"{script}.patch"
            if patch.exists():
                subprocess.run(["git", "apply", str(patch)], cwd=into, check=True, capture_output=True)
    (into / "litgpt_float64.py").write_text(FLOAT64_MAIN)
    (into / "tiny_data.py").write_text(TOKEN_ROWS)
    return into


#: The checkpoint's model: two layers, no biases (a key bias gets a gradient of rounding noise only, which AdamW
#: scales up to its rate), float64.
CONFIG = dict(
    name="tiny-float64", block_size=64, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=16,
    bias=False,
)  # fmt: skip


def model_config() -> Any:
    from litgpt.config import Config

    return Config(**CONFIG)


def write_checkpoint(directory: Path) -> Path:
    """A two-layer LitGPT checkpoint in float64 (seeded), with a word-level tokenizer over ``t0`` … ``t63``
    (whitespace-split; ``t1`` ends a response)."""
    from litgpt.model import GPT
    from litgpt.utils import save_config
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    config = model_config()
    save_config(config, directory)
    torch.manual_seed(0)
    model = GPT(config).to(torch.float64)
    torch.save(model.state_dict(), directory / "lit_model.pth")
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    special = {"bos_token": None, "eos_token": "t1", "tokenizer_class": "PreTrainedTokenizerFast"}
    (directory / "tokenizer_config.json").write_text(json.dumps(special))
    return directory


def _words(generator: torch.Generator, low: int, high: int) -> str:
    count = int(torch.randint(low, high + 1, (), generator=generator))
    return " ".join(f"t{int(i)}" for i in torch.randint(2, VOCAB, (count,), generator=generator))


def write_data(directory: Path, train: int = GLOBAL_BATCH, val: int = 4) -> Path:
    """LitGPT's JSON data (``--data JSON --data.json_path DIR``): instructions and responses of varying length."""
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(3)
    for name, count in (("train", train), ("val", val)):
        rows = [{"instruction": _words(generator, 2, 12), "output": _words(generator, 1, 14)} for _ in range(count)]
        (directory / f"{name}.json").write_text(json.dumps(rows, indent=1))
    return directory


def write_token_rows(directory: Path, train: int = GLOBAL_BATCH, val: int = 4) -> Path:
    """Rows of ``PRETRAIN_LENGTH + 1`` token ids for ``pretrain`` (``tiny_data.TokenRows``)."""
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(5)
    for name, count in (("train", train), ("val", val)):
        torch.save(torch.randint(0, VOCAB, (count, PRETRAIN_LENGTH + 1), generator=generator), directory / f"{name}.pt")
    return directory


def pretrain_args(checkpoint: Path, data: Path, out: Path, devices: int, micro_batch_size: int) -> list[str]:
    """``litgpt pretrain`` arguments: continued pretraining from ``checkpoint`` (``--initial_checkpoint_dir``), four
    AdamW updates of one global batch of 8 rows (``--train.max_tokens``), LitGPT's clipping at 1.0 and warm-up over
    2 updates, the final validation. ``torch.compile`` is LitGPT's; the tests run it with ``TORCHDYNAMO_DISABLE=1``."""
    args = ["pretrain", str(CONFIG["name"]), "--model_config", json.dumps(CONFIG)]
    args += ["--initial_checkpoint_dir", str(checkpoint), "--tokenizer_dir", str(checkpoint)]
    args += ["--out_dir", str(out), "--devices", str(devices), "--precision", "32-true"]
    args += ["--data", "tiny_data.TokenRows", "--data.path", str(data)]
    args += ["--train.global_batch_size", str(GLOBAL_BATCH), "--train.micro_batch_size", str(micro_batch_size)]
    args += ["--train.max_tokens", str(UPDATES * GLOBAL_BATCH * PRETRAIN_LENGTH)]
    args += ["--train.max_seq_length", str(PRETRAIN_LENGTH), "--train.lr_warmup_steps", "2"]
    args += ["--train.max_norm", "1.0", "--train.min_lr", "0.002", "--train.save_interval", "1000"]
    args += ["--train.log_interval", "1", "--eval.interval", "1000", "--eval.final_validation", "true"]
    args += ["--optimizer", json.dumps({"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.02}})]
    args += ["--logger_name", "csv"]
    return args


def finetune_args(
    command: str, checkpoint: Path, data: Path, out: Path, devices: int, micro_batch_size: int, plain: bool = False
) -> list[str]:
    """``litgpt finetune_lora|finetune_full`` arguments: four AdamW updates of one global batch (8 examples; LitGPT's
    warm-up over 2 of them, the first at a rate of 0), no dropout, the final validation, no interim evaluation."""
    args = [command, str(checkpoint), "--out_dir", str(out), "--devices", str(devices), "--precision", "32-true"]
    args += ["--data", "JSON", "--data.json_path", str(data), "--data.mask_prompt", "true"]
    args += ["--data.prompt_style", "falcon", "--data.num_workers", "0"]
    args += ["--train.global_batch_size", str(GLOBAL_BATCH), "--train.micro_batch_size", str(micro_batch_size)]
    args += ["--train.max_steps", str(UPDATES), "--train.epochs", "1000", "--train.lr_warmup_steps", "2"]
    args += ["--train.save_interval", "1000", "--train.log_interval", "1"]
    args += ["--eval.interval", "1000", "--eval.initial_validation", "false", "--eval.final_validation", "true"]
    args += ["--optimizer", json.dumps({"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.02}})]
    args += ["--logger_name", "csv"]
    if command == "finetune_lora":
        args += ["--lora_r", "2", "--lora_alpha", "4", "--lora_dropout", "0"]
    return args


def run_litgpt(
    litgpt_root: Path, args: list[str], cwd: Path, timeout: float = 540, env: dict[str, str] | None = None
) -> tuple[str, float]:
    """``python -m litgpt_float64 <args>`` with ``litgpt_root`` (the patched copy) first on ``PYTHONPATH``, then this
    repository (the package under test). Returns the output and the seconds it took; raises with the output's tail
    if the command fails."""
    path = [str(litgpt_root), str(ROOT), os.environ.get("PYTHONPATH", "")]
    environment = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "litgpt_float64", *args],
        cwd=cwd,
        env=environment,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    seconds = time.perf_counter() - start
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"litgpt {' '.join(args[:2])} failed ({done.returncode}):\n{output[-6000:]}")
    return output, seconds


def final_weights(out: Path, lora: bool = False) -> dict[str, torch.Tensor]:
    """The run's final checkpoint read by LitGPT's own loader: ``final/lit_model.pth`` (for LoRA the weights
    ``merge_lora`` merged) loaded into a LitGPT ``GPT`` with ``litgpt.utils.load_checkpoint`` on one device; for LoRA
    also the LoRA weights of ``final/lit_model.pth.lora`` (``lora.*`` keys)."""
    import lightning as L
    from litgpt.config import Config
    from litgpt.model import GPT
    from litgpt.utils import load_checkpoint

    final = out / "final"
    config = Config.from_file(final / "model_config.yaml")
    fabric = L.Fabric(devices=1, accelerator="cpu", precision="32-true")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = GPT(config)
    finally:
        torch.set_default_dtype(previous)
    load_checkpoint(fabric, model, final / "lit_model.pth")
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if lora:
        adapter = torch.load(final / "lit_model.pth.lora", weights_only=True)
        weights.update({f"lora.{k}": v for k, v in adapter["model"].items()})
    return weights


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], prefix: str = "") -> float:
    """The largest absolute difference over the entries (those starting with ``prefix``) of two weight sets."""
    keys = sorted(k for k in a if k.startswith(prefix))
    assert keys and keys == sorted(k for k in b if k.startswith(prefix)), (keys, sorted(b))
    return max(float((a[k].to(torch.float64) - b[k].to(torch.float64)).abs().max()) for k in keys)


def final_val_loss(output: str) -> float:
    """The ``Final evaluation | val loss: …`` a run printed (three decimals, as LitGPT prints it)."""
    for line in output.splitlines():
        if line.startswith("Final evaluation | val loss:"):
            return float(line.split("val loss:")[1].split("|")[0])
    raise AssertionError(f"no final evaluation in:\n{output[-3000:]}")
