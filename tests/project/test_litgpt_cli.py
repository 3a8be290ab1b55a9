"""LitGPT's scripts as their users run them: the ``litgpt`` command's ``main()`` (``finetune_full``,
``finetune_lora``, ``pretrain``) with ``examples/litgpt/*.patch`` applied to a copy of the installed litgpt, on a
two-layer float64 checkpoint and data written here (the helpers of ``examples/litgpt/recipe.py``): LitGPT's own
checkpoint loading, its loop as patched, its final save, on one process and on two sharded processes (FSDP2 over gloo,
Fabric's launcher).

The train set is one global batch of 8 examples, so every update reads all of it: the splits (m, A, D) differ only in
how the batch is cut. Plain LitGPT with the whole batch in one micro-batch on one device, (m, A, D) = (8, 1, 1),
averages over the batch's tokens itself: it is the float64 reference, computed without the package. The final
weights are read from ``final/lit_model.pth`` with LitGPT's ``load_checkpoint``.
"""

from __future__ import annotations

import importlib.util
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("litgpt")

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("litgpt_recipe_cli", ROOT / "examples" / "litgpt" / "recipe.py")
assert _spec is not None and _spec.loader is not None
litgpt_cli = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = litgpt_cli
_spec.loader.exec_module(litgpt_cli)
Runs = litgpt_cli.Runs

# Where the patched runs agree: float64 rounding only (measured 1e-15 to 1e-14; the model has no biases, as a key
# bias gets a gradient of rounding noise only, which AdamW scales up to its rate).
EXACT = 1e-12


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return Runs(tmp_path_factory.mktemp("litgpt-cli"))


def test_full_finetuning_through_the_litgpt_command(runs: Any) -> None:
    # LitGPT's own full.py on two processes crashes in its `load_checkpoint` under a ModelParallelStrategy (its LoRA
    # branch); the patch loads the checkpoint with `fabric.load_raw` and saves single files.
    saving = ("--train.save_interval", "2")
    two, output = runs.run("finetune_full", 2, 2, extra=saving)  # (m, A, D) = (2, 2, 2)
    one, _ = runs.run("finetune_full", 1, 1)  # (1, 8, 1)
    reference, reference_output = runs.run("finetune_full", 1, 8, plain=True)  # (8, 1, 1): plain LitGPT, exact
    assert (two / "final" / "lit_model.pth").is_file()  # a file `litgpt generate` reads, not a sharded folder
    assert (two / "step-000002" / "lit_model.pth").is_file()
    weights = {name: litgpt_cli.final_weights(out) for name, out in (("2", two), ("1", one), ("ref", reference))}
    assert litgpt_cli.distance(weights["2"], weights["1"]) <= EXACT
    assert litgpt_cli.distance(weights["2"], weights["ref"]) <= EXACT
    assert litgpt_cli.distance(weights["1"], weights["ref"]) <= EXACT
    # The validation the run printed (the set's loss over its tokens, every replica) is plain LitGPT's on one batch.
    assert litgpt_cli.final_val_loss(output) == litgpt_cli.final_val_loss(reference_output)


@pytest.mark.parametrize("devices", [2, 1])
def test_full_finetuning_resumes_from_two_processes(runs: Any, devices: int) -> None:
    # LitGPT's own `--resume` of the two-process run's step-2 checkpoint (one file), on 2 processes and on 1 (where
    # A = 4 micro-batches of 2): the resumed run ends where the uninterrupted one does.
    two, _ = runs.run("finetune_full", 2, 2, extra=("--train.save_interval", "2"))
    step = two / "step-000002" / "lit_model.pth"
    resumed, output = runs.run("finetune_full", devices, 2, extra=("--resume", str(step)), tag="-resumed")
    assert "Resuming training from" in output
    whole = litgpt_cli.final_weights(two)
    assert litgpt_cli.distance(litgpt_cli.final_weights(resumed), whole) <= EXACT


def test_lora_finetuning_through_the_litgpt_command(runs: Any) -> None:
    # Two sharded processes, (m, A) = (2, 2) and (4, 1): the LoRA weights (final/lit_model.pth.lora) and the weights
    # LitGPT's merge_lora wrote (final/lit_model.pth) agree. LoRA's A is drawn differently on one process (at
    # construction) and on several (reset_parameters on meta-initialised shards): compare splits at one process count.
    two_by_two = runs.weights("finetune_lora", 2, 2)
    four_by_one = runs.weights("finetune_lora", 2, 4)
    assert any(key.startswith("lora.") for key in two_by_two)
    assert litgpt_cli.distance(two_by_two, four_by_one) <= EXACT


@pytest.mark.slow
def test_lora_on_one_device_and_plain_litgpt_s_split_dependence(runs: Any) -> None:
    # On one device the patched (1, 8, 1) ends where plain LitGPT's (8, 1, 1) does; plain LitGPT's (1, 8, 1) does not.
    patched = runs.weights("finetune_lora", 1, 1)
    reference = runs.weights("finetune_lora", 1, 8, plain=True)
    plain = runs.weights("finetune_lora", 1, 1, plain=True)
    assert litgpt_cli.distance(patched, reference) <= EXACT
    assert litgpt_cli.distance(plain, reference, prefix="lora.") > 1e-4
    # One process and two start from different LoRA weights (LitGPT's initialisation, not the recipe).
    assert litgpt_cli.distance(patched, runs.weights("finetune_lora", 2, 2), prefix="lora.") > 1e-3


def test_plain_full_finetuning_depends_on_the_split(runs: Any) -> None:
    # Plain LitGPT's figure beside the patched one: its (1, 8, 1) does not end where its (8, 1, 1) does.
    reference = runs.weights("finetune_full", 1, 8, plain=True)
    assert litgpt_cli.distance(runs.weights("finetune_full", 1, 1, plain=True), reference) > 1e-4


@pytest.mark.slow
def test_litgpt_generate_reads_the_final_checkpoint(runs: Any) -> None:
    two, _ = runs.run("finetune_full", 2, 2, extra=("--train.save_interval", "2"))
    command = [sys.executable, "-m", "litgpt", "generate", str(two / "final"), "--prompt", "t5 t6 t7"]
    command += ["--max_new_tokens", "4", "--precision", "32-true"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=runs.root)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "t5 t6 t7" in done.stdout


def test_pretraining_through_the_litgpt_command(runs: Any) -> None:
    # `litgpt pretrain --initial_checkpoint_dir` (continued pretraining): LitGPT's FSDP1 replaced by FSDP2, its
    # clipping after the group's close, its rate set per update (LitGPT sets it per micro-batch, so its update's rate
    # depends on A); (m, A, D) = (2, 2, 2) and (1, 8, 1) end where plain LitGPT's (8, 1, 1) does.
    two, output = runs.run("pretrain", 2, 2)
    one, _ = runs.run("pretrain", 1, 1)
    reference, reference_output = runs.run("pretrain", 1, 8, plain=True)
    assert (two / "final" / "lit_model.pth").is_file()
    weights = {name: litgpt_cli.final_weights(out) for name, out in (("2", two), ("1", one), ("ref", reference))}
    assert litgpt_cli.distance(weights["2"], weights["1"]) <= EXACT
    assert litgpt_cli.distance(weights["2"], weights["ref"]) <= EXACT
    assert litgpt_cli.final_val_loss(output) == litgpt_cli.final_val_loss(reference_output)


@pytest.mark.slow
def test_plain_pretraining_depends_on_the_split(runs: Any) -> None:
    reference = runs.weights("pretrain", 1, 8, plain=True)
    assert litgpt_cli.distance(runs.weights("pretrain", 1, 1, plain=True), reference) > 1e-4


@pytest.mark.slow
def test_the_recipe_prints_the_splits_agreement(runs: Any) -> None:
    # `python examples/litgpt/recipe.py --scripts full` prints these lines (from the runs made above).
    lines = litgpt_cli.report(runs, "finetune_full")
    figures = [float(line.rsplit(": ", 1)[1]) for line in lines[1:]]
    assert all(figure <= EXACT for figure in figures[:3]) and figures[3] > 1e-4, lines


def test_the_recipes_help_is_its_whole_description(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        litgpt_cli.main(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "the splits' agreement printed beside plain LitGPT's. No download: it writes a two-layer float64" in shown
    assert "checkpoint and data." in shown and "--prepare DIR" in shown


def _printed_lines(directory: Path, capsys: pytest.CaptureFixture[str]) -> list[list[str]]:
    litgpt_cli.main(["--prepare", str(directory)])
    printed = capsys.readouterr().out.splitlines()
    return [shlex.split(line) for line in printed if not line.startswith("#")]


def test_prepare_writes_the_checkpoint_and_data_and_prints_the_litgpt_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The lines docs/howto.md ("Run the LitGPT recipe yourself") has a user paste: the `litgpt` command with the folder
    # (the patched copy, tiny_data) first on PYTHONPATH, and the arguments the tests run through `litgpt`'s main() on
    # two processes, (m, A, D) = (2, 2, 2), with the files they name written.
    directory = tmp_path / "run"
    lines = _printed_lines(directory, capsys)
    root = directory.resolve()
    expected = {
        "finetune_full": litgpt_cli.finetune_args(
            "finetune_full", root / "checkpoint", root / "data", root / "out/full", 2, 2
        ),
        "finetune_lora": litgpt_cli.finetune_args(
            "finetune_lora", root / "checkpoint", root / "data", root / "out/lora", 2, 2
        ),
        "pretrain": litgpt_cli.pretrain_args(root / "checkpoint", root / "rows", root / "out/pretrain", 2, 2),
    }
    assert [line[3:4] for line in lines] == [["litgpt"]] * 3
    for line, (command, args) in zip(lines, expected.items(), strict=True):
        assert line[:3] == ["CUDA_VISIBLE_DEVICES=", "TORCHDYNAMO_DISABLE=1", f"PYTHONPATH={root}"]
        assert line[4:] == args and line[4] == command
    for name in ("checkpoint/lit_model.pth", "checkpoint/model_config.yaml", "checkpoint/tokenizer.json",
                 "data/train.json", "data/val.json", "rows/train.pt", "tiny_data.py"):  # fmt: skip
        assert (root / name).is_file(), name


def test_prepare_says_where_the_patched_copy_goes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    litgpt_cli.main(["--prepare", str(tmp_path), "--scripts", "full"])
    first, *lines = capsys.readouterr().out.splitlines()
    assert first.startswith("# first copy the installed litgpt to") and len(lines) == 1
    litgpt_cli.patched_litgpt(tmp_path)  # the copy, patched: the note goes
    litgpt_cli.main(["--prepare", str(tmp_path), "--scripts", "full"])
    assert capsys.readouterr().out.splitlines()[0].startswith("CUDA_VISIBLE_DEVICES=")


@pytest.mark.slow
def test_a_printed_line_runs_as_pasted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # docs/howto.md's flow: the installed litgpt copied into the folder and patched, then a printed line run by a shell.
    litgpt_cli.patched_litgpt(tmp_path)
    full = [line for line in _printed_lines(tmp_path, capsys) if line[4] == "finetune_full"]
    (line,) = [shlex.join(words) for words in full]
    litgpt = Path(sys.executable).with_name("litgpt")
    done = subprocess.run(["bash", "-c", line.replace(" litgpt ", f" {shlex.quote(str(litgpt))} ", 1)],
                          capture_output=True, text=True, timeout=540, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Final evaluation | val loss:" in done.stdout + done.stderr
    assert (tmp_path / "out" / "full" / "final" / "lit_model.pth").is_file()
