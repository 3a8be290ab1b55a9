"""The token-budget recipe in a reduced size: two splits of the same effective batch, the same token-defined run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_recipe() -> ModuleType:
    spec = importlib.util.spec_from_file_location("token_budget_recipe", ROOT / "examples" / "token_budget.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_recipe_runs_the_same_budget_for_two_splits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = load_recipe()
    common = ["--budget", "3000", "--validate-every", "700", "--checkpoint-every", "1500", "--documents", "64"]
    common += ["--out", str(tmp_path), "--quiet"]
    first = recipe.main([*common, "--m", "4", "--accumulate", "2"])
    second = recipe.main([*common, "--m", "2", "--accumulate", "4"])
    printed = capsys.readouterr().out
    assert "m = 4, A = 2, D = 1: 8 sequences per update" in printed

    assert 3000 <= first["stopped_at_tokens"] == second["stopped_at_tokens"]
    assert first["validated_at_tokens"] == second["validated_at_tokens"] and len(first["validated_at_tokens"]) == 4
    assert first["checkpoints"] == second["checkpoints"] and len(first["checkpoints"]) == 2
    assert [n for n, _ in first["rates"]] == [n for n, _ in second["rates"]]
    assert [lr for _, lr in first["rates"]] == pytest.approx([lr for _, lr in second["rates"]], rel=1e-12)
    for name in first["checkpoints"]:
        assert (tmp_path / "m2_a4" / "checkpoints" / name).is_file()
