"""The LitGPT recipe end to end, on a tiny local model: LitGPT's ``finetune_full``, ``finetune_lora`` and ``pretrain``,
patched with ``examples/litgpt/*.patch``, run through the ``litgpt`` command on 1 and on 2 processes (CPU, gloo), and
the splits' agreement printed beside plain LitGPT's. No download: it writes a two-layer float64 checkpoint and data.

    python examples/litgpt/recipe.py                   # all three scripts (13 runs; a few minutes on 2 cores)
    python examples/litgpt/recipe.py --scripts full    # one of them
    python examples/litgpt/recipe.py --out runs/       # keep the runs (checkpoints, logs) there
    python examples/litgpt/recipe.py --prepare DIR     # only write the checkpoint and data, print the litgpt lines

It needs litgpt 0.5.13 (``pip install ".[litgpt]"``) and ``git`` (to apply the patches). What it does:

* :func:`patched_litgpt` copies the installed ``litgpt`` package into a folder and ``git apply``-s the patches there,
  as you patch a LitGPT checkout; that folder goes first on ``PYTHONPATH`` (``plain=True``: the same copy unpatched).
* :func:`write_checkpoint` writes ``model_config.yaml``, ``lit_model.pth`` (float64) and a word-level tokenizer;
  :func:`write_data` LitGPT's JSON data (``train.json``, ``val.json``), :func:`write_token_rows` rows of token ids for
  ``pretrain`` (read by ``tiny_data.TokenRows``, since LitGPT's pretraining data modules need litdata). The train
  set is one global batch, so every update reads all of it whatever the sampler's order: the splits (m, A, D) differ
  only in how the batch is cut, and plain LitGPT with the whole batch in one micro-batch on one device, (8, 1, 1), is
  the reference.
* :func:`run_litgpt` runs ``python -m litgpt_float64 <command> ...``: the ``litgpt`` command's own ``main()`` in a
  process whose default dtype is float64 (Fabric's ``"64-true"`` returns the model's outputs in the default dtype,
  float32, and the sharded strategy refuses it: ``--precision 32-true`` with float64 as the default dtype builds the
  model, its loss and its gradients in float64). Fabric's launcher starts the other processes with the same command.
* :func:`final_weights` reads ``final/lit_model.pth`` with LitGPT's ``load_checkpoint``.
* :func:`prepare` (``--prepare DIR``) writes the checkpoint, the data and ``tiny_data.py`` into ``DIR`` and returns the
  ``litgpt`` lines to run with a patched copy of litgpt in ``DIR/litgpt`` (docs/howto.md, "Run it yourself").

``tests/project/test_litgpt_cli.py`` uses these helpers. A run on several processes ends with a barrier and
``destroy_process_group()`` (the patches add them at the end of ``setup()``): see docs/troubleshooting.md, "A crash
after a finished run".
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

PATCHES = Path(__file__).resolve().parent
ROOT = PATCHES.parents[1]  # the repository: its lightning_accum
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
    shutil.rmtree(into / "litgpt", ignore_errors=True)
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
    AdamW updates of one global batch of 8 rows (``--train.max_tokens``), LitGPT's clipping at 0.1 (below the
    gradient's norm, 0.46 at the start, so that it acts) and warm-up over 2 updates, the final validation.
    ``torch.compile`` is LitGPT's; the tests run it with ``TORCHDYNAMO_DISABLE=1``."""
    args = ["pretrain", str(CONFIG["name"]), "--model_config", json.dumps(CONFIG)]
    args += ["--initial_checkpoint_dir", str(checkpoint), "--tokenizer_dir", str(checkpoint)]
    args += ["--out_dir", str(out), "--devices", str(devices), "--precision", "32-true"]
    args += ["--data", "tiny_data.TokenRows", "--data.path", str(data)]
    args += ["--train.global_batch_size", str(GLOBAL_BATCH), "--train.micro_batch_size", str(micro_batch_size)]
    args += ["--train.max_tokens", str(UPDATES * GLOBAL_BATCH * PRETRAIN_LENGTH)]
    args += ["--train.max_seq_length", str(PRETRAIN_LENGTH), "--train.lr_warmup_steps", "2"]
    args += ["--train.max_norm", "0.1", "--train.min_lr", "0.002", "--train.save_interval", "1000"]
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


#: The variables of a process a launcher started (and pytest's): a run must not inherit them.
LAUNCHED = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR",
            "MASTER_PORT", "TORCHELASTIC", "PYTEST")  # fmt: skip


def run_litgpt(
    litgpt_root: Path, args: list[str], cwd: Path, timeout: float = 540, env: dict[str, str] | None = None
) -> tuple[str, float]:
    """``python -m litgpt_float64 <args>`` with ``litgpt_root`` (the patched copy) first on ``PYTHONPATH``, then this
    repository (the package under test), on the CPU (``CUDA_VISIBLE_DEVICES=""``: LitGPT's scripts take no
    accelerator argument) and without the distributed variables of a launched process (Fabric's launcher sets its
    own). Returns the output and the seconds it took; raises with the output's tail if the command fails."""
    path = [str(litgpt_root), str(ROOT), os.environ.get("PYTHONPATH", "")]
    environment = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHED)}
    environment.update(env or {}, PYTHONPATH=os.pathsep.join(p for p in path if p), CUDA_VISIBLE_DEVICES="")
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


class Runs:
    """The ``litgpt`` runs of one folder, each run once: the checkpoint, the data and the two litgpt copies (patched,
    plain) written on construction."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.patched = patched_litgpt(root / "patched")
        self.plain = patched_litgpt(root / "plain", plain=True)
        self.checkpoint = write_checkpoint(root / "checkpoint")
        self.data = write_data(root / "data")
        self.rows = write_token_rows(root / "rows")
        self.done: dict[str, tuple[Path, str, float]] = {}

    def run(
        self, command: str, devices: int, m: int, plain: bool = False, extra: tuple[str, ...] = (), tag: str = ""
    ) -> tuple[Path, str]:
        """Run ``litgpt <command>`` on ``devices`` processes with micro-batches of ``m`` (A = 8 / (m · devices)), or
        return the run already made; returns its output folder and what it printed."""
        name = f"{command}-D{devices}-m{m}-{'plain' if plain else 'patched'}{tag}"
        if name not in self.done:
            out = self.root / name
            if command == "pretrain":
                args = pretrain_args(self.checkpoint, self.rows, out, devices, m)
            else:
                args = finetune_args(command, self.checkpoint, self.data, out, devices, m)
            env = {"TORCHDYNAMO_DISABLE": "1"}  # pretrain.py's torch.compile, eager here (CPU)
            output, seconds = run_litgpt(self.plain if plain else self.patched, args + list(extra), self.root, env=env)
            print(f"  {name}: {seconds:.1f} s", flush=True)
            self.done[name] = (out, output, seconds)
        out, output, _ = self.done[name]
        return out, output

    def weights(self, command: str, devices: int, m: int, **kwargs: Any) -> dict[str, torch.Tensor]:
        out, _ = self.run(command, devices, m, **kwargs)
        return final_weights(out, lora=command == "finetune_lora")


def report(runs: Runs, command: str) -> list[str]:
    """Run ``command`` patched on 1 and 2 processes and plain (LitGPT's own script) at (8, 1, 1) and (1, 8, 1); the
    lines of their agreement (the largest difference between final weights)."""

    def split(m: int, devices: int) -> str:
        return f"({m}, {GLOBAL_BATCH // (devices * m)}, {devices})"

    reference = runs.weights(command, 1, 8, plain=True)
    one = runs.weights(command, 1, 1)
    two = runs.weights(command, 2, 2)
    lines = [f"{command}: largest difference between final weights (m, A, D)"]
    lines.append(f"  patched {split(1, 1)} vs plain LitGPT {split(8, 1)}: {distance(one, reference):.1e}")
    if command == "finetune_lora":
        other = runs.weights(command, 2, 4)
        lines.append(f"  patched {split(2, 2)} vs patched {split(4, 2)}: {distance(two, other):.1e}")
        lines.append(
            f"  patched on 1 process vs on 2, LoRA weights: {distance(one, two, prefix='lora.'):.1e} (LitGPT draws"
            " LoRA's A differently on 1 process and on several: compare splits at one process count)"
        )
    else:
        lines.append(f"  patched {split(2, 2)} vs plain LitGPT {split(8, 1)}: {distance(two, reference):.1e}")
        lines.append(f"  patched {split(1, 1)} vs patched {split(2, 2)}: {distance(one, two):.1e}")
    plain = runs.weights(command, 1, 1, plain=True)
    lines.append(f"  plain LitGPT {split(1, 1)} vs plain LitGPT {split(8, 1)}: {distance(plain, reference):.1e}")
    return lines


COMMANDS = {"full": "finetune_full", "lora": "finetune_lora", "pretrain": "pretrain"}


def prepare(directory: Path, scripts: list[str], devices: int = 2) -> list[str]:
    """Write the tiny checkpoint (``DIR/checkpoint``), LitGPT's JSON data (``DIR/data``), the token rows
    (``DIR/rows``) and ``DIR/tiny_data.py``; return one shell line per script: the ``litgpt`` command on ``devices``
    CPU processes, (m, A, D) = (2, 8 / (2 · devices), devices), with ``DIR`` first on ``PYTHONPATH`` so that
    ``DIR/litgpt`` (the patched copy) and ``tiny_data`` are imported. Float32 here (the tests run float64)."""
    import shlex

    directory = directory.resolve()
    checkpoint = write_checkpoint(directory / "checkpoint")
    data, rows = write_data(directory / "data"), write_token_rows(directory / "rows")
    (directory / "tiny_data.py").write_text(TOKEN_ROWS)
    lines = []
    for script in scripts:
        command, out = COMMANDS[script], directory / "out" / script
        if command == "pretrain":
            args = pretrain_args(checkpoint, rows, out, devices, 2)
        else:
            args = finetune_args(command, checkpoint, data, out, devices, 2)
        environment = f"CUDA_VISIBLE_DEVICES= TORCHDYNAMO_DISABLE=1 PYTHONPATH={shlex.quote(str(directory))}"
        lines.append(f"{environment} litgpt {shlex.join(args)}")
    return lines


def _parser() -> Any:
    import argparse
    import textwrap

    summary, usage = __doc__.split("\n\n")[:2]
    return argparse.ArgumentParser(
        description=textwrap.fill(" ".join(summary.replace("``", "").split()), 100) + "\n\n" + textwrap.dedent(usage),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def main(argv: list[str] | None = None) -> None:
    import tempfile

    parser = _parser()
    parser.add_argument(
        "--scripts", nargs="+", choices=["full", "lora", "pretrain"], default=["full", "lora", "pretrain"]
    )
    parser.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    parser.add_argument(
        "--prepare",
        type=Path,
        default=None,
        metavar="DIR",
        help="run nothing: write the checkpoint and data into DIR and print the litgpt lines to run with a patched"
        " copy of litgpt in DIR/litgpt",
    )
    args = parser.parse_args(argv)
    if args.prepare is not None:
        lines = prepare(args.prepare, args.scripts)
        patched = args.prepare / "litgpt"
        if not (patched / "__init__.py").is_file():
            print(f"# first copy the installed litgpt to {patched} and git apply the patches there (docs/howto.md)")
        print("\n".join(lines))
        return
    commands = COMMANDS
    with tempfile.TemporaryDirectory() as temporary:
        root = args.out if args.out is not None else Path(temporary)
        root.mkdir(parents=True, exist_ok=True)
        runs = Runs(root)
        print(f"litgpt runs in {root} (python -m litgpt_float64 <command> ..., PYTHONPATH={runs.patched}:{ROOT})")
        lines: list[str] = []
        for script in args.scripts:
            lines += report(runs, commands[script])
        print("\n".join(lines))


if __name__ == "__main__":
    main()
