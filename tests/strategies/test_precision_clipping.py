"""strategies/precision_clipping: the Trainer's clipping, run by the engine adapter on the group's exact gradient."""

from __future__ import annotations

import pytest
import torch
from helpers import TinyLM, fit, make_examples, params_vector, random_lengths, relative_error, token_weighted_grad

import lightning_accum  # noqa: F401  (registers the strategy strings)


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_automatic_clipping_on_one_device_clips_the_groups_exact_gradient(algorithm: str) -> None:
    # `gradient_clip_val` under automatic optimization: the precision plugin's clipping runs the engine adapter's for
    # the fit (one way to clip at both doors), on the group's token-weighted gradient. Reference: float64 by hand.
    examples = make_examples(random_lengths(8, seed=4), seed=5)
    model = TinyLM(lr=0.5, seed=6)
    start = params_vector(model).double()
    gradient = token_weighted_grad(model, examples)
    clip = {"norm": 0.05, "value": 0.01}[algorithm]
    if algorithm == "norm":
        assert gradient.norm() > clip  # the clip acts
        clipped = gradient * min(1.0, clip / (gradient.norm().item() + 1e-6))  # torch's clip_grad_norm_
    else:
        assert gradient.abs().max() > clip
        clipped = gradient.clamp(-clip, clip)
    fit(model, examples, 2, 4, precision="64-true", gradient_clip_val=clip, gradient_clip_algorithm=algorithm)
    torch.testing.assert_close(params_vector(model), start - 0.5 * clipped, rtol=0, atol=1e-12)
    assert relative_error(start - 0.5 * gradient, start - 0.5 * clipped) > 1e-3  # unclipped: another update
