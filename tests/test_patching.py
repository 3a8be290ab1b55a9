"""What the package borrows it gives back: `lightning_accum.patching.InstancePatch`, and after every Trainer entry
point (an exception in it included) the module, the progress bar, the precision plugin, the loggers and the
optimizers hold exactly what they held before, with the package's callbacks attached and a user's own
instance-level hooks in place."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import EvalLM, ListDataset, make_examples, make_trainer, reference_loss
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_accum import AccumulationCheck, AccumulationReport, AxisLogger, Horizon
from lightning_accum.patching import InstancePatch, patched


class Bar:
    def get_metrics(self) -> dict[str, int]:
        return {"a": 1}


def _adds(key: str) -> Callable[..., dict[str, int]]:
    return lambda below: {**below(), key: 1}


def test_a_patch_gives_back_what_the_instance_held_or_nothing() -> None:
    bar = Bar()
    with patched(bar, "get_metrics", _adds("b")):
        assert bar.get_metrics() == {"a": 1, "b": 1}
    assert "get_metrics" not in vars(bar)  # the class's method again, nothing left on the instance

    def own() -> dict[str, int]:
        return {"own": 1}

    bar.get_metrics = own  # type: ignore[method-assign]  # a user's instance-level hook
    patch = InstancePatch(bar, "get_metrics", _adds("b"))
    assert bar.get_metrics() == {"own": 1, "b": 1}  # wraps the instance's hook, not the class's method
    patch.release()
    patch.release()  # a second release does nothing
    assert vars(bar)["get_metrics"] is own


def test_releasing_the_lower_of_two_patches_removes_only_it() -> None:
    bar = Bar()
    lower = InstancePatch(bar, "get_metrics", _adds("lower"))
    upper = InstancePatch(bar, "get_metrics", _adds("upper"))
    lower.release()
    assert bar.get_metrics() == {"a": 1, "upper": 1}  # the upper one now wraps the class's method
    upper.release()
    assert "get_metrics" not in vars(bar)


def test_under_a_foreign_wrapper_a_released_patch_passes_through() -> None:
    bar = Bar()
    ours = InstancePatch(bar, "get_metrics", _adds("ours"))
    theirs = bar.get_metrics
    bar.get_metrics = lambda: {**theirs(), "theirs": 1}  # type: ignore[method-assign]  # not an InstancePatch
    ours.release()
    assert bar.get_metrics() == {"a": 1, "theirs": 1}  # nothing of ours runs, nothing is lost
    bar.get_metrics = theirs  # type: ignore[method-assign]  # they restore what they found
    assert bar.get_metrics() == {"a": 1}


def test_a_patch_without_wrapping_replaces_the_call() -> None:
    bar = Bar()
    with patched(bar, "get_metrics", lambda: {"z": 0}, wraps=False):
        assert bar.get_metrics() == {"z": 0}
    assert bar.get_metrics() == {"a": 1}


# ---------------------------------------------------------------------- the Trainer's entry points

LENGTHS = [6, 1, 1, 5, 2, 6, 1, 4, 6, 1, 3, 6]


class HookedLM(EvalLM):
    """EvalLM with the instance-level hooks notebooks and wrapper libraries set in `__init__`, and a switch that
    raises inside each entry point."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calls: list[str] = []
        self.fail_in: str | None = None
        self.on_validation_epoch_end = lambda: self.calls.append("val_end")  # type: ignore[method-assign]
        self.on_test_epoch_end = lambda: self.calls.append("test_end")  # type: ignore[method-assign]
        self.lr_scheduler_step = lambda scheduler, metric: scheduler.step()  # type: ignore[method-assign]

    def _maybe_fail(self, stage: str) -> None:
        if self.fail_in == stage:
            raise RuntimeError(f"planted failure in {stage}")

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self._maybe_fail("fit")
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        self._maybe_fail("validate")
        return super().validation_step(batch, batch_idx, dataloader_idx)

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        self._maybe_fail("test")
        return super().test_step(batch, batch_idx)

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        self._maybe_fail("predict")
        return self(batch["input_ids"])

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _instance_state(trainer: Any, module: HookedLM) -> dict[str, Any]:
    """The callables in `vars()` of everything the package may wrap a method on (compared with `==`: the same function
    object, or a bound method of the same function on the same object, as Lightning binds a callback's `log` anew at
    every entry point; a copy or a wrapper left behind differs)."""
    objects = {
        "module": module,
        "bar": trainer.progress_bar_callback,
        "precision": trainer.strategy.precision_plugin,
        **{f"logger{i}": logger for i, logger in enumerate(trainer.loggers)},
        **{f"optimizer{i}": optimizer for i, optimizer in enumerate(trainer.optimizers)},
    }
    return {
        name: {key: value for key, value in vars(obj).items() if callable(value) and not isinstance(value, type)}
        for name, obj in objects.items()
    }


@pytest.mark.parametrize("fail", [False, True], ids=["returns", "raises"])
def test_every_entry_point_gives_back_the_instances_it_touched(tmp_path: Any, fail: bool) -> None:
    examples = make_examples(LENGTHS, seed=5)
    loader = DataLoader(ListDataset(examples), batch_size=3)
    module = HookedLM()
    trainer = make_trainer(
        accumulate_grad_batches=2,
        max_epochs=-1,
        enable_progress_bar=True,
        logger=CSVLogger(tmp_path),
        limit_val_batches=2,
        callbacks=[
            TQDMProgressBar(refresh_rate=0),
            AxisLogger(),
            AccumulationReport(path=tmp_path / "report.json"),
            AccumulationCheck(),
            Horizon(stop_at=60, validate_every=20),
        ],
    )
    own_hooks = {name: vars(module)[name] for name in ("on_validation_epoch_end", "on_test_epoch_end")}
    runs: list[tuple[str, Callable[[], Any]]] = [
        ("fit", lambda: trainer.fit(module, loader, loader)),
        ("validate", lambda: trainer.validate(module, loader)),
        ("test", lambda: trainer.test(module, loader)),
        ("predict", lambda: trainer.predict(module, loader)),
    ]
    for stage, run in runs:
        before = _instance_state(trainer, module) if stage != "fit" else None
        module.fail_in = stage if fail else None
        if fail:
            with pytest.raises(RuntimeError, match=f"planted failure in {stage}"):
                run()
        else:
            run()
        after = _instance_state(trainer, module)
        if before is not None:
            assert after == before, stage
        for name, hook in own_hooks.items():
            assert vars(module)[name] is hook, (stage, name)  # the user's own hook, the same object
        assert "lr_scheduler_step" in vars(module)  # the user's instance-level hook is still there...
        assert vars(module)["lr_scheduler_step"].__name__ == "<lambda>"  # ...and is the user's lambda
        bar = trainer.progress_bar_callback
        assert "get_metrics" not in vars(bar)
        assert not {"clip_grad_by_norm", "clip_grad_by_value", "forward_context"} & set(
            vars(trainer.strategy.precision_plugin)
        )
        assert not {"log", "log_dict"} & set(vars(module))
        assert all("log_metrics" not in vars(logger) for logger in trainer.loggers)
    if not fail:
        assert module.calls.count("val_end") >= 2 and module.calls.count("test_end") == 1


def test_an_instance_level_epoch_end_hook_gives_each_validation_its_own_loss() -> None:
    """Three validations on one Trainer, the weights changed after the first: `accum/val_loss` is each loop's own
    token-weighted loss (a wrapper left on the instance made it a running mean of the loops: 2.5811, 2.5919,
    2.5956 against 2.5811, 2.6028, 2.6028 in the issue's repro)."""
    examples = make_examples(LENGTHS, seed=6)
    loader = DataLoader(ListDataset(examples), batch_size=4)
    module = HookedLM()
    trainer = make_trainer()
    values, expected = [], []
    for round_ in range(3):
        if round_ == 1:
            with torch.no_grad():
                module.head.weight.mul_(1.5)
        expected.append(reference_loss(module, examples))
        values.append(trainer.validate(module, loader, verbose=False)[0]["accum/val_loss"])
    assert values == pytest.approx(expected, rel=2e-7)
    assert expected[1] != pytest.approx(expected[0], rel=1e-3)  # the weights did change the loss
