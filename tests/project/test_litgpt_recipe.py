"""The LitGPT recipe (`examples/litgpt/lora.patch`, `full.patch`): LitGPT's own `finetune/lora.py` and `full.py`,
patched as a user patches them, train exactly on one device and on two sharded processes (FSDP2 over gloo), and
validate exactly; LitGPT's own lines do neither. Each run is LitGPT's `fit` and `validate` in its own processes
(`tests/litgpt_recipe.py`), against a float64 reference computed sample by sample outside the package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import litgpt_recipe
import pytest
import torch

RUNNER = Path(litgpt_recipe.__file__)

# Slow: tests/project/test_litgpt_cli.py runs the same patched scripts through the `litgpt` command on every run
# of the suite.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("litgpt")
    for script in ("lora", "full"):
        litgpt_recipe.apply_patch(script, root / "patched")  # `git apply`: fails here if the patch no longer applies
    litgpt_recipe.write_tokenizer(root / "checkpoint")
    return {"root": root, "patched": root / "patched", "checkpoint": root / "checkpoint"}


def run(folders: dict[str, Path], script: str, devices: int, micro_batch_size: int, plain: bool = False) -> Any:
    out = folders["root"] / f"{script}-{devices}-{micro_batch_size}-{'plain' if plain else 'accum'}"
    command = [sys.executable, str(RUNNER), "--script", script, "--patched", str(folders["patched"])]
    command += ["--checkpoint", str(folders["checkpoint"]), "--devices", str(devices)]
    command += ["--micro-batch-size", str(micro_batch_size), "--out", str(out)] + (["--plain"] if plain else [])
    done = subprocess.run(command, capture_output=True, text=True, timeout=540, cwd=folders["root"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return torch.load(out / "result.pt", weights_only=False)


@pytest.mark.parametrize(
    ("script", "splits"),
    [("lora", [(2, 2), (1, 1)]), ("full", [(2, 2)])],  # (D, m); A = 8 / (D · m), as LitGPT derives it
)
def test_the_patched_scripts_train_and_validate_exactly(
    folders: dict[str, Path], script: str, splits: list[tuple[int, int]]
) -> None:
    reference = litgpt_recipe.reference(script)
    for devices, m in splits:
        result = run(folders, script, devices, m)
        sharded = "FabricModelParallelAccumulationStrategy" if devices > 1 else "FabricAccumulationStrategy"
        assert result["strategy"] == sharded
        # Four AdamW updates (LitGPT's warm-up: the first at a rate of 0) of the mean over the group's tokens.
        torch.testing.assert_close(result["parameters"], reference["parameters"], rtol=0, atol=1e-10)
        # The loss to log (the last update's, token-weighted over both replicas) and the validation loss: exact.
        assert result["last_loss"] == pytest.approx(reference["last_loss"], rel=1e-12)
        assert result["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-12)
        # LitGPT's own validate (the mean of batch means, then of the replicas' means) is another number.
        assert abs(result["plain_val_loss"] - reference["val_loss"]) > 1e-5
        assert result["ledger"]["updates"] == litgpt_recipe.UPDATES
        assert result["ledger"]["samples"] == litgpt_recipe.UPDATES * litgpt_recipe.GLOBAL_BATCH


def test_litgpt_s_own_lines_depend_on_the_split(folders: dict[str, Path]) -> None:
    # The same examples per update, split as (m, A) = (4, 2) and (1, 8): LitGPT's `loss / A` averages micro-batch
    # means, so the parameters part (where the patched script agrees with the reference to 1e-10 above).
    four, one = (run(folders, "lora", 1, m, plain=True)["parameters"] for m in (4, 1))
    assert (four - one).abs().max() > 1e-5
