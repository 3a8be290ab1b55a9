"""The demo in a reduced size (``--quick``): what it shows, what it leaves behind, what it prints."""

from __future__ import annotations

import importlib
import itertools
import shlex
import shutil
import sys
from pathlib import Path
from types import ModuleType

import matplotlib.image
import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_demo() -> ModuleType:
    # Imported by name from examples/ (on sys.path, which spawned processes inherit), so that the DDP run's
    # processes can unpickle the demo's classes.
    if str(ROOT / "examples") not in sys.path:
        sys.path.insert(0, str(ROOT / "examples"))
    return importlib.import_module("demo")


def test_ddp_replicas_read_exactly_the_single_device_groups() -> None:
    demo = load_demo()
    sampler = demo.GroupSampler(100, 32, seed=3)
    sampler.set_epoch(1)
    single = sampler.indices(0, 1)
    shares = [sampler.indices(rank, 2) for rank in range(2)]
    assert len(single) == 96 and sorted(single) != single  # whole groups only, shuffled
    for g in range(3):  # group g: the union of the replicas' shares is the single device's group, in its order
        assert shares[0][16 * g : 16 * (g + 1)] + shares[1][16 * g : 16 * (g + 1)] == single[32 * g : 32 * (g + 1)]
    sampler.set_epoch(2)
    assert sampler.indices(0, 1) != single  # a new order every epoch, the same for every configuration


def test_the_token_run_reads_the_groups_of_the_fixed_runs() -> None:
    # The token run's order is a GlobalOrderSampler of the same seed: its group g holds GroupSampler's group g, at the
    # demo's budget (three quarters of the (16, 2) run's largest micro-batch), in every epoch.
    from lightning_accum import TokenBatchSampler

    demo = load_demo()
    args = demo.parse_args(["--quick"])
    data = demo.ByteDocuments(args.documents, args.max_len, seed=args.seed)
    budget = demo.token_budget(args)
    assert budget == int(0.75 * demo.fixed_peak(args)) and demo.fixed_peak(args) == 16 * (args.max_len - 1)
    tokens = TokenBatchSampler(data, data.lengths(), budget, 32, seed=args.seed)
    groups = demo.GroupSampler(len(data), 32, seed=args.seed)
    for epoch in range(2):
        tokens.set_epoch(epoch)
        groups.set_epoch(epoch)
        fixed = groups.indices(0, 1)
        assert len(tokens.group_sizes()) == len(fixed) // 32 == 6
        for g in range(6):
            assert sorted(tokens.group_examples(g)) == sorted(fixed[32 * g : 32 * (g + 1)]), (epoch, g)


def scalar_steps(folder: Path) -> dict[str, list[int]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [e.step for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.mark.ddp
@pytest.mark.timeout(900)  # a minute on an idle 2-core machine; much more on a shared, loaded one
def test_two_demo_runs_in_a_row(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    demo = load_demo()
    out = tmp_path / "demo"

    # First run, with the 2-process DDP configuration and its progress lines: exact runs draw one curve, plain
    # Lightning does not.
    configs = demo.main(["--quick", "--out", str(out)])
    assert [c.name for c in configs if c.replicas > 1] == ["accum_ddp_m4_a4_d2"]
    curves = {c.name: demo.read_run(out, c) for c in configs}
    reference = curves["accum_m16_a2"]
    assert len(reference.weighted) == 6 and len(reference.val) == 2
    for config in configs:
        run = curves[config.name]
        assert run.weighted.keys() == reference.weighted.keys(), config.name  # the same groups: the same x
        assert run.val.keys() == reference.val.keys(), config.name
        gap = demo.largest_gap(run.weighted, reference.weighted)
        if config.plain:
            # The first update starts from the same parameters on the same examples: the same token-weighted loss.
            first = min(reference.weighted)
            assert abs(run.weighted[first] - reference.weighted[first]) < 1e-5, config.name
            if config.m < 16:
                assert gap > 1e-3, config.name  # then another objective, another trajectory
        else:
            assert gap < 1e-5, config.name  # DDP included
            assert demo.largest_gap(run.val, reference.val) < 1e-5, config.name
    plain_objectives = [curves[c.name].objective for c in configs if c.plain]
    assert demo.largest_gap(plain_objectives[0], plain_objectives[-1]) > 1e-2  # the objective depends on the split
    first_output = capfd.readouterr()
    assert "largest gap to accum_m16_a2" in first_output.out and "lightning_m2_a16" in first_output.out
    # One screen on the console, the spawned processes' output included (a file descriptor's); the rest in the log.
    console = first_output.out.splitlines() + first_output.err.splitlines()
    assert len(console) <= 40 and not first_output.err, console
    assert [line.split()[1] for line in console if line.startswith("run ")] == [f"{i}/8" for i in range(1, 9)]
    # The token run: its curve is the exact runs' (above), in 2 or 3 micro-batches per update, none larger than the
    # (16, 2) run's largest, with less padding.
    fixed, token = reference.footprint, curves["accum_tokens"].footprint
    assert fixed["microbatches_per_update"] == [2] * 6
    assert set(token["microbatches_per_update"]) == {2, 3}
    assert token["peak_padded_tokens"] <= demo.token_budget(demo.parse_args(["--quick"])) < fixed["peak_padded_tokens"]
    assert token["padding_fraction"] < fixed["padding_fraction"] - 0.1
    assert "accum_tokens: accum_m16_a2's groups cut under 75% of its peak" in first_output.out
    log = (out / demo.LOG).read_text()
    assert log.count("run record: completed, 6/6 updates applied") == 5  # the exact runs' records (pytest takes the
    # logging of this process; the spawned processes' goes to the log too)
    assert "Initializing distributed: GLOBAL_RANK: 1" in log and "updates 6/6 (100.0%)" in log

    # Second run into the same folder, without DDP: only the latest runs remain, each written once.
    picture = out / demo.PICTURE
    first_picture_time = picture.stat().st_mtime_ns
    configs = demo.main(["--quick", "--quiet", "--no-ddp", "--out", str(out)])
    printed = capfd.readouterr().out
    assert not (out / "accum_ddp_m4_a4_d2").exists()
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [c.name for c in configs] + [demo.PICTURE, demo.TABLE, demo.LOG]
    )
    table = (out / demo.TABLE).read_text()
    assert f"{len(configs)} of {len(configs)} runs done" in table and all(c.name in table for c in configs)
    for config in configs:
        folder = demo.log_folder(out, config)
        assert len(list(folder.glob("events.out.tfevents.*"))) == 1, config.name
        steps = scalar_steps(folder)
        assert {"accum/loss", "val/loss"} <= steps.keys(), config.name
        if not config.plain:  # the strategy's accum/val_loss and the demo's own token-summing metric agree
            values = demo.read_curves(folder, "accum/val_loss")
            assert [x for x, _ in values] == steps["val/loss"], config.name
            for (_, exact), (_, own) in zip(values, demo.read_curves(folder, "val/loss"), strict=True):
                assert exact == pytest.approx(own, rel=1e-5), config.name
        for tag, values in steps.items():
            assert all(a < b for a, b in itertools.pairwise(values)), (config.name, tag, values)
            assert len(values) == len(set(values)), (config.name, tag)
    assert picture.stat().st_mtime_ns > first_picture_time
    image = matplotlib.image.imread(picture)
    assert image.shape[0] > 300 and image.shape[1] > 1000

    # The printed TensorBoard command works from any folder: an executable, an absolute log folder.
    line = next(line for line in printed.splitlines() if line.startswith("open TensorBoard:"))
    command = shlex.split(line.split(":", 1)[1])
    assert shutil.which(command[0]) is not None and Path(command[0]).is_absolute()
    logdir = Path(command[command.index("--logdir") + 1])
    assert logdir.is_absolute() and logdir == out.resolve()


class Stopped(Exception):
    """What stops the demo between its first and second run in the test below (as Ctrl-C or a kill would)."""


def test_a_stopped_demo_leaves_the_table_and_picture_of_the_runs_it_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    demo = load_demo()
    out = tmp_path / "demo"
    train = demo.train
    started: list[str] = []

    def train_then_stop(config: object, args: object, index: int, count: int, log: object) -> float:
        started.append(config.name)  # type: ignore[attr-defined]
        if index == 2:  # the first run has finished: its table and picture are on disk before the second starts
            raise Stopped
        return float(train(config, args, index, count, log))

    monkeypatch.setattr(demo, "train", train_then_stop)
    with pytest.raises(Stopped):
        demo.main(["--quick", "--quiet", "--no-ddp", "--out", str(out)])
    assert started == ["accum_m16_a2", "accum_m4_a8"]
    lines = (out / demo.TABLE).read_text().splitlines()
    assert lines[0].startswith("== results (") and lines[0].endswith("1 of 7 runs done)"), lines[0]
    rows = [line.split() for line in lines[2:] if line.strip().startswith(("accum_", "lightning_"))]
    assert [row[0] for row in rows] == ["accum_m16_a2"] and rows[0][4] == "6", rows  # its 6 updates
    image = matplotlib.image.imread(out / demo.PICTURE)
    assert image.shape[0] > 300 and image.shape[1] > 1000
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["accum_m16_a2", demo.PICTURE, demo.TABLE, demo.LOG]
    )  # nothing half-written


def test_help_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    demo = load_demo()
    with pytest.raises(SystemExit):
        demo.parse_args(["--help"])
    text = capsys.readouterr().out
    assert "(default: 40)" in text and "--quick" in text and "--no-ddp" in text
