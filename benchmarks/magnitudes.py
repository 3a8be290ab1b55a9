"""What each micro-batch back-propagates, relative to Lightning's ``loss / A``, for skewed group sizes.

A micro-batch with unit loss back-propagates ``w / c`` under the package and ``1 / A`` under Lightning, so the
ratio is ``A · w / c``. This compares the engine's ``c`` (``A · M``, see ``lightning_accum/engine.py``) with the
rule it replaced (``c`` = the previous group's units per replica; the first group ``A`` × its first micro-batch's
weight) on one device, for the distributions of the fp16 tests. Pure arithmetic on the real engine: no model.

    python benchmarks/magnitudes.py            # prints the markdown table kept in docs/concepts.md
"""

from __future__ import annotations

import statistics

import torch

from lightning_accum.engine import AccumulationEngine


def distributions() -> dict[str, list[list[int]]]:
    """Groups (A = 4 micro-batches of m = 2 sequences) as lists of per-micro-batch token counts."""
    gen = torch.Generator().manual_seed(0)
    bimodal = [[1, 0, 0, 0] if g % 2 == 0 else [64] * 4 for g in range(200)]
    draws = torch.exp(3.0 + 1.5 * torch.randn(200 * 8, generator=gen)).clamp(1, 4096).round().int().tolist()
    lognormal = [[draws[8 * g + 2 * i] + draws[8 * g + 2 * i + 1] for i in range(4)] for g in range(200)]
    steady = [[64] * 4 for _ in range(200)]
    return {"equal lengths": steady, "bimodal (1 token / 4 × 64)": bimodal, "log-normal (σ = 1.5)": lognormal}


def engine_ratios(groups: list[list[int]], accumulate: int) -> list[float]:
    engine = AccumulationEngine(normalize="tokens")
    ratios = []
    for group in groups:
        for n in group:
            out = engine.add_microbatch({"loss": torch.tensor(1.0), "num_tokens": torch.tensor(n)}, None, accumulate)
            assert out is not None
            ratios.append(float(out) * accumulate)
        engine.finish_group(engine.close_group(accumulate), applied=True)
    return ratios


def previous_rule_ratios(groups: list[list[int]], accumulate: int) -> list[float]:
    c: float | None = None
    ratios = []
    for group in groups:
        group_c = c if c is not None else accumulate * max(group[0], 1)
        ratios += [accumulate * n / group_c for n in group]
        units = sum(group)
        if units > 0:
            c = float(units)
    return ratios


def summary(ratios: list[float]) -> str:
    positive = sorted(r for r in ratios if r > 0)
    p99 = positive[int(0.99 * (len(positive) - 1))]
    return f"{statistics.median(positive):.3g} / {p99:.3g} / {max(positive):.3g}"


def table() -> str:
    lines = [
        "| group sizes | before: median / p99 / max | after: median / p99 / max |",
        "|---|---|---|",
    ]
    for name, groups in distributions().items():
        lines.append(f"| {name} | {summary(previous_rule_ratios(groups, 4))} | {summary(engine_ratios(groups, 4))} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
