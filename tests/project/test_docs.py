"""The documentation's Python examples run as written."""

from __future__ import annotations

import importlib
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)
#: The tour continues the README's "Use" example: its blocks run after the README's, in one session.
TOUR = DOCS / "tour.md"
PAGES = sorted(p for p in DOCS.glob("*.md") if BLOCK.search(p.read_text()) and p != TOUR)


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


def test_readme_and_tour_python_blocks_run_in_order(tmp_path: Path) -> None:
    # The README's blocks build on each other (the "Use" block defines `L`, the model and the loader), and the tour
    # continues them, so they run in one namespace, in order, as a reader pasting them into one session would.
    readme = DOCS.parent / "README.md"
    blocks = BLOCK.findall(readme.read_text())
    tour = BLOCK.findall(TOUR.read_text())
    assert len(blocks) >= 2 and "trainer.fit(" in blocks[0] and "def configure_optimizers" in blocks[0]
    assert len(tour) >= 4
    namespace: dict[str, object] = {"__name__": "__readme__"}
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        exec(compile(blocks[0], "README.md", "exec"), namespace)
        ledger = namespace["trainer"].strategy.ledger  # type: ignore[attr-defined]
        assert ledger.updates_applied == 2 and ledger.samples == 64 and ledger.normalization == "tokens"
        for block in blocks[1:]:
            exec(compile(block, "README.md", "exec"), namespace)
        for block in tour:
            exec(compile(block, "tour.md", "exec"), namespace)
    finally:
        os.chdir(cwd)


def test_the_readme_is_what_a_user_reads_first() -> None:
    # What it does, the two commands, install, "Use", the tokens axis and links; the rest lives in docs/ (issue #60).
    readme = (DOCS.parent / "README.md").read_text()
    headings = re.findall(r"^## (.+)$", readme, flags=re.MULTILINE)
    assert headings == ["Quick start", "Install", "Use", "Curves on a tokens axis", "Documentation"], headings
    install = readme.split("## Install", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    assert len(install.splitlines()) == 5, install
    assert "bash scripts/test.sh " in readme and "bash scripts/demo.sh " in readme
    # Where DDP is first shown, the README says why a D = 2 run does not overlay the one-device run.
    ddp = readme.index('strategy="accum_ddp"')
    assert "DistributedSampler" in readme[ddp : ddp + 2500] and "global_order=True" in readme[ddp : ddp + 2500]
    linked = set(re.findall(r"\]\(docs/(\w+)\.md", readme))
    assert linked >= {p.stem for p in DOCS.glob("*.md")} - {"index"}, sorted(linked)


def test_the_quickstart_runs_without_lightnings_logging_interval_warning(tmp_path: Path) -> None:
    import warnings

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")  # the suite's filters ignore this warning elsewhere
            for block in BLOCK.findall((DOCS / "quickstart.md").read_text()):
                exec(compile(block, "quickstart.md", "exec"), {"__name__": "__docs__"})
    finally:
        os.chdir(cwd)
    assert not [w for w in seen if "logging interval" in str(w.message)]


def test_internals_shows_each_strategys_method_resolution_order() -> None:
    import lightning_accum as la

    text = (DOCS / "internals.md").read_text()
    shown = re.search(r"```text\n(AccumulationStrategy → .*?)```", text, re.DOTALL)
    assert shown is not None
    lines = shown.group(1).strip().splitlines()
    strategies = (la.AccumulationStrategy, la.DDPAccumulationStrategy, la.ModelParallelAccumulationStrategy)
    expected = [
        " → ".join(c.__name__ for c in s.__mro__[: s.__mro__.index(la.ExactAccumulation.__mro__[1]) + 1])
        for s in strategies
    ]
    assert lines == expected
    # One package class between each public strategy and Lightning's; the seam both doors share only after Lightning's
    # classes (a facade: the instance keeps the layout of Lightning's strategy).
    from lightning_accum.core.core import CoreSeam

    for strategy in strategies:
        ours = [c for c in strategy.__mro__ if c.__module__.startswith("lightning_accum")]
        assert ours == [strategy, la.ExactAccumulation, CoreSeam]
        assert strategy.__mro__.index(CoreSeam) > strategy.__mro__.index(la.ExactAccumulation.__mro__[1])


def test_internals_shows_each_fabric_strategys_method_resolution_order() -> None:
    import lightning_accum as la

    text = (DOCS / "internals.md").read_text()
    shown = re.search(r"```text\n(FabricAccumulationStrategy → .*?)```", text, re.DOTALL)
    assert shown is not None
    strategies = (
        la.FabricAccumulationStrategy,
        la.FabricDDPAccumulationStrategy,
        la.FabricModelParallelAccumulationStrategy,
    )
    base = la.FabricExactAccumulation.__mro__[1]  # Fabric's Strategy
    expected = [" → ".join(c.__name__ for c in s.__mro__[: s.__mro__.index(base) + 1]) for s in strategies]
    assert shown.group(1).strip().splitlines() == expected
    from lightning_accum.core.core import CoreSeam

    for strategy in strategies:
        ours = [c for c in strategy.__mro__ if c.__module__.startswith("lightning_accum")]
        assert ours == [strategy, la.FabricExactAccumulation, CoreSeam]
        assert strategy.__mro__.index(CoreSeam) > strategy.__mro__.index(base)


def test_internals_lists_every_member_of_the_adapter_interface() -> None:
    from lightning_accum.core.adapter import EngineAdapter

    text = (DOCS / "internals.md").read_text().split("Its whole interface:\n\n", 1)[1].split("\n\n", 1)[0]
    members = {name for name in vars(EngineAdapter) if not name.startswith("_")} - {"strategy"}
    listed = set(re.findall(r"`(\w+)", text))
    assert members <= listed, sorted(members - listed)


def test_every_member_of_the_seam_table_exists() -> None:
    from lightning_accum import ExactAccumulation

    text = (DOCS / "internals.md").read_text().split("## The public seam for callbacks and users", 1)[1]
    table = text.split("| member | what it gives |", 1)[1].split("\n\n", 1)[0]
    members = re.findall(r"^\| `(\w+)", table, flags=re.MULTILINE)
    assert len(members) >= 10
    assert [m for m in members if not hasattr(ExactAccumulation, m)] == []


def test_the_project_pages_layout_names_every_module() -> None:
    layout = (DOCS / "project.md").read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    package = ROOT / "lightning_accum"
    modules = [p for p in package.rglob("*.py") if p.name != "__init__.py"]
    missing = [str(p.relative_to(ROOT)) for p in modules if f"`{p.name}`" not in layout and f"/{p.name}`" not in layout]
    examples = [p for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_")]
    missing += [str(p.relative_to(ROOT)) for p in examples if f"`examples/{p.name}`" not in layout]
    assert missing == []


def test_every_trainer_in_the_readme_and_the_tour_says_when_it_stops() -> None:
    # A Trainer without `max_epochs` or `max_steps` runs Lightning's default of 1000 epochs when fitted as written.
    blocks = BLOCK.findall((DOCS.parent / "README.md").read_text() + TOUR.read_text())
    calls = [
        call for block in blocks for call in re.findall(r"L\.Trainer\((.*?)\n\)|L\.Trainer\((.*?)\)\n", block, re.S)
    ]
    texts = [first or second for first, second in calls]
    assert len(texts) >= 5
    assert all("max_epochs" in text or "max_steps" in text for text in texts), texts


def test_the_group_vectors_element_count_is_the_codes() -> None:
    # The vector a group sums over replicas is laid out by `Slot` (lightning_accum/group.py); the README said 12 when it
    # had 14 elements.
    from lightning_accum.group import VECTOR_SIZE, Slot

    assert len(Slot) == VECTOR_SIZE == max(Slot) + 1
    said = [
        (page.name, int(count))
        for page in [DOCS.parent / "README.md", *sorted(DOCS.glob("*.md"))]
        for count in re.findall(r"all-reduce of a (\d+)-element float64 vector", " ".join(page.read_text().split()))
    ]
    assert said and all(count == VECTOR_SIZE for _, count in said), (said, VECTOR_SIZE)


def test_the_adapters_setup_says_it_runs_before_lightnings() -> None:
    import inspect

    from lightning_accum.strategies.base import ExactAccumulation
    from lightning_accum.strategies.trainer_side import TrainerSide

    source = inspect.getsource(ExactAccumulation.setup)
    assert source.index("self._side.setup(trainer)") < source.index("super().setup(trainer)")
    assert "before Lightning's" in (TrainerSide.setup.__doc__ or "")
