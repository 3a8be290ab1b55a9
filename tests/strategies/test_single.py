"""strategies/single: strategy='accum' is one device's, and names the DDP string for several."""

from __future__ import annotations

import pytest
from helpers import make_trainer

import lightning_accum  # noqa: F401  (registers the strategy strings)


def test_accum_on_several_devices_names_the_ddp_string() -> None:
    with pytest.raises(ValueError, match=r"strategy='accum' runs on one device.*'accum_ddp'"):
        make_trainer(strategy="accum", devices=2)
