"""What the callbacks share: finding the accumulation strategy, and counts to show."""

from __future__ import annotations

from lightning.pytorch import Trainer
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from lightning_accum.strategies import ExactAccumulation

__all__ = ["accumulation_strategy", "format_count", "format_rate", "unsupported_strategy_hint"]


def accumulation_strategy(trainer: Trainer, who: str) -> ExactAccumulation:
    """``trainer.strategy`` when it is an accumulation strategy, else a ``RuntimeError`` saying which to use.

    Example:
        >>> import lightning as L
        >>> accumulation_strategy(L.Trainer(accelerator="cpu", logger=False), "AxisLogger")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        RuntimeError: AxisLogger needs an accumulation strategy, but the Trainer uses SingleDeviceStrategy. Set ...
    """
    strategy = trainer.strategy
    if not isinstance(strategy, ExactAccumulation):
        raise RuntimeError(
            f"{who} needs an accumulation strategy, but the Trainer uses {type(strategy).__name__}. Set"
            " `Trainer(strategy='accum')` on one device or `strategy='accum_ddp'` (or 'accum_ddp_spawn') on several."
            + unsupported_strategy_hint(strategy)
        )
    return strategy


def format_count(value: int, unit: str = "") -> str:
    """A short count for the progress bar.

    Example:
        >>> format_count(1_234_567, "tok")
        '1.2M tok'
    """
    suffix = f" {unit}" if unit else ""
    for size, letter in ((10**12, "T"), (10**9, "G"), (10**6, "M"), (10**3, "k")):
        if abs(value) >= size:
            return f"{value / size:.1f}{letter}{suffix}"
    return f"{value}{suffix}"


def format_rate(rate: float, unit: str) -> str:
    """A rate per second: a short count from 1 per second up, two decimals below.

    Example:
        >>> format_rate(12_345.6, "tok"), format_rate(0.25, "upd")
        ('12.3k tok/s', '0.25 upd/s')
    """
    return f"{format_count(round(rate))} {unit}/s" if rate >= 1 else f"{rate:.2f} {unit}/s"


def unsupported_strategy_hint(strategy: object) -> str:
    """A sentence (with a leading space, or empty) for errors about a strategy the package does not extend.

    Example:
        >>> unsupported_strategy_hint(object())
        ''
    """
    if isinstance(strategy, FSDPStrategy):
        return (
            " Lightning's FSDPStrategy (FSDP1) is not supported: use strategy='accum_fsdp' (FSDP2: apply"
            " `torch.distributed.fsdp.fully_shard` in `configure_model` over `self.device_mesh['data_parallel']`), or"
            " ModelParallelAccumulationStrategy(data_parallel_size=, tensor_parallel_size=) for FSDP2 with tensor"
            " parallelism."
        )
    if isinstance(strategy, ModelParallelStrategy) and not isinstance(strategy, ExactAccumulation):
        return (
            " For FSDP2 and tensor parallelism use ModelParallelAccumulationStrategy (strategy='accum_fsdp' or"
            " 'accum_model_parallel'), which takes the same sizes."
        )
    return ""
