"""What the built archives hold, checked against the source tree (run by scripts/check-package.sh).

    python scripts/package_contents.py dist/lightning_accum-<v>-py3-none-any.whl dist/lightning_accum-<v>.tar.gz

The wheel: the package with ``py.typed``, the license text (PEP 639: ``dist-info/licenses/LICENSE``, declared as
``License-Expression: Apache-2.0``), the Lightning range from 2.6.6 on (no release affected by CVE-2026-58659, nor
the compromised 2.6.2 and 2.6.3), nothing else (no
tests, benchmarks, examples). The sdist: everything its test suite reads (tests/, examples/, docs/, the benchmarks'
code, the pins), the license, the changelog and the security policy.
"""

from __future__ import annotations

import argparse
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
#: Folders whose every file the sdist carries (the test suite reads them), and the benchmarks' code and texts.
SDIST_FOLDERS = ("tests", "examples", "docs", "requirements", "scripts")
SDIST_FILES = ("LICENSE", "README.md", "CHANGELOG.md", "SECURITY.md", "pyproject.toml", "lightning_accum/py.typed")
#: Lightning releases the wheel must not admit: 2.5.0 to 2.6.5 are affected by CVE-2026-58659 (GHSA-qqmf-gpg7-g8gw,
#: fixed in 2.6.6), and 2.6.2 and 2.6.3 were compromised uploads (GHSA-w37p-236h-pfx3).
REFUSED_LIGHTNING = ("2.5.0", "2.5.6", "2.6.0", "2.6.1", "2.6.2", "2.6.3", "2.6.4", "2.6.5")


def source_files(folder: str) -> list[str]:
    return sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / folder).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and "_build" not in path.parts
    )


def check_wheel(path: Path) -> list[str]:
    problems = []
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        (info,) = {name.split("/")[0] for name in names if ".dist-info/" in name}
        license_name = f"{info}/licenses/LICENSE"
        if license_name not in names:
            problems.append(f"the wheel has no {license_name}")
        elif archive.read(license_name) != (ROOT / "LICENSE").read_bytes():
            problems.append(f"{license_name} is not the repository's LICENSE")
        metadata = Parser().parsestr(archive.read(f"{info}/METADATA").decode())
    if "lightning_accum/py.typed" not in names:
        problems.append("the wheel has no lightning_accum/py.typed")
    stray = sorted({name.split("/")[0] for name in names} - {"lightning_accum", info})
    if stray:
        problems.append(f"the wheel holds more than the package: {stray}")
    if metadata["License-Expression"] != "Apache-2.0":
        problems.append(f"License-Expression is {metadata['License-Expression']!r}, not 'Apache-2.0'")
    (lightning,) = [r for r in map(Requirement, metadata.get_all("Requires-Dist") or []) if r.name == "lightning"]
    admitted = [version for version in REFUSED_LIGHTNING if lightning.specifier.contains(version)]
    if admitted:
        problems.append(
            f"the wheel requires lightning{lightning.specifier}, which admits {'/'.join(admitted)} (CVE-2026-58659;"
            " 2.6.2 and 2.6.3 compromised): the floor is 2.6.6"
        )
    print(f"[contents] wheel: {len(names)} files, {info}, lightning{lightning.specifier}")
    return problems


def check_sdist(path: Path) -> list[str]:
    with tarfile.open(path) as archive:
        names = archive.getnames()
    (top,) = {name.split("/")[0] for name in names}
    held = {name.removeprefix(f"{top}/") for name in names}
    wanted = [*SDIST_FILES, *(f for folder in SDIST_FOLDERS for f in source_files(folder))]
    wanted += [f for f in source_files("benchmarks") if f.endswith((".py", ".sh", ".md"))]
    missing = [name for name in wanted if name not in held]
    print(f"[contents] sdist: {len(held)} files under {top}/")
    return [f"the sdist lacks {name}" for name in missing]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("sdist", type=Path)
    args = parser.parse_args(argv)
    problems = check_wheel(args.wheel) + check_sdist(args.sdist)
    for problem in problems:
        print(f"[contents] {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
