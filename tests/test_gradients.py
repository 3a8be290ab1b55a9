"""The gradient kernels: the close's rescale in the gradients' dtype (float64 for float64 gradients, float32 rounded
once for half precision), its NaN/Inf check, and the replicas' summed gradient keeping its dtype."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from lightning_accum.gradients import rescale_gradients, scale_gradients, summed_gradients

FACTOR = 60 / 45  # c · D / W of a group: not a float32 number


def _gradients(dtype: torch.dtype) -> list[Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(7, generator=generator).to(dtype), torch.randn(3, 2, generator=generator).to(dtype)]


def _expected(gradients: list[Tensor], dtype: torch.dtype) -> list[Tensor]:
    """One rounding: float64 gradients times the float64 factor; the others in float32 by the float32 factor."""
    if dtype == torch.float64:
        return [g * FACTOR for g in gradients]
    factor = torch.tensor(FACTOR, dtype=torch.float32)
    return [(g.float() * factor).to(dtype) for g in gradients]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("as_tensor", [False, True])
@pytest.mark.parametrize("check", [False, True])
def test_the_rescale_multiplies_in_the_gradients_dtype(dtype: torch.dtype, as_tensor: bool, check: bool) -> None:
    gradients = _gradients(dtype)
    expected = _expected(gradients, dtype)
    factor = torch.tensor(FACTOR, dtype=torch.float64) if as_tensor else FACTOR
    found = rescale_gradients(gradients, factor, check)
    assert (found is not None) == check and (found is None or found.item() == 0.0)
    for got, want in zip(gradients, expected, strict=True):
        assert torch.equal(got, want), (dtype, as_tensor, check)
    if dtype == torch.float64:  # not the float32 factor's product, which is 1e-8 off
        rounded = float(torch.tensor(FACTOR, dtype=torch.float32))
        assert not torch.equal(gradients[0], _gradients(dtype)[0] * rounded)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_scale_gradients_rounds_as_the_close_does(dtype: torch.dtype) -> None:
    parameters = [torch.nn.Parameter(torch.zeros_like(g)) for g in _gradients(dtype)]
    for p, g in zip(parameters, _gradients(dtype), strict=True):
        p.grad = g
    scale_gradients([*parameters, torch.nn.Parameter(torch.zeros(2))], FACTOR)  # one without a gradient
    for p, want in zip(parameters, _expected(_gradients(dtype), dtype), strict=True):
        assert torch.equal(p.grad, want), dtype


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_a_factor_of_one_only_checks_and_finds_a_nan(dtype: torch.dtype) -> None:
    gradients = _gradients(dtype)
    before = [g.clone() for g in gradients]
    assert rescale_gradients(gradients, 1.0, check=False) is None
    found = rescale_gradients(gradients, 1.0, check=True)
    assert found is not None and found.item() == 0.0
    assert all(torch.equal(g, b) for g, b in zip(gradients, before, strict=True))
    gradients[1][0, 0] = float("nan")
    found = rescale_gradients(gradients, torch.tensor(FACTOR, dtype=torch.float64), check=True)
    assert found is not None and found.item() > 0


def test_the_summed_gradient_keeps_each_parameters_dtype() -> None:
    wide, narrow = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64)), torch.nn.Parameter(torch.zeros(2))
    wide.grad, narrow.grad = torch.full((3,), FACTOR, dtype=torch.float64), torch.ones(2)
    summed = summed_gradients([("wide", wide), ("narrow", narrow), ("none", torch.nn.Parameter(torch.zeros(1)))], None)
    assert set(summed) == {"wide", "narrow"} and (summed["wide"].dtype, summed["narrow"].dtype) == (
        wide.dtype,
        narrow.dtype,
    )
    assert torch.equal(summed["wide"], wide.grad) and torch.equal(summed["narrow"], narrow.grad)
