"""The Fabric door's silent cases, each now exact or a clear error at the point of the mistake: a checkpoint loaded
without a state object, a group declared of one, a CheckpointIO of its own, and `AxisLR` without a strategy (the
rules of the manual API shared with the Trainer's door are in tests/test_rulebook.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import IGNORE, params_vector, sgd_reference
from test_fabric import EXAMPLES, LR, TinyNet, _groups, _model_and_optimizer, micro_batches, train

from lightning_accum import AxisLR


def _fabric() -> L.Fabric:
    return L.Fabric(strategy="accum", accelerator="cpu")


def _loss(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(batch["input_ids"])
    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE)
    return loss, (batch["labels"] != IGNORE).sum()


def test_a_checkpoint_loaded_without_a_state_object_resumes_the_ledger_and_the_open_group(tmp_path: Path) -> None:
    m, accumulate, stop = 2, 4, 6  # saved after 2 of the second group's 4 micro-batches
    path = tmp_path / "mid.ckpt"
    fabric = _fabric()
    model, optimizer = fabric.setup(*_model_and_optimizer())
    train(fabric, model, optimizer, micro_batches(EXAMPLES, m), accumulate, stop=stop)
    fabric.save(path, {"model": model, "optimizer": optimizer})

    fabric = _fabric()
    model, optimizer = fabric.setup(*_model_and_optimizer(seed=99))
    checkpoint = fabric.load(path)  # no state object: the user restores the weights from what is returned
    assert "lightning_accum" not in checkpoint  # the package's entry was consumed: the loop resumes
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    train(fabric, model, optimizer, micro_batches(EXAMPLES, m), accumulate, start=stop)
    reference = sgd_reference(TinyNet(), _groups(EXAMPLES, 8), lr=LR)
    # Before: the ledger restarted and the open group was lost (2.9e-2 from the reference in the probe).
    torch.testing.assert_close(params_vector(model), reference, rtol=0, atol=1e-12)
    assert (fabric.strategy.ledger.updates_applied, fabric.strategy.ledger.samples) == (3, 24)


def test_axis_lr_without_a_strategy_says_the_fabric_way() -> None:
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scheduler = AxisLR(optimizer, axis="tokens", lr_lambda=lambda tokens: 1.0)
    optimizer.step()
    with pytest.raises(RuntimeError, match=r"In a Fabric loop: `L.Fabric\(strategy='accum'\)`"):
        scheduler.step()


def _a_loop_at_one_micro_batch_per_update(strategy: str, group_size: int | None) -> torch.Tensor:
    """Six AdamW updates of a float32 model, one micro-batch each: with `"accum"` through `accumulate` and
    `close_group`, else the plain loop (`fabric.backward(loss)`)."""
    fabric = L.Fabric(strategy=strategy, accelerator="cpu")
    model = TinyNet().to(torch.float32)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for batch in micro_batches(EXAMPLES, 4):
        loss, tokens = _loss(model, batch)
        if strategy == "accum":
            fabric.backward(fabric.strategy.accumulate(loss, num_tokens=tokens, group_size=group_size))
            fabric.strategy.close_group(optimizer)
        else:
            fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return params_vector(model)


def test_group_size_one_is_the_plain_loop_bit_for_bit() -> None:
    plain = _a_loop_at_one_micro_batch_per_update("auto", None)
    # `group_size=1` declares the group's only micro-batch: c = w, the loss back-propagated as it is, the close's
    # factor exactly 1 (before: 2.4e-7 from the plain loop after six float32 updates, as without `group_size`).
    assert torch.equal(_a_loop_at_one_micro_batch_per_update("accum", 1), plain)


def test_the_one_device_strategies_take_the_device_first_as_lightnings_do() -> None:
    from lightning.fabric.accelerators import CPUAccelerator

    from lightning_accum import AccumulationStrategy, DDPAccumulationStrategy, FabricAccumulationStrategy

    # Before: a device passed positionally was taken as `normalize`, and a strategy given an accelerator instance was
    # refused by Fabric's connector ("accelerator set through both strategy class and accelerator flag").
    strategy = FabricAccumulationStrategy(torch.device("cpu"), accelerator=CPUAccelerator())
    fabric = L.Fabric(strategy=strategy, devices=2)  # as Fabric's SingleDeviceStrategy: the given device is kept
    assert fabric.strategy is strategy and fabric.strategy.root_device == torch.device("cpu")
    assert strategy.engine.normalize == "auto"
    assert AccumulationStrategy("cpu").root_device == torch.device("cpu")
    with pytest.raises(TypeError, match="positional argument"):  # the options are by name: never taken silently
        DDPAccumulationStrategy("tokens")  # type: ignore[misc]


def test_a_checkpoint_io_that_returns_no_mapping_is_returned_as_fabric_returns_it(tmp_path: Path) -> None:
    from lightning.fabric.plugins import TorchCheckpointIO

    class Records(TorchCheckpointIO):
        """A user's CheckpointIO whose files hold a list of records, not a state mapping."""

        def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Any = None) -> Any:
            return [("step", 3), ("loss", 0.5)]

    fabric = L.Fabric(strategy="accum", accelerator="cpu", plugins=[Records()])
    # Before: `TypeError: argument of type 'list' is not iterable`-like failures from looking for the package's entry.
    assert fabric.load(tmp_path / "records.bin") == [("step", 3), ("loss", 0.5)]
    assert fabric.strategy.ledger.updates_applied == 0
