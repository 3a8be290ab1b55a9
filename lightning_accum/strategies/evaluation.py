"""Evaluation on the training's footing: the loss of a validation or test set weighted by its units, over every replica.

Lightning's ``self.log("val_loss", loss, sync_dist=True)`` averages per-batch means (weighted by batch size) and then
the replicas' means: the same model on the same set reads differently on one process and on two, and a set whose
batches hold different numbers of supervised tokens is weighted wrongly. When ``validation_step`` (or ``test_step``)
returns the training contract, ``{"loss": mean, "num_tokens": n}`` (or a loss whose counts come from the strategy's
``count_tokens``, or a loss weighted by samples), the strategy keeps ``Σ w·loss`` and ``Σ w`` over the whole
evaluation and logs their ratio once at its end:

================================= ======================================================================
key                               value
================================= ======================================================================
``accum/val_loss``                ``Σ w·loss / Σ w`` over every batch of the validation set on every replica
``accum/val_perplexity``          ``exp(accum/val_loss)``, where the unit is tokens (a per-token cross-entropy)
``accum/test_loss``,              the same for ``trainer.test``
``accum/test_perplexity``
================================= ======================================================================

With several evaluation loaders Lightning appends ``/dataloader_idx_{i}`` to each key, one value per loader. The
unit ``w`` is the training run's (``normalize=``; under ``"auto"`` before any training, what the first evaluated
batch reports). The keys go through Lightning's own ``self.log`` (so ``ModelCheckpoint(monitor="accum/val_loss")``,
``EarlyStopping`` and every logger see them; :class:`~lightning_accum.AxisLogger` writes them on the run's axis), and
anything the step logs itself keeps working beside them.

Why a ``torchmetrics.Metric``: a weighted mean whose two states are *summed* across processes at the end of the
evaluation is exactly its job, and Lightning computes, logs and resets a logged metric at the end of each evaluation
loop (per dataloader) itself. The states are ``float64`` (the weighted sum) and ``int64`` (the units, exact at any
size); an update adds to them on the device (no host read per batch); the metric syncs over the data-parallel group
only (tensor-parallel ranks of one replica see the same batch and are counted once).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torchmetrics import Metric
from typing_extensions import override

from lightning_accum.engine import AccumulationEngine
from lightning_accum.microbatch import Count, as_count, choose_unit, parse_step_output

__all__ = ["EVALUATION_KEYS", "EvaluationHooks", "ExactEvaluation", "WeightedMean"]

#: The keys logged per stage: (loss, perplexity). Part of the public contract.
EVALUATION_KEYS = {
    "validate": ("accum/val_loss", "accum/val_perplexity"),
    "test": ("accum/test_loss", "accum/test_perplexity"),
}
#: The step each stage's outputs come from, for messages.
_STEP_NAMES = {"validate": "validation_step", "test": "test_step"}


class WeightedMean(Metric):
    """``Σ w·value / Σ w`` over every update on every process (the states are summed across processes).

    ``exp=True`` gives ``exp`` of the mean (perplexity from a per-token cross-entropy). A value whose weight is 0
    adds nothing, even when it is NaN (the mean loss of a batch without units is 0/0). With no units at all the
    result is NaN.

    Example:
        >>> mean = WeightedMean()
        >>> mean.update(torch.tensor(3.0), 512)
        >>> mean.update(torch.tensor(4.0), 1536)
        >>> float(mean.compute())
        3.75
    """

    full_state_update = False
    higher_is_better = False
    is_differentiable = False

    weighted: Tensor
    units: Tensor

    def __init__(self, exp: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.exp = exp
        self.add_state("weighted", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("units", torch.zeros((), dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, value: Tensor, weight: Count) -> None:  # type: ignore[override]
        value = value.detach().to(device=self.weighted.device, dtype=torch.float64)
        if isinstance(weight, Tensor):
            weight = weight.to(self.units.device)
            self.weighted += torch.where(weight > 0, value * weight, 0.0)
        elif weight > 0:
            self.weighted += value * weight
        self.units += weight

    def compute(self) -> Tensor:
        mean = self.weighted / self.units
        return mean.exp() if self.exp else mean


class _Run:
    """One evaluation loop (a ``validate`` or ``test`` stage): its unit, whether it logs, its metrics by loader."""

    __slots__ = ("active", "metrics", "stage", "unit")

    def __init__(self, stage: str) -> None:
        self.stage = stage
        self.unit: str | None = None
        self.active: bool | None = None  # decided by the first batch
        self.metrics: dict[int, tuple[WeightedMean, WeightedMean | None]] = {}


class ExactEvaluation:
    """The strategy's part for ``validation_step`` / ``test_step``: read each output, update the loader's metrics and
    log them through the module; what the steps reported is kept for :class:`~lightning_accum.AccumulationCheck`.

    ``findings`` maps a stage to why its exact loss was not logged (``None`` when it was); a stage not yet evaluated
    is absent.
    """

    def __init__(self) -> None:
        self._run: _Run | None = None
        self.findings: dict[str, str | None] = {}
        self._warned: set[str] = set()

    def start(self, stage: str) -> None:
        """A new evaluation loop of ``stage`` (``"validate"`` or ``"test"``) begins: fresh sums and a fresh decision."""
        self._run = _Run(stage)

    def step(
        self,
        output: Any,
        batch: Any,
        dataloader_idx: int,
        module: Any,
        engine: AccumulationEngine,
        sync_group: Any,
        warn: Any,
    ) -> None:
        """Record one evaluation step's ``output`` and log the loader's metrics through ``module.log``; the unit is
        ``engine``'s (its training's, or chosen by its ``normalize=`` option from the first batch)."""
        run = self._run
        if run is None or run.active is False:
            return
        loss, tokens, samples = _read(output, batch, engine.options.count_tokens, run.stage)
        if run.active is None:
            reported = isinstance(output, Mapping) and output.get("num_samples") is not None
            has_tokens = tokens is not None and not reported
            normalize = engine.normalize
            unit = engine.ledger.normalization or choose_unit(normalize, has_tokens, samples is not None)[0]
            why = _inactive(loss, unit, tokens, samples, run.stage, normalize)
            self.findings[run.stage] = why
            run.active, run.unit = why is None, unit
            if why is not None:
                if loss is not None and run.stage not in self._warned:
                    self._warned.add(run.stage)
                    warn(f"lightning_accum: {why}")
                return
        weight = _weight(run, loss, tokens, samples)
        metrics = run.metrics.get(dataloader_idx)
        if metrics is None:
            device = loss.device if loss is not None else torch.device("cpu")  # type: ignore[union-attr]
            mean = WeightedMean(process_group=sync_group).to(device)
            perplexity = WeightedMean(exp=True, process_group=sync_group).to(device) if run.unit == "tokens" else None
            metrics = run.metrics[dataloader_idx] = (mean, perplexity)
        assert loss is not None
        loss_key, perplexity_key = EVALUATION_KEYS[run.stage]
        for key, metric in zip((loss_key, perplexity_key), metrics, strict=True):
            if metric is not None:
                metric.update(loss, weight)
                module.log(key, metric, on_step=False, on_epoch=True, metric_attribute=f"_accum_{key}")


def _read(output: Any, batch: Any, count_tokens: Any, stage: str) -> tuple[Tensor | None, object, object]:
    try:
        return parse_step_output(output, batch, count_tokens)
    except (TypeError, ValueError) as error:  # the training contract's words, for the evaluation step
        raise type(error)(str(error).replace("`training_step`", f"`{_STEP_NAMES[stage]}`")) from None


def _inactive(
    loss: Tensor | None, unit: str, tokens: object, samples: object, stage: str, normalize: str
) -> str | None:
    """Why this evaluation logs no exact loss (``None``: it does)."""
    step = _STEP_NAMES[stage]
    key = EVALUATION_KEYS[stage][0]
    if loss is None:
        return (
            f"`{step}` returns no loss, so `{key}` is not logged (what `{step}` logs itself is Lightning's mean of"
            f" batch means). Return `{{'loss': loss, 'num_tokens': n}}` from `{step}`, as from `training_step`, to get"
            " the loss of the whole set weighted by its tokens over every replica."
        )
    if unit == "tokens" and tokens is None:
        return (
            f"`{step}` returns a loss without a token count while the run weights by tokens"
            f" (`normalize={normalize!r}`), so `{key}` is not logged. Return `{{'loss': loss, 'num_tokens': n}}`"
            f" from `{step}` (e.g. `n = lightning_accum.supervised_tokens(labels)`), or pass `count_tokens=` to the"
            " strategy."
        )
    if unit == "samples" and samples is None:
        return (
            f"`{step}` returns a loss but the number of samples of its batch cannot be inferred, so `{key}` is not"
            f" logged. Return `{{'loss': loss, 'num_samples': n}}` from `{step}`."
        )
    return None


def _weight(run: _Run, loss: Tensor | None, tokens: object, samples: object) -> Count:
    """The batch's weight in the run's unit; an error when a later batch lacks the count the first one had."""
    step = _STEP_NAMES[run.stage]
    value = tokens if run.unit == "tokens" else samples if run.unit == "samples" else 1
    if value is None or loss is None:
        raise ValueError(
            f"`{step}` reported a loss and its {run.unit} for its first batch but not for this one: every batch of one"
            f" evaluation must return the same contract (`{{'loss': loss, 'num_tokens': n}}`), or the weighted loss of"
            " the set would leave batches out. Return the count from every call."
        )
    return as_count(f"num_{run.unit}", value, loss.device)


class EvaluationHooks(Strategy):
    """The strategy's evaluation hooks: each ``validation_step`` / ``test_step`` output to :class:`ExactEvaluation`.

    A base of :class:`~lightning_accum.strategies.base.ExactAccumulation` (never used alone), which sets up
    ``_engine`` and ``_evaluation``; the model-parallel strategy overrides :meth:`_evaluation_group`.
    """

    _engine: AccumulationEngine
    _evaluation: ExactEvaluation

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().validation_step(*args, **kwargs)
        self._evaluate(output, args, kwargs)
        return output

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().test_step(*args, **kwargs)
        self._evaluate(output, args, kwargs)
        return output

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._evaluation.start("validate")

    @override
    def on_test_start(self) -> None:
        super().on_test_start()
        self._evaluation.start("test")

    def _evaluate(self, output: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Weigh an evaluation step's output like a training micro-batch (this module)."""
        module = self.lightning_module
        assert module is not None
        if module.trainer.barebones:  # Lightning logs nothing then
            return
        # Lightning passes (batch, batch_idx[, dataloader_idx]) positionally; a direct call may name them.
        batch = args[0] if args else kwargs.get("batch")
        loader = kwargs.get("dataloader_idx", args[2] if len(args) > 2 else 0)
        self._evaluation.step(
            output, batch, int(loader), module, self._engine, self._evaluation_group(), rank_zero_warn
        )

    def _evaluation_group(self) -> Any:
        """The process group an evaluation's sums are added over (``None``: every process, or no process group)."""
        return None
