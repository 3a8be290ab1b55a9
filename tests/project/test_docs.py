"""The documentation's code runs as written: every Python block, every LightningCLI config (through
``examples/cli.py``), and every other block says why it does not run (docs/project.md, "Code in the documentation")."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
import time
import warnings
from pathlib import Path

import pytest
from torch.optim.optimizer import register_optimizer_step_post_hook

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\S*)\n(.*?)^```$", re.DOTALL | re.MULTILINE)
#: The first line of a block that cannot run here (a GPU, several processes, a download, an environment's set-up).
NOT_RUN = "# not run by the docs test: "
PYTHON, CLI, SHOWN = ("python", "py"), ("yaml",), ("text", "{eval-rst}", "{toctree}")  # SHOWN: output, directives
#: The tour continues the README's "Use" example: its blocks run after the README's, in one session.
TOUR = DOCS / "tour.md"


def blocks(page: Path, languages: tuple[str, ...]) -> list[str]:
    """The blocks of ``page`` in ``languages`` that run (those without the :data:`NOT_RUN` line)."""
    return [
        code for lang, code in FENCE.findall(page.read_text()) if lang in languages and not code.startswith(NOT_RUN)
    ]


PAGES = sorted(p for p in DOCS.glob("*.md") if blocks(p, PYTHON) and p != TOUR)
#: (page, index, layered): every config alone, and after examples/cli.yaml where its first line says it runs so.
CONFIGS = [
    (page, i, layered)
    for page in sorted(DOCS.glob("*.md"))
    for i, config in enumerate(blocks(page, CLI))
    for layered in (False, True)[: 1 + ("after --config examples/cli.yaml" in config.splitlines()[0])]
]


def test_every_block_runs_or_says_why_not() -> None:
    # A block is run (Python, LightningCLI configs), shown output (text), or starts with the line saying why it cannot
    # run here; a shell block always does (they set up environments, download or start processes).
    unmarked = []
    for page in [README, *sorted(DOCS.glob("*.md"))]:
        for lang, code in FENCE.findall(page.read_text()):
            marked = code.startswith(NOT_RUN) and len(code.splitlines()[0]) > len(NOT_RUN) + 10  # with its reason
            if lang not in PYTHON + CLI + SHOWN and not marked:
                unmarked.append(f"{page.name}: ```{lang} {code.splitlines()[0] if code else ''}")
    assert unmarked == []


def test_docs_have_python_examples() -> None:
    assert {p.name for p in PAGES} >= {"quickstart.md", "howto.md"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_python_blocks_run(page: Path, tmp_path: Path) -> None:
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        for block in blocks(page, PYTHON):
            if "import transformers" in block and not _importable("transformers"):
                continue  # the optional `hf` extra is not installed
            with warnings.catch_warnings():  # torch 2.13's own, when a block's `torch.compile` first imports dynamo
                warnings.filterwarnings("ignore", message=r"`torch\.jit\.script_method` is deprecated")
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
    readme, tour = blocks(README, PYTHON), blocks(TOUR, PYTHON)
    assert len(readme) >= 2 and "trainer.fit(" in readme[0] and "def configure_optimizers" in readme[0]
    assert len(tour) >= 4
    namespace: dict[str, object] = {"__name__": "__readme__"}
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        exec(compile(readme[0], "README.md", "exec"), namespace)
        ledger = namespace["trainer"].strategy.ledger  # type: ignore[attr-defined]
        assert ledger.updates_applied == 2 and ledger.samples == 64 and ledger.normalization == "tokens"
        for block in readme[1:]:
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
    # One install story (issue #66): from the folder of a clone, no placeholder, no index release, one torch range.
    install = readme.split("## Install", 1)[1].split("## Use", 1)[0]
    commands = [line for line in install.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()[1:]]
    assert [c.split("#")[0].split()[:2] for c in commands] == [["pip", "install"]] * 2, commands
    assert "from the folder of a clone" in install and "<" not in install.replace("<3", "")
    assert "lightning-accum[" not in readme and re.findall(r"torch[ =>]=?(\d[\d.]*)", readme) == ["2.9"]
    assert "bash scripts/test.sh " in readme and "bash scripts/demo.sh " in readme
    # The check that catches a token count that is not the loss's, in the first example's one line.
    assert "callbacks=[AccumulationCheck(), AxisProgressBar()]" in blocks(README, PYTHON)[0]
    # Where DDP is first shown, the README says why a D = 2 run does not overlay the one-device run.
    ddp = readme.index('strategy="accum_ddp"')
    assert "DistributedSampler" in readme[ddp : ddp + 2500] and "global_order=True" in readme[ddp : ddp + 2500]
    linked = set(re.findall(r"\]\(docs/(\w+)\.md", readme))
    assert linked >= {p.stem for p in DOCS.glob("*.md")} - {"index"}, sorted(linked)


def test_the_readmes_model_with_the_wrong_shift_stops_before_its_first_update(tmp_path: Path) -> None:
    # Issue #66: `shift=True` on the README's already-shifted labels counts one token per sequence too few. The
    # README's own `AccumulationCheck` line stops the fit before any optimizer step.
    from lightning_accum import AccumulationCheckError

    code = blocks(README, PYTHON)[0]
    right = 'supervised_tokens(batch["labels"], shift=False)'
    assert code.count(right) == 1
    steps: list[object] = []
    hook = register_optimizer_step_post_hook(lambda optimizer, *_: steps.append(optimizer))
    namespace: dict[str, object] = {"__name__": "__readme__"}
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(
            AccumulationCheckError, match=r"the token count is off by the shift the other way.*shift=False"
        ):
            exec(compile(code.replace(right, right.replace("False", "True")), "README.md", "exec"), namespace)
    finally:
        hook.remove()
        os.chdir(cwd)
    assert steps == [] and namespace["trainer"].strategy.ledger.updates_attempted == 0  # type: ignore[attr-defined]


def _cli_recipe() -> object:
    spec = importlib.util.spec_from_file_location("recipe_cli", ROOT / "examples" / "cli.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # importable by its name, as jsonargparse resolves the recipe's classes
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "page, index, layered", CONFIGS, ids=[f"{p.stem}-{i}{'-after-cli.yaml' * layered}" for p, i, layered in CONFIGS]
)
def test_lightningcli_configs_run_as_written(
    page: Path, index: int, layered: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each config through the recipe the docs name, as written (it says when it stops), and layered on
    # examples/cli.yaml (which sets `accumulate_grad_batches`, a logger and callbacks of its own) where it says so.
    config = blocks(page, CLI)[index]
    assert re.search(r"max_epochs: [1-9]|max_steps: [1-9]|stop_at: ", config), config
    (tmp_path / "config.yaml").write_text(config)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(ROOT / "examples" / "cli.py")])
    before = [str(ROOT / "examples" / "cli.yaml")] if layered else []
    args = ["fit", *(a for path in before for a in ("--config", path)), "--config", "config.yaml"]
    start = time.perf_counter()
    with warnings.catch_warnings():  # LightningCLI's notices: a config's optimizer replaces the model's; no seed set
        warnings.filterwarnings("ignore", message=r".*\.configure_optimizers` will be overridden by")
        warnings.filterwarnings("ignore", message=r"No seed found, seed set to 0")
        cli = _cli_recipe().main(args)  # type: ignore[attr-defined]
    ledger = cli.trainer.strategy.ledger
    assert ledger.updates_applied > 0 and cli.trainer.state.finished, ledger
    assert time.perf_counter() - start < 120


def test_the_quickstart_runs_without_lightnings_logging_interval_warning(tmp_path: Path) -> None:
    import warnings

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")  # the suite's filters ignore this warning elsewhere
            for block in blocks(DOCS / "quickstart.md", PYTHON):
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
    code = blocks(README, PYTHON) + blocks(TOUR, PYTHON)
    calls = [call for block in code for call in re.findall(r"L\.Trainer\((.*?)\n\)|L\.Trainer\((.*?)\)\n", block, re.S)]
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
