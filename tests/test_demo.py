"""The demo in a reduced size: its artefacts, and the curves it is there to show."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import matplotlib.image
import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_demo() -> ModuleType:
    spec = importlib.util.spec_from_file_location("accum_demo", ROOT / "examples" / "demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(600)
def test_demo_artefacts_and_curves(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    demo = load_demo()
    out = tmp_path / "demo"
    configs = demo.main(
        ["--out", str(out), "--updates", "6", "--documents", "256", "--val-every", "3", "--max-len", "48", "--quiet"]
    )
    printed = capsys.readouterr().out
    assert f"tensorboard --logdir {out}" in printed and "loss_vs_tokens.png" in printed

    curves = {}
    for config in configs:
        folder = str(out / config.name / "version_0")
        curves[config.name] = dict(demo.read_curves(folder, "accum/loss"))
        assert len(curves[config.name]) == 6, config.name
        if config.plain:
            continue
        record = json.loads((out / config.name / "version_0" / "accumulation_report.json").read_text())
        steps = sorted(curves[config.name])
        # The report agrees with the ledger and the tokens axis: the last x is the run's token count.
        assert record["tokens"]["total"] == record["ledger"]["tokens"] == steps[-1]
        assert record["updates"]["applied"] == record["ledger"]["updates_applied"] == 6
        assert record["effective_batch"]["arithmetic"] == f"{config.m} × {config.accumulate} × 1 = 32"
        assert record["status"] == "completed"
        val = demo.read_curves(folder, "val/loss")
        assert [step for step, _ in val] == [steps[2], steps[5]]  # validation after updates 3 and 6

    accum = [name for name in curves if name.startswith("accum")]
    reference = curves[accum[0]]
    for name in accum[1:]:
        assert curves[name].keys() == reference.keys()  # the same tokens axis
        assert max(abs(curves[name][x] - reference[x]) for x in reference) < 1e-4, name
    plain = curves["lightning_m4_a8"]
    assert plain.keys() == reference.keys()  # same data order, so the same token counts...
    assert max(abs(plain[x] - reference[x]) for x in reference) > 1e-3  # ...but another objective

    picture = out / "loss_vs_tokens.png"
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(picture)
    assert image.shape[0] > 200 and image.shape[1] > 400
