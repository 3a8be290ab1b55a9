"""What the distribution declares and ships: one version, a Lightning range that starts at 2.6.6 (the first release
without CVE-2026-58659) and so admits neither the affected releases nor the two compromised ones, and the check of the
built archives (scripts/package_contents.py) that scripts/check-package.sh runs."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

import lightning_accum

ROOT = Path(__file__).resolve().parents[2]
#: The uploads that ran a credential stealer on `import lightning` (Lightning's advisory GHSA-w37p-236h-pfx3,
#: Lightning-AI/pytorch-lightning#21691).
COMPROMISED = ("2.6.2", "2.6.3")
#: The first Lightning without CVE-2026-58659 (GHSA-qqmf-gpg7-g8gw: code execution through
#: `LightningModule.load_from_checkpoint` from a checkpoint's hyperparameters; 2.5.0 to 2.6.5 are affected).
FLOOR = "2.6.6"
#: Releases inside GHSA-qqmf-gpg7-g8gw's affected range: the declared range admits none of them.
VULNERABLE = ("2.5.0", "2.5.6", "2.6.0", "2.6.1", "2.6.4", "2.6.5")
#: Each advisory's affected Lightning releases, as the advisory states them (docs/project.md, "Security").
ADVISORIES = {
    "GHSA-qqmf-gpg7-g8gw": [SpecifierSet(">=2.5.0,<2.6.6")],
    "GHSA-w37p-236h-pfx3": [SpecifierSet("==2.6.2"), SpecifierSet("==2.6.3")],
}


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


def admitted_below_floor(specifier: SpecifierSet) -> list[str]:
    """The releases affected by CVE-2026-58659 (or compromised) that ``specifier`` admits."""
    return [version for version in sorted({*VULNERABLE, *COMPROMISED}) if specifier.contains(version)]


def test_the_lightning_range_starts_at_the_release_without_the_cve() -> None:
    specifier = lightning_specifier(_project()["dependencies"])
    assert str(specifier) == f"<3,>={FLOOR}", f"pyproject.toml declares lightning{specifier}, not lightning>={FLOOR},<3"
    assert admitted_below_floor(specifier) == [], f"lightning{specifier} admits releases an advisory names"
    assert specifier.contains(FLOOR) and specifier.contains("2.7.0") and not specifier.contains("3.0.0")


def interval(specifier: SpecifierSet) -> tuple[Version, Version | None]:
    """``[low, high)`` of a range written with ``>=``, ``<`` and ``==`` (``high`` None: no upper bound)."""
    low, high = Version("0"), None
    for clause in specifier:
        version = Version(clause.version)
        if clause.operator == ">=":
            low = max(low, version)
        elif clause.operator == "<":
            high = version if high is None else min(high, version)
        elif clause.operator == "==":
            low, high = version, Version(f"{version.public}.post0.dev0")  # the one release: [v, v.post0.dev0)
        else:
            raise ValueError(f"{clause}: write the range with >=, < or ==")
    return low, high


def overlap(declared: SpecifierSet, affected: SpecifierSet) -> bool:
    """Whether two ranges share a release (as intervals: not only the releases listed here)."""
    (low, high), (affected_low, affected_high) = interval(declared), interval(affected)
    return (affected_high is None or low < affected_high) and (high is None or affected_low < high)


def test_the_lightning_range_shares_no_release_with_an_advisory() -> None:
    declared = lightning_specifier(_project()["dependencies"])
    touching = [name for name, ranges in ADVISORIES.items() for affected in ranges if overlap(declared, affected)]
    assert touching == [], f"lightning{declared} overlaps the affected range of {touching}"
    # The check sees an overlap where there is one: the ranges the package declared before, and one release too low.
    assert overlap(SpecifierSet(">=2.5,<3"), ADVISORIES["GHSA-qqmf-gpg7-g8gw"][0])
    assert overlap(SpecifierSet(">=2.6.5,<3"), ADVISORIES["GHSA-qqmf-gpg7-g8gw"][0])
    assert overlap(SpecifierSet(">=2.6.3,<3"), ADVISORIES["GHSA-w37p-236h-pfx3"][1])
    assert not overlap(SpecifierSet(">=2.6.4,<3"), ADVISORIES["GHSA-w37p-236h-pfx3"][1])


def test_the_check_catches_the_ranges_declared_before() -> None:
    # The ranges the package declared before: every affected release inside them, and the compromised ones first.
    assert admitted_compromised(lightning_specifier(["lightning>=2.5,<3", "torch>=2.3"])) == list(COMPROMISED)
    assert admitted_compromised(lightning_specifier(["lightning>=2.5,<3,!=2.6.2"])) == ["2.6.3"]
    assert admitted_below_floor(lightning_specifier(["lightning>=2.5,<3,!=2.6.2,!=2.6.3"])) == list(VULNERABLE)


def test_the_pinned_lightning_is_inside_the_declared_range() -> None:
    lines = (ROOT / "requirements" / "ci.txt").read_text().splitlines()
    pins = [Requirement(line.split("#")[0]) for line in lines if line.split("#")[0].strip()]
    (pin,) = [p for p in pins if p.name == "lightning"]
    (version,) = [s.version for s in pin.specifier]
    # The lowest version the range admits is the one CI tests: the pin is the floor.
    assert version == FLOOR and lightning_specifier(_project()["dependencies"]).contains(version)


def test_the_version_is_written_once() -> None:
    # pyproject.toml reads it from the package (setuptools' `attr:`), so the installed distribution says the same.
    project = _project()
    assert "version" not in project and "version" in project["dynamic"]
    assert importlib.metadata.version("lightning-accum") == lightning_accum.__version__


def _contents_checker() -> Any:
    """scripts/package_contents.py, the check scripts/check-package.sh runs on the built archives."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("package_contents", ROOT / "scripts" / "package_contents.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _wheel(path: Path, names: dict[str, bytes]) -> Path:
    import zipfile

    with zipfile.ZipFile(path, "w") as archive:
        for name, data in names.items():
            archive.writestr(name, data)
    return path


def test_the_wheel_check_names_a_missing_license_stray_tests_and_a_range_below_the_floor(tmp_path: Path) -> None:
    contents = _contents_checker()
    info = "lightning_accum-0.1.0.dist-info"
    metadata = "Metadata-Version: 2.4\nName: lightning-accum\nLicense-Expression: Apache-2.0\n"
    good = {
        "lightning_accum/__init__.py": b"",
        "lightning_accum/py.typed": b"",
        f"{info}/licenses/LICENSE": (ROOT / "LICENSE").read_bytes(),
        f"{info}/METADATA": (metadata + "Requires-Dist: lightning<3,>=2.6.6\n").encode(),
    }
    assert contents.check_wheel(_wheel(tmp_path / "good.whl", good)) == []
    bad = {k: v for k, v in good.items() if not k.endswith("LICENSE")}
    old_range = "Requires-Dist: lightning!=2.6.2,!=2.6.3,<3,>=2.5\n"  # what the package declared before
    bad |= {"tests/test_engine.py": b"", f"{info}/METADATA": (metadata + old_range).encode()}
    assert contents.check_wheel(_wheel(tmp_path / "bad.whl", bad)) == [
        f"the wheel has no {info}/licenses/LICENSE",
        "the wheel holds more than the package: ['tests']",
        "the wheel requires lightning!=2.6.2,!=2.6.3,<3,>=2.5, which admits 2.5.0/2.5.6/2.6.0/2.6.1/2.6.4/2.6.5"
        " (CVE-2026-58659; 2.6.2 and 2.6.3 compromised): the floor is 2.6.6",
    ]


def test_the_sdist_check_names_each_file_its_tests_need_that_it_lacks(tmp_path: Path) -> None:
    import tarfile

    contents = _contents_checker()
    top = tmp_path / "lightning_accum-0.1.0"
    wanted = [
        *contents.SDIST_FILES,
        *(f for d in (*contents.SDIST_FOLDERS, "benchmarks") for f in contents.source_files(d)),
    ]
    for name in set(wanted) - {"examples/cli.yaml", "benchmarks/run.py"}:  # two left out
        (top / name).parent.mkdir(parents=True, exist_ok=True)
        (top / name).write_bytes(b"")
    sdist = tmp_path / "lightning_accum-0.1.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as archive:
        archive.add(top, arcname=top.name)
    assert contents.check_sdist(sdist) == ["the sdist lacks examples/cli.yaml", "the sdist lacks benchmarks/run.py"]
