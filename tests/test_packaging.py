"""What the distribution declares: one version."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path
from typing import Any

import pytest

import lightning_accum

ROOT = Path(__file__).resolve().parents[1]


def _project() -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]  # type: ignore[no-any-return]


def test_the_version_is_written_once() -> None:
    # pyproject.toml reads it from the package (setuptools' `attr:`), so the installed distribution says the same.
    project = _project()
    assert "version" not in project and "version" in project["dynamic"]
    assert importlib.metadata.version("lightning-accum") == lightning_accum.__version__
