"""Which devices exact accumulation runs on: the float64 requirement, decided by the device's type (no MPS needed)."""

from __future__ import annotations

import pytest
import torch

from lightning_accum.devices import require_float64
from lightning_accum.engine import AccumulationEngine

MESSAGE = r"needs float64 on the training device, and device 'mps:?\d*' \(Apple's MPS\) has none: .*accelerator=\"cpu\""


@pytest.mark.parametrize("device", [torch.device("mps"), torch.device("mps", 0), "mps:1"])
def test_a_device_without_float64_is_refused_naming_it_and_the_way_out(device: torch.device | str) -> None:
    with pytest.raises(RuntimeError, match=MESSAGE) as raised:
        require_float64(device)
    assert repr(str(torch.device(device))) in str(raised.value) and "CUDA GPU" in str(raised.value)


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:1", torch.device("meta")])
def test_devices_with_float64_pass_without_being_allocated_on(device: torch.device | str) -> None:
    require_float64(device)  # "cuda:1" on a machine without a GPU: decided by the type, nothing allocated


def test_the_engine_refuses_the_device_when_it_is_bound_before_any_micro_batch() -> None:
    # The strategies bind the engine in their set-up (Trainer: `setup`; Fabric: `setup_environment`, `setup_module`):
    # the error comes there, not once training has started.
    engine = AccumulationEngine(normalize="tokens")
    with pytest.raises(RuntimeError, match=MESSAGE):
        engine.bind(torch.device("mps"))
    assert engine.microbatches_in_group == 0 and engine.ledger.updates_applied == 0
    engine.bind("cpu")  # a supported device binds as before
    assert engine.device == torch.device("cpu")
