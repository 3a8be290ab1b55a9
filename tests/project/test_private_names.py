"""The private Lightning and torch names the package uses behave as it relies on (docs/internals.md lists each with the
test that guards it; the last test here keeps that table honest)."""

from __future__ import annotations

import inspect
import re
import warnings
from pathlib import Path

import torch
from helpers import make_trainer
from lightning.pytorch.strategies import Strategy

from lightning_accum import AccumulationStrategy, AxisLR, DDPAccumulationStrategy, FabricAccumulationStrategy
from lightning_accum.strategies.ddp import _LedgerReturningLauncher

ROOT = Path(__file__).resolve().parents[2]


def test_the_device_the_trainer_selects_is_the_strategys_root_device() -> None:
    # `parallel_devices`' setter writes SingleDeviceStrategy._root_device, which its `root_device` reads (Lightning's
    # strategy and Fabric's).
    for strategy in (AccumulationStrategy(), FabricAccumulationStrategy()):
        strategy.parallel_devices = [torch.device("meta")]
        assert strategy.root_device == torch.device("meta")


def test_fabrics_spawn_launcher_is_ours_and_serves_the_strategy() -> None:
    # Fabric's DDPStrategy._configure_launcher sets `_launcher` from `_start_method`; the launcher keeps its `_strategy`
    # and runs the launched function through `_wrapping_function(process_idx, function, args, kwargs, ...)`, whose
    # `function` ours wraps to return rank zero's ledger beside its value.
    from lightning.fabric import Fabric
    from lightning.fabric.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    from lightning_accum.fabric import FabricDDPAccumulationStrategy, _LedgerReturningLauncher

    strategy = Fabric(strategy="accum_ddp_spawn", devices=2, accelerator="cpu").strategy
    assert isinstance(strategy, FabricDDPAccumulationStrategy) and strategy._start_method == "spawn"
    assert isinstance(strategy._launcher, _LedgerReturningLauncher)
    assert strategy._launcher._strategy is strategy
    assert "_wrapping_function" in vars(_MultiProcessingLauncher)
    wrapping = inspect.signature(_MultiProcessingLauncher._wrapping_function)
    assert list(wrapping.parameters)[:5] == ["self", "process_idx", "function", "args", "kwargs"]


def test_the_spawn_launcher_is_ours_and_serves_the_strategy() -> None:
    # DDPStrategy._configure_launcher sets `_launcher` from `_start_method`; the launcher keeps its `_strategy`.
    trainer = make_trainer(
        strategy="accum_ddp_spawn",
        devices=2,
    )
    strategy = trainer.strategy
    assert isinstance(strategy, DDPAccumulationStrategy)
    assert strategy._start_method == "spawn"
    assert isinstance(strategy._launcher, _LedgerReturningLauncher)
    assert strategy._launcher._strategy is strategy
    assert callable(strategy._launcher._wrapping_function)


def test_fabrics_no_backward_sync_enters_the_strategys_sync_control() -> None:
    # `fabric.no_backward_sync(model, enabled)` enters `strategy._backward_sync_control.no_backward_sync(module,
    # enabled)`; the model-parallel strategy's control is `BackwardSyncNotes` around Fabric's own (FSDP2's sync flag).
    from lightning.fabric import Fabric
    from lightning.fabric.strategies.model_parallel import _ParallelBackwardSyncControl
    from lightning.fabric.strategies.strategy import _BackwardSyncControl

    from lightning_accum.fabric_model_parallel import BackwardSyncNotes

    assert "self._strategy._backward_sync_control.no_backward_sync(" in inspect.getsource(Fabric.no_backward_sync)
    strategy = Fabric(strategy="accum_fsdp", devices=2, accelerator="cpu").strategy
    control = strategy._backward_sync_control
    assert isinstance(control, BackwardSyncNotes) and isinstance(control, _BackwardSyncControl)
    assert isinstance(control.control, _ParallelBackwardSyncControl)
    with control.no_backward_sync(torch.nn.Linear(1, 1), enabled=True):  # no FSDP2 module in it: Fabric's no-op
        assert control.blocking
    assert not control.blocking


def test_torch_schedulers_keep_their_step_counters_where_axis_lr_saves_them() -> None:
    # AxisLR's state_dict saves LRScheduler._step_count and _last_lr (torch's own state_dict holds them too).
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    scheduler = AxisLR(optimizer, axis="tokens", lr_lambda=lambda tokens: 1.0)
    assert scheduler._step_count == 1  # torch's constructor steps once
    assert scheduler._last_lr == [0.5]
    plain = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    assert {"_step_count", "_last_lr"} <= set(plain.state_dict())


def test_gradscalers_fused_kernel_checks_and_multiplies_as_the_close_relies_on() -> None:
    # `torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale)` (gradients.rescale_gradients): a 0-d
    # float32 `found` is set where a NaN or an Inf (either sign) was seen before multiplying, for every floating dtype
    # the close passes; a float32 factor of 1 leaves the gradients bit for bit as they are (the check alone: float64
    # gradients, and a group of one micro-batch on one replica); another factor multiplies as `_foreach_mul_` by the
    # float32 factor does (gradients up to 32 bits).
    one = torch.ones((), dtype=torch.float32)
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        grads = [torch.randn(300, dtype=dtype), torch.tensor([-0.0, 2.5], dtype=dtype)]
        before = [g.clone() for g in grads]
        found = torch.zeros((), dtype=torch.float32)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
        assert found.item() == 0.0
        assert all(
            torch.equal(g, b) and torch.equal(g.signbit(), b.signbit()) for g, b in zip(grads, before, strict=True)
        )
        for bad in (float("nan"), float("inf"), -float("inf")):
            grads[1][0] = bad
            found = torch.zeros((), dtype=torch.float32)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
            assert found.item() == 1.0, (dtype, bad)
        if dtype != torch.float64:
            grads = [torch.randn(300, dtype=dtype)]
            factor = torch.tensor(1 / 3, dtype=torch.float32)
            expected = [g.clone() for g in grads]
            torch._foreach_mul_(expected, factor)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, torch.zeros((), dtype=torch.float32), factor)
            assert torch.equal(grads[0], expected[0]), dtype


def _calls(source: str) -> list[str]:
    """The calls of a method body in order, without their arguments."""
    body = source.split('"""')[-1] if source.count('"""') >= 2 else source
    return re.findall(r"(self(?:\.\w+)+)\(", body)


def test_the_slicers_protected_backward_is_lightnings_strategy_backward() -> None:
    # BatchSlicer.backward runs the body of Lightning's `Strategy.backward` with the backward itself protected
    # (microbatch_size="auto"): the same calls in the same order, or the slicer's copy is out of date.
    lightning = _calls(inspect.getsource(Strategy.backward))
    assert lightning == [
        "self.pre_backward",
        "self.precision_plugin.pre_backward",
        "self.precision_plugin.backward",
        "self.precision_plugin.post_backward",
        "self.post_backward",
    ]
    from lightning_accum.strategies.slicing import BatchSlicer

    ours = re.findall(r"strategy((?:\.\w+)+)\(", inspect.getsource(BatchSlicer.backward))
    copied = [f"self{name}" for name in ours if name.split(".")[-1] in {"pre_backward", "backward", "post_backward"}]
    assert copied == lightning


def test_lightning_decides_a_groups_end_and_start_in_the_two_methods_the_boundaries_answer() -> None:
    # Lightning decides a group's end in `_TrainingEpochLoop._accumulated_batches_reached()` (read by
    # `_should_accumulate`: the optimizer step, DDP's `no_sync`, step-interval schedulers, `_batches_that_stepped`,
    # logging) and its start in `_AutomaticOptimization._make_zero_grad_fn(batch_idx, optimizer)` (from
    # `_make_closure`), whose function runs `_on_before_zero_grad` then `_optimizer_zero_grad` unless `_skip_backward`:
    # GroupBoundaries answers both, and builds that function at a group's first batch.
    import lightning as L
    from helpers import EXAMPLES_FOR_GROUPING, ListDataset, TinyLM
    from lightning.pytorch.loops.optimization.automatic import _AutomaticOptimization
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
    from torch.utils.data import DataLoader

    from lightning_accum.strategies.group_boundaries import GroupBoundaries

    def parameters(method: object) -> list[str]:
        return list(inspect.signature(method).parameters)  # type: ignore[arg-type]

    assert parameters(_TrainingEpochLoop._accumulated_batches_reached) == ["self"]
    assert parameters(_AutomaticOptimization._make_zero_grad_fn) == ["self", "batch_idx", "optimizer"]
    assert parameters(_AutomaticOptimization._on_before_zero_grad) == ["self", "optimizer"]
    assert parameters(_AutomaticOptimization._optimizer_zero_grad) == ["self", "batch_idx", "optimizer"]
    assert "self._accumulated_batches_reached()" in inspect.getsource(_TrainingEpochLoop._should_accumulate)
    assert "self._make_zero_grad_fn(batch_idx, optimizer)" in inspect.getsource(_AutomaticOptimization._make_closure)
    lightnings = inspect.getsource(_AutomaticOptimization._make_zero_grad_fn)
    assert "if self._skip_backward:" in lightnings
    assert _calls(lightnings) == ["self._on_before_zero_grad", "self._optimizer_zero_grad"]
    ours = re.findall(r"steps\.(_\w+)\(", inspect.getsource(GroupBoundaries._zero_grad_fn))
    assert ours == ["_on_before_zero_grad", "_optimizer_zero_grad"]

    class Told(L.Callback):  # groups [0], [1, 2, 3], [4, 5, 6] on Lightning's own strategy
        def __init__(self) -> None:
            self.groups = GroupBoundaries()
            self.zeroed: list[int] = []
            self.stepped: list[int] = []

        def on_train_start(self, trainer: L.Trainer, *args: object) -> None:
            self.groups.install(trainer, lambda batch, batch_idx, resumed: 1 if batch_idx == 0 else 3)

        def on_train_batch_start(self, trainer: L.Trainer, module: object, batch: object, batch_idx: int) -> None:
            if not 0 <= batch_idx - self.groups.first < self.groups.size:
                self.groups.begin(trainer, batch, batch_idx)

        def on_train_end(self, trainer: L.Trainer, *args: object) -> None:
            self.groups.release(trainer)

        def on_before_zero_grad(self, trainer: L.Trainer, *args: object) -> None:
            self.zeroed.append(trainer.fit_loop.epoch_loop.batch_idx)

        def on_before_optimizer_step(self, trainer: L.Trainer, *args: object) -> None:
            self.stepped.append(trainer.fit_loop.epoch_loop.batch_idx)

    told = Told()
    trainer = make_trainer(strategy="auto", callbacks=[told])
    trainer.fit(TinyLM(), DataLoader(ListDataset(EXAMPLES_FOR_GROUPING), batch_size=1))
    assert (told.stepped, told.zeroed) == ([0, 3, 6], [0, 1, 4])
    assert "_accumulated_batches_reached" not in vars(trainer.fit_loop.epoch_loop)


def test_lightning_opens_mixed_precision_autocast_in_forward_context() -> None:
    # AccumulationCheck's float32 passes replace the plugin's `forward_context` on the instance (callbacks/check.py's
    # `_float32_compute`): Lightning's strategy enters `precision_plugin.train_step_context()` around the step, which
    # enters `forward_context()`, where `MixedPrecision` opens its autocast region (through `autocast_context_manager`
    # up to 2.6, by itself from 2.7: Lightning's PR #21616). Should Lightning open it anywhere else, the check's
    # passes would run in 16 bits again, silently.
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_accum.callbacks.check import _float32_compute

    assert "self.precision_plugin.train_step_context()" in inspect.getsource(Strategy.training_step)
    for precision, dtype in (("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16)):
        strategy = AccumulationStrategy(precision_plugin=MixedPrecision(precision, "cpu"))
        with strategy.precision_plugin.train_step_context():
            assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == dtype
        with _float32_compute(strategy), strategy.precision_plugin.train_step_context():
            assert not torch.is_autocast_enabled("cpu")
            assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
        assert "forward_context" not in vars(strategy.precision_plugin)


def test_lightning_takes_remote_checkpoint_paths_where_the_package_says_it_does(tmp_path: Path) -> None:
    # core/reading.py reads whether Lightning's model-parallel strategies take fsspec URLs from the presence of
    # `lightning.fabric.utilities.cloud_io._resolve_path`, which they resolve every path through from 2.7 (2.6 makes a
    # local `Path` of it): the two must agree for the Trainer's strategy and Fabric's.
    from lightning.fabric.strategies import model_parallel as fabric_model_parallel
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_accum.core.reading import LIGHTNING_TAKES_REMOTE_FOLDERS

    for source in (
        inspect.getsource(ModelParallelStrategy.save_checkpoint),
        inspect.getsource(fabric_model_parallel.ModelParallelStrategy.save_checkpoint),
    ):
        assert ("_resolve_path(" in source) == LIGHTNING_TAKES_REMOTE_FOLDERS
    # torch's fsspec reader of a distributed checkpoint (the package reads an open group's stored dtypes and shapes
    # from a remote folder with it, as Lightning's `_get_distributed_checkpoint_reader` does).
    from torch.distributed.checkpoint import FileSystemWriter, save

    from lightning_accum.core.reading import fsspec_reader

    FsspecReader = fsspec_reader()  # the public module where torch has it (2.15), the private one before
    with warnings.catch_warnings():  # torch says it saves in one process (no process group here)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        save({"g": torch.ones(3, dtype=torch.float64)}, storage_writer=FileSystemWriter(tmp_path))
    stored = FsspecReader(f"file://{tmp_path}").read_metadata().state_dict_metadata["g"]
    assert tuple(stored.size) == (3,) and stored.properties.dtype == torch.float64


def test_every_guard_named_in_the_private_names_table_exists() -> None:
    section = (ROOT / "docs" / "internals.md").read_text().split("## Private names the package relies on", 1)[1]
    named = re.findall(r"`(tests/[\w/]+\.py|benchmarks/[\w/]+\.py)::(\w+)", section)
    assert len(named) > 10
    missing = [f"{path}::{test}" for path, test in named if f"def {test}(" not in (ROOT / path).read_text()]
    assert not missing, missing


def test_lightnings_and_fabrics_update_dataloader_recreate_a_loader_around_another_sampler() -> None:
    # `global_order=True` re-creates the training loader with a GlobalOrderSampler through the helper Lightning and
    # Fabric use to inject their distributed sampler: the loader's class and arguments kept, the sampler replaced.
    from lightning.fabric.utilities.data import _update_dataloader as fabrics
    from lightning.pytorch.trainer.states import RunningStage
    from lightning.pytorch.utilities.data import _update_dataloader as lightnings
    from torch.utils.data import DataLoader

    from lightning_accum import GlobalOrderSampler

    class Loader(DataLoader):  # type: ignore[type-arg]
        pass

    data = list(range(10))
    sampler = GlobalOrderSampler(data, num_replicas=2, rank=1, shuffle=False)
    for made in (lightnings(Loader(data, batch_size=3, shuffle=True), sampler, mode=RunningStage.TRAINING),
                 fabrics(Loader(data, batch_size=3, shuffle=True), sampler)):  # fmt: skip
        assert type(made) is Loader and made.sampler is sampler and made.batch_size == 3
        assert [b.tolist() for b in made] == [[1, 3, 5], [7, 9]]


def test_lightning_counts_an_epochs_batches_where_token_groups_set_them() -> None:
    # `token_batches=` sets each epoch's count from its order's `set_epoch`, which `_FitLoop.on_advance_start` calls
    # (`_set_sampler_epoch`, on `batch_sampler.sampler`) after its data set-up and before `on_train_epoch_start`:
    # `fit_loop.max_batches` (`num_training_batches`: the epoch's end, the progress bars), the limit of
    # `fit_loop._combined_loader` (the length the data fetcher counts an epoch by) and `trainer.val_check_batch`.
    import lightning as L
    from helpers import EvalLM, ListDataset, make_examples, random_lengths
    from lightning.fabric.utilities.data import _set_sampler_epoch
    from lightning.pytorch.loops.fetchers import _DataFetcher
    from lightning.pytorch.loops.fit_loop import _FitLoop
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
    from torch.utils.data import DataLoader

    from lightning_accum import TokenBatches
    from lightning_accum.strategies.token_groups import TokenGroups

    start = inspect.getsource(_FitLoop.on_advance_start)
    assert start.index("_set_sampler_epoch(") < start.index('"on_train_epoch_start"')
    assert "batch_sampler" in inspect.getsource(_set_sampler_epoch)
    setup = inspect.getsource(_FitLoop.setup_data)
    assert "combined_loader.limits = limits" in setup and "self._combined_loader = combined_loader" in setup
    assert "return self.fit_loop.max_batches" in inspect.getsource(L.Trainer.num_training_batches.fget)  # type: ignore[attr-defined]
    assert "self.trainer.num_training_batches" in inspect.getsource(_TrainingEpochLoop._num_ready_batches_reached)
    assert "self.trainer.val_check_batch" in inspect.getsource(_TrainingEpochLoop._should_check_val_fx)
    assert "sized_len(self.combined_loader)" in inspect.getsource(_DataFetcher.reset)

    class Seen(L.Callback):  # on Lightning's own strategy: each epoch's length, and where validation ran
        def __init__(self) -> None:
            self.ran: list[int] = []
            self.counts: list[int] = []
            self.validated: list[tuple[int, int]] = []

        def on_train_epoch_start(self, trainer: L.Trainer, *args: object) -> None:
            self.ran.append(0)
            self.counts.append(trainer.num_training_batches)

        def on_train_batch_start(self, *args: object) -> None:
            self.ran[-1] += 1

        def on_validation_start(self, trainer: L.Trainer, *args: object) -> None:
            self.validated.append((trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_idx))

    examples = make_examples(random_lengths(40, seed=3), seed=3)
    lengths = [int((e["labels"] != -100).sum()) for e in examples]
    seen = Seen()
    trainer = make_trainer(strategy="auto", max_epochs=3, callbacks=[seen], val_check_interval=1.0)
    loader = TokenGroups(TokenBatches(8, lengths)).install(DataLoader(ListDataset(examples), 4, True), trainer, None)
    trainer.fit(EvalLM(), loader, DataLoader(ListDataset(examples[:4]), batch_size=4))
    assert len(set(seen.ran)) > 1 and seen.ran == seen.counts  # epochs of different lengths, each run whole
    assert seen.validated == [(epoch, n - 1) for epoch, n in enumerate(seen.ran)]  # at each epoch's end
