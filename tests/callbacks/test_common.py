"""callbacks/common: the callbacks' one error for a Trainer without an accumulation strategy, and what it suggests."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import ListDataset, TinyLM, make_examples, make_trainer
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from strategies.test_model_parallel import ShardedLM
from torch.utils.data import DataLoader

from lightning_accum import AccumulationReport, AxisLogger
from lightning_accum.callbacks.common import unsupported_strategy_hint


def test_requires_an_accumulation_strategy(tmp_path: Path) -> None:
    trainer = make_trainer(strategy="auto", callbacks=[AxisLogger()])
    with pytest.raises(RuntimeError, match=r"AxisLogger needs an accumulation strategy.*strategy='accum'"):
        trainer.fit(TinyLM(), DataLoader(ListDataset(make_examples([2, 3])), batch_size=1))


def test_lightning_sharding_strategies_with_the_callbacks_name_what_is_supported_instead() -> None:
    # Lightning refuses FSDP1 on the CPU, so its sentence is checked directly; the callbacks append it.
    fsdp1 = unsupported_strategy_hint(FSDPStrategy())
    assert "FSDPStrategy (FSDP1) is not supported: use strategy='accum_fsdp'" in fsdp1
    trainer = make_trainer(strategy=ModelParallelStrategy())
    for callback in (AxisLogger(), AccumulationReport()):
        with pytest.raises(RuntimeError, match=r"use ModelParallelAccumulationStrategy \(strategy='accum_fsdp' or"):
            callback.setup(trainer, ShardedLM(), "fit")
