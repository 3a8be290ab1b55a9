"""``SliceGradients``: a sliced batch's gradients kept aside across Lightning's ``zero_grad`` and put back added, and a
protected backward that adds its fresh gradient once it completed or leaves the accumulated one as it was."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from lightning_accum.strategies.slice_gradients import SliceGradients


def _model_and_optimizer() -> tuple[nn.Linear, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _gradients_of(model: nn.Module, x: Tensor) -> list[Tensor]:
    """The float64 gradient of ``model(x).square().sum()``, computed apart (the reference)."""
    return list(torch.autograd.grad(model(x).square().sum(), list(model.parameters())))


def test_the_slices_gradients_cross_lightnings_zero_grad_and_come_back_added() -> None:
    model, optimizer = _model_and_optimizer()
    stale, first, last = torch.randn(4, 3).double(), torch.randn(4, 3).double(), torch.randn(4, 3).double()
    model(stale).sum().backward()  # the previous group's gradient
    gradients = SliceGradients()
    gradients.release([optimizer])
    assert all(p.grad is None for p in model.parameters())
    model(first).square().sum().backward()  # the slices before the last, in `training_step`
    gradients.keep_aside([optimizer])
    assert all(p.grad is None for p in model.parameters())
    optimizer.zero_grad()  # Lightning's, at a group's first batch
    model(last).square().sum().backward()  # the last slice's backward
    gradients.install()
    expected = [a + b for a, b in zip(_gradients_of(model, first), _gradients_of(model, last), strict=True)]
    for p, e in zip(model.parameters(), expected, strict=True):
        assert torch.allclose(p.grad, e, rtol=1e-15, atol=0)
    gradients.install()  # nothing is kept twice
    for p, e in zip(model.parameters(), expected, strict=True):
        assert torch.allclose(p.grad, e, rtol=1e-15, atol=0)


def test_a_protected_backward_adds_its_fresh_gradient_to_the_accumulated_tensors() -> None:
    model, optimizer = _model_and_optimizer()
    earlier, later = torch.randn(4, 3).double(), torch.randn(4, 3).double()
    model(earlier).square().sum().backward()
    held = [p.grad for p in model.parameters()]
    assert SliceGradients().protected([optimizer], lambda: model(later).square().sum().backward()) is None
    expected = [a + b for a, b in zip(_gradients_of(model, earlier), _gradients_of(model, later), strict=True)]
    for p, h, e in zip(model.parameters(), held, expected, strict=True):
        assert p.grad is h and torch.allclose(p.grad, e, rtol=1e-15, atol=0)


def test_a_protected_backward_that_runs_out_of_memory_leaves_the_accumulated_gradient_as_it_was() -> None:
    model, optimizer = _model_and_optimizer()
    model(torch.randn(4, 3).double()).square().sum().backward()
    before = [p.grad.clone() for p in model.parameters()]

    def backward_that_fails_half_way() -> None:
        model.weight.grad = torch.full_like(model.weight, 7.0)  # what the failed backward had written
        raise torch.OutOfMemoryError("injected: out of memory half-way")

    error = SliceGradients().protected([optimizer], backward_that_fails_half_way)
    assert isinstance(error, torch.OutOfMemoryError) and error.__traceback__ is None
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before, strict=True))

    def backward_with_another_error() -> None:
        model.weight.grad = None
        raise ValueError("not an out-of-memory error")

    with pytest.raises(ValueError, match="not an out-of-memory error"):
        SliceGradients().protected([optimizer], backward_with_another_error)
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before, strict=True))


def test_the_parameters_are_each_read_once_and_again_when_a_parameter_group_is_added() -> None:
    model, optimizer = _model_and_optimizer()
    other = torch.optim.SGD([model.bias], lr=0.1)  # a parameter two optimizers hold
    gradients = SliceGradients()
    assert gradients.params([optimizer, other]) == [model.weight, model.bias]
    head = nn.Parameter(torch.zeros(2, dtype=torch.float64))
    optimizer.add_param_group({"params": [head]})  # e.g. BackboneFinetuning unfreezing a layer
    assert gradients.params([optimizer, other]) == [model.weight, model.bias, head]
