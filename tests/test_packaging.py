"""What the distribution declares: one version, and a Lightning range that admits the releases the package supports
and never the two compromised ones."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

import lightning_accum

ROOT = Path(__file__).resolve().parents[1]
#: The uploads that ran a credential stealer on `import lightning` (Lightning's advisory GHSA-w37p-236h-pfx3,
#: Lightning-AI/pytorch-lightning#21691).
COMPROMISED = ("2.6.2", "2.6.3")
#: Releases the declared range must keep: the lowest tested (scripts/test-lowest.sh), the 2.6 line around the
#: compromised ones, and the pinned one (requirements/ci.txt).
SUPPORTED = ("2.5.0", "2.5.6", "2.6.0", "2.6.1", "2.6.4", "2.6.5", "2.6.6")


def _project() -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]  # type: ignore[no-any-return]


def lightning_specifier(dependencies: list[str]) -> SpecifierSet:
    """The version range of ``lightning`` among ``dependencies`` (pyproject's requirement strings)."""
    (found,) = [Requirement(d) for d in dependencies if Requirement(d).name == "lightning"]
    return found.specifier


def admitted_compromised(specifier: SpecifierSet) -> list[str]:
    """The compromised Lightning releases ``specifier`` admits (prereleases never count: pip takes none unasked)."""
    return [version for version in COMPROMISED if specifier.contains(version)]


def test_the_lightning_range_refuses_the_compromised_releases_and_keeps_the_supported_ones() -> None:
    specifier = lightning_specifier(_project()["dependencies"])
    assert not admitted_compromised(specifier), f"pyproject.toml's lightning{specifier} admits a compromised release"
    assert [v for v in SUPPORTED if not specifier.contains(v)] == []
    assert not specifier.contains("2.4.0") and not specifier.contains("3.0.0")


def test_the_check_catches_a_range_that_admits_a_compromised_release() -> None:
    # The range the package declared before: 2.6.2 and 2.6.3 inside it.
    assert admitted_compromised(lightning_specifier(["lightning>=2.5,<3", "torch>=2.3"])) == list(COMPROMISED)
    assert admitted_compromised(lightning_specifier(["lightning>=2.5,<3,!=2.6.2"])) == ["2.6.3"]
    assert admitted_compromised(lightning_specifier(["lightning>=2.5,<3,!=2.6.2,!=2.6.3"])) == []


def test_the_pinned_lightning_is_inside_the_declared_range() -> None:
    lines = (ROOT / "requirements" / "ci.txt").read_text().splitlines()
    pins = [Requirement(line.split("#")[0]) for line in lines if line.split("#")[0].strip()]
    (pin,) = [p for p in pins if p.name == "lightning"]
    (version,) = [s.version for s in pin.specifier]
    assert version not in COMPROMISED and lightning_specifier(_project()["dependencies"]).contains(version)


def test_the_version_is_written_once() -> None:
    # pyproject.toml reads it from the package (setuptools' `attr:`), so the installed distribution says the same.
    project = _project()
    assert "version" not in project and "version" in project["dynamic"]
    assert importlib.metadata.version("lightning-accum") == lightning_accum.__version__
