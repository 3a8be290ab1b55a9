"""The documentation's Python examples run as written."""

from __future__ import annotations

import importlib
import os
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)
PAGES = sorted(p for p in DOCS.glob("*.md") if BLOCK.search(p.read_text()))


def test_docs_have_python_examples() -> None:
    assert {p.name for p in PAGES} >= {"quickstart.md", "howto.md"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_python_blocks_run(page: Path, tmp_path: Path) -> None:
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        for block in BLOCK.findall(page.read_text()):
            if "import transformers" in block and not _importable("transformers"):
                continue  # the optional `hf` extra is not installed
            exec(compile(block, f"{page.name}", "exec"), {"__name__": "__docs__"})
    finally:
        os.chdir(cwd)


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True
