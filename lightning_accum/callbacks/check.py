"""A pre-flight check of one accumulation group against the same examples in a single batch."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import random
import textwrap
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_accum.callbacks.common import accumulation_strategy
from lightning_accum.callbacks.diagnoses import (
    TOKEN_COUNTS,
    diagnose,
    first_nonfinite,
    passed_notes,
    replica_findings,
    scheduler_findings,
)
from lightning_accum.gradients import scale_gradients
from lightning_accum.microbatch import infer_num_samples
from lightning_accum.patching import InstancePatch, patched
from lightning_accum.strategies import ExactAccumulation
from lightning_accum.strategies.evaluation import plain_evaluation
from lightning_accum.strategies.scheduled_groups import loader_batch_size
from lightning_accum.tokens import TokenWeightingWarning, find_labels, supervised_tokens

__all__ = ["AccumulationCheck", "AccumulationCheckError", "CheckResult", "concat_microbatches"]

_BATCHNORM = (nn.modules.batchnorm._BatchNorm, nn.SyncBatchNorm)
#: Attributes of the module that keep a tensor attached to the graph across micro-batches: (name, shape).
_Leaks = list[tuple[str, tuple[int, ...]]]
_DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


class AccumulationCheckError(RuntimeError):
    """The pre-flight check found that accumulation does not reproduce the one-batch update."""


def concat_microbatches(batches: Sequence[Any], ignore_index: int = -100, key: str = "") -> Any:
    """Concatenate micro-batches along the first dimension, right-padding variable-length tensors (label and target
    tensors with ``ignore_index``, others with 0).

    Example:
        >>> a = {"input_ids": torch.ones(1, 2, dtype=torch.long), "labels": torch.ones(1, 2, dtype=torch.long)}
        >>> b = {"input_ids": torch.ones(1, 3, dtype=torch.long), "labels": torch.ones(1, 3, dtype=torch.long)}
        >>> concat_microbatches([a, b])["labels"].tolist()
        [[1, 1, -100], [1, 1, 1]]
    """
    first = batches[0]
    if isinstance(first, Tensor):
        if first.ndim == 0:
            raise TypeError(
                f"Cannot concatenate 0-d tensors of key {key!r} into one batch. Pass "
                "`AccumulationCheck(collate=...)`, a function from the list of micro-batches to one batch."
            )
        shape = [max(t.shape[d] for t in batches) for d in range(first.ndim)]
        pad = ignore_index if any(word in key.lower() for word in ("label", "target")) else 0
        padded = []
        for t in batches:
            if list(t.shape[1:]) == shape[1:]:
                padded.append(t)
                continue
            out = t.new_full([t.shape[0], *shape[1:]], pad)
            out[tuple(slice(0, n) for n in t.shape)] = t
            padded.append(out)
        return torch.cat(padded)
    if isinstance(first, Mapping):
        return type(first)({k: concat_microbatches([b[k] for b in batches], ignore_index, str(k)) for k in first})  # type: ignore[call-arg]
    if isinstance(first, (list, tuple)):
        parts = [concat_microbatches([b[i] for b in batches], ignore_index, key) for i in range(len(first))]
        return type(first)(parts) if isinstance(first, list) else tuple(parts)
    raise TypeError(
        f"Cannot concatenate micro-batch items of type {type(first).__name__} (key {key!r}). Pass "
        "`AccumulationCheck(collate=...)`, a function from the list of micro-batches to one batch."
    )


@dataclass
class CheckResult:
    """What the check measured.

    Attributes:
        relative_error: ``‖g_group − g_batch‖ / ‖g_batch‖`` over all parameters.
        ratio: ``⟨g_group, g_batch⟩ / ‖g_batch‖²`` (1 when exact; ``1/A`` when the loss is divided by A twice).
        microbatches: Micro-batches of the checked group on this replica.
        errors: Failures (raised as :class:`AccumulationCheckError` when ``strict``).
        warnings: Findings that are reported but do not fail the check.
        notes: What the check could not see, and how close runs of other splits can be expected to stay.
    """

    relative_error: float
    ratio: float
    microbatches: int
    errors: list[str]
    warnings: list[str]
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.errors


@dataclass(frozen=True)
class _Pass:
    """What every pass of the check runs on."""

    trainer: Trainer
    module: LightningModule
    strategy: ExactAccumulation
    optimizer: Optimizer
    accumulate: int  # the checked group's micro-batches
    seed: int
    one_batch: Any = None  # the group's examples in one batch


class AccumulationCheck(Callback):
    """Before the first update of ``fit``, check one accumulation group against the same examples in one batch.

    The group's gradient on the strategy's own path is compared with the concatenated batch's, deterministically,
    and everything touched is restored (docs/concepts.md, "Before a campaign").

    Args:
        tolerance: Largest accepted relative error; by default ``1e-4``, or ``2e-2`` with 16-bit weights.
        strict: Raise :class:`AccumulationCheckError` on failures (``True``) or only warn (``False``).
        collate: ``list of micro-batches -> batch`` for batch structures that cannot be concatenated.
        ignore_index: Padding value for label tensors when right-padding variable lengths.

    Example:
        >>> from lightning_accum import AccumulationCheck
        >>> AccumulationCheck(strict=False).strict
        False
    """

    def __init__(
        self,
        tolerance: float | None = None,
        strict: bool = True,
        collate: Callable[[list[Any]], Any] | None = None,
        ignore_index: int = -100,
    ) -> None:
        if tolerance is not None and not tolerance > 0:
            raise ValueError(f"`tolerance` must be > 0, got {tolerance!r}. Pass e.g. `tolerance=1e-4`.")
        self.tolerance = tolerance
        self.strict = strict
        self.collate = collate
        self.ignore_index = ignore_index
        self.result: CheckResult | None = None
        self._unit: str | None = None
        self._evaluation_checked = False

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        strategy = accumulation_strategy(trainer, "AccumulationCheck")
        self._evaluation_checked = False
        if not pl_module.automatic_optimization:
            raise RuntimeError(
                f"AccumulationCheck calls `training_step` as automatic optimization does (it returns the loss), but"
                f" `{type(pl_module).__name__}.automatic_optimization` is False: its `training_step` runs the whole"
                " manual loop, optimizer steps included. Remove the callback for manual loops (the manual API,"
                " `strategy.accumulate` / `close_group`, is exact by the same arithmetic)."
            )
        if strategy.ledger.updates_attempted > 0 or trainer.ckpt_path is not None:
            # A resumed run (also one resumed inside its first group, whose open group must not be consumed): the
            # check is for the start of a campaign.
            rank_zero_info("AccumulationCheck: skipped, the run resumes from a checkpoint.")
            return
        optimizer = trainer.optimizers[0]
        accumulate, schedule_note = _checked_size(trainer, strategy, lambda: self._take(trainer, pl_module, 1))
        # `trainer.accumulate_grad_batches` reads the checked group's size, as in the run's group.
        with _restored(pl_module, optimizer), _accumulating(trainer, accumulate):
            self.result = self._run(trainer, pl_module, strategy, optimizer, accumulate)
        if schedule_note is not None:
            self.result.notes.insert(0, schedule_note)
        self._report(self.result)

    # ------------------------------------------------------------------ the check

    def _tolerance(self, trainer: Trainer) -> float:
        if self.tolerance is not None:
            return self.tolerance
        # Only 16-bit weights ("16-true", "bf16-true") keep 16-bit arithmetic in the check (see `_float32_compute`).
        if "16" in str(trainer.precision) and not isinstance(trainer.strategy.precision_plugin, MixedPrecision):
            return 2e-2
        return 1e-4

    def _run(
        self,
        trainer: Trainer,
        module: LightningModule,
        strategy: ExactAccumulation,
        optimizer: Optimizer,
        accumulate: int,
    ) -> CheckResult:
        """One group of ``accumulate`` micro-batches against the same examples in one batch: the result."""
        replicas = strategy.data_parallel_replicas
        batches = self._take(trainer, module, accumulate)
        if not batches:
            return CheckResult(0.0, 1.0, 0, ["the training data yielded no batch"], [])
        warnings = _partial_group(len(batches), accumulate, strategy.engine.options.partial_group)
        run = _Pass(trainer, module, strategy, optimizer, accumulate, int(torch.randint(0, 2**31 - 1, (1,)).item()))
        with _float32_compute(strategy), _token_hints_muted():
            group, outcome, leaks = self._group_gradient(run, batches)
            everything = self._gather_batches(batches, replicas)
            run = dataclasses.replace(run, one_batch=self._one_batch(run, everything))
            reference = self._batch_gradient(run, run.one_batch)

        g, r = _flat(group), _flat(reference)
        norm = float(r.norm())
        rel = _relative_error(g, r)
        ratio = float(g.dot(r) / (norm * norm)) if norm > 0 else 1.0
        errors, found = _group_findings(module, group, g, outcome, leaks)
        warnings += found
        judged_errors, judged_warnings = self._difference_findings(run, batches, everything, r, rel, ratio)
        errors += judged_errors
        warnings += judged_warnings
        warnings.extend(scheduler_findings(trainer, accumulate))
        if replicas > 1:
            warnings.extend(replica_findings(trainer, batches))
        notes = passed_notes(len(batches), replicas, strategy, optimizer)
        for finding in self._evaluation_findings(strategy):
            # A step that returns predictions or nothing is ordinary Lightning code: information, not a warning.
            (notes if plain_evaluation(finding) else warnings).append(finding)
        return CheckResult(rel, ratio, len(batches), errors, warnings, notes)

    def _difference_findings(
        self, run: _Pass, batches: list[Any], everything: list[Any], reference: Tensor, rel: float, ratio: float
    ) -> tuple[list[str], list[str]]:
        """The errors and warnings of the difference ``rel`` from one batch: BatchNorm's, the seed's, or a diagnosis."""
        errors: list[str] = []
        warnings: list[str] = []
        module, strategy, accumulate = run.module, run.strategy, run.accumulate
        batchnorms = [n for n, m in module.named_modules() if isinstance(m, _BATCHNORM)]
        if batchnorms:
            warnings.append(
                f"BatchNorm layers ({', '.join(batchnorms)}) compute statistics per micro-batch, so accumulation"
                f" cannot reproduce the one-batch update exactly (relative error {rel:.2e}); this is expected"
            )
        tolerance = self._tolerance(run.trainer)
        noise = self._seed_noise(run, reference) if rel > tolerance and not batchnorms else 0.0
        if noise > tolerance:
            warnings.append(
                f"the one-batch gradient itself changes with the random seed (by {noise:.2e} relative, more than the"
                f" tolerance {tolerance:.0e}) although every module was switched to eval mode (BatchNorm excepted) and"
                " every dropout probability set to 0 for the check: the step draws random numbers of its own (a fused"
                " kernel given a probability from a config, random augmentation, sampling), so the group cannot be"
                f" compared with one batch and the check does not judge it (relative error {rel:.2e})"
            )
        elif rel > tolerance and not batchnorms:
            alternatives: dict[str, float] = {}
            if find_labels(everything[0]) and (accumulate > 1 or len(everything) > 1):
                with _float32_compute(strategy), _token_hints_muted():
                    alternatives = self._alternative_weightings(run, everything, reference)
            errors.append(
                diagnose(rel, ratio, tolerance, accumulate, self._unit, self.ignore_index, batches, alternatives)
            )
        return errors, warnings

    def _seed_noise(self, run: _Pass, reference: Tensor) -> float:
        """How much the one-batch gradient moves under another seed, relative to ``reference``."""
        with _float32_compute(run.strategy), _token_hints_muted():
            other = self._batch_gradient(dataclasses.replace(run, seed=run.seed + 1), run.one_batch)
        return _relative_error(_flat(other), reference)

    def _evaluation_findings(self, strategy: ExactAccumulation) -> list[str]:
        """Why the validation loss is not on the exact footing, once the strategy has seen a validation step."""
        finding = strategy.evaluation_findings.get("validate", "")
        if finding == "" or self._evaluation_checked:
            return []
        self._evaluation_checked = True
        return [finding] if finding is not None else []

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Without a sanity check, the first validation of the fit says what `validation_step` returns.
        if self.result is None or trainer.sanity_checking:
            return
        for message in self._evaluation_findings(accumulation_strategy(trainer, "AccumulationCheck")):
            plain = plain_evaluation(message)
            (self.result.notes if plain else self.result.warnings).append(message)
            (rank_zero_info if plain else rank_zero_warn)(f"AccumulationCheck: {message}")

    def _alternative_weightings(self, run: _Pass, batches: list[Any], reference: Tensor) -> dict[str, float]:
        """Relative error against ``reference`` of the group gradient weighted by other counts."""
        totals = dict.fromkeys((*TOKEN_COUNTS, "samples", "batches"), 0.0)
        sums: dict[str, Tensor] = {}
        for batch in batches:
            found = find_labels(batch)
            if not found:
                return {}
            labels = found[0][1]
            counts = {
                "shifted tokens": float(supervised_tokens(labels, shift=True, ignore_index=self.ignore_index)),
                "tokens": float(supervised_tokens(labels, shift=False, ignore_index=self.ignore_index)),
                "samples": float(infer_num_samples(batch) or 0),
                "batches": 1.0,
            }
            flat = _flat(self._batch_gradient(run, batch))
            for name, w in counts.items():
                totals[name] += w
                if w > 0:  # an empty micro-batch's mean is NaN and weighs nothing
                    sums[name] = sums[name] + w * flat if name in sums else w * flat
        if not float(reference.norm()) > 0:
            return {}
        return {name: _relative_error(total / totals[name], reference) for name, total in sums.items()}

    def _take(self, trainer: Trainer, module: LightningModule, count: int) -> list[Any]:
        loader = trainer.train_dataloader
        if loader is None:
            return []
        # A loader with its own generator (shuffle=True, generator=...) draws from it when iterated: keep its
        # state so the run reads the data in the order it would without the check.
        generators = _loader_generators(loader)
        states = [g.get_state() for g in generators]
        try:
            iterator = iter(loader)
            batches = [_prepare_batch(trainer, module, batch) for batch in itertools.islice(iterator, count)]
            del iterator
        finally:
            for generator, state in zip(generators, states, strict=True):
                generator.set_state(state)
        return batches

    def _call_step(self, strategy: Any, module: LightningModule, batch: Any) -> Tensor | None:
        args = (batch, 0) if is_param_in_hook_signature(module.training_step, "batch_idx", min_args=2) else (batch,)
        out = strategy.training_step(*args)
        loss = out.get("loss") if isinstance(out, Mapping) else out
        return loss if isinstance(loss, Tensor) else None

    def _group_gradient(self, run: _Pass, batches: list[Any]) -> tuple[list[Tensor], str, _Leaks]:
        """The strategy's own path for one group, on a scratch engine; gradients unscaled."""
        strategy, module, optimizer = run.strategy, run.module, run.optimizer
        scratch = strategy.engine.scratch(on_nonfinite="ignore")
        leaks: _Leaks = []
        with strategy.use_engine(scratch):
            _reset_for_pass(optimizer, run.seed)
            for i, batch in enumerate(batches):
                final = i == len(batches) - 1
                with strategy.no_backward_sync(enabled=not final):
                    loss = self._call_step(strategy, module, batch)
                    if loss is not None:
                        strategy.backward(loss, optimizer)
                if not final:
                    leaks = _graph_attached(module) or leaks
            outcome = scratch.close_group(accumulate=run.trainer.accumulate_grad_batches)
        if outcome.action == "apply":
            scale_gradients(_params(optimizer), outcome.factor)
        self._unit = scratch.unit
        scaler = strategy.gradient_scaler
        unscale = 1.0 / scaler.get_scale() if scaler is not None else 1.0
        grads = [(p.grad * unscale) if p.grad is not None else torch.zeros_like(p) for p in _params(optimizer)]
        return grads, outcome.action, leaks

    def _gather_batches(self, batches: list[Any], replicas: int) -> list[Any]:
        if replicas == 1 or not torch.distributed.is_initialized():
            return batches
        device = _first_device(batches)
        gathered: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, _to_device(batches, torch.device("cpu")))
        return [_to_device(b, device) for rank_batches in gathered for b in rank_batches]

    def _one_batch(self, run: _Pass, batches: list[Any]) -> Any:
        """The group's examples in one batch: ``collate``'d or concatenated micro-batches, or under ``token_batches=``
        the plan's first group collated by the training loader's ``collate_fn``."""
        sampler, loader = run.strategy.token_sampler, run.trainer.train_dataloader
        if sampler is not None and self.collate is None:
            examples = [loader.dataset[index] for index in sampler.group_examples(0)]  # type: ignore[union-attr]
            return _prepare_batch(run.trainer, run.module, loader.collate_fn(examples))  # type: ignore[union-attr]
        return self.collate(batches) if self.collate is not None else concat_microbatches(batches, self.ignore_index)

    def _batch_gradient(self, run: _Pass, big: Any) -> list[Tensor]:
        """Gradient of the one batch ``big``, inside the strategy's ``one_batch_reference``."""
        with run.strategy.one_batch_reference():
            _reset_for_pass(run.optimizer, run.seed)
            loss = self._call_step(run.strategy, run.module, big)
            if loss is None:
                raise AccumulationCheckError("`training_step` returned no loss for the concatenated batch.")
            loss.backward()
        return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in _params(run.optimizer)]

    def _report(self, result: CheckResult) -> None:
        for message in result.warnings:
            rank_zero_warn(f"AccumulationCheck: {message}" + ("" if message.endswith(".") else "."))
        if result.errors:
            text = "AccumulationCheck failed:\n- " + "\n- ".join(result.errors)
            if self.strict:
                raise AccumulationCheckError(text)
            rank_zero_warn(text)
            return
        # Each note on lines of its own, wrapped: the passed line stays one short line in a log.
        notes = "".join(
            "\n" + textwrap.fill(note, 116, initial_indent="  Note: ", subsequent_indent="        ")
            for note in result.notes
        )
        if result.warnings:
            rank_zero_info(f"AccumulationCheck passed with {len(result.warnings)} warning(s).{notes}")
            return
        rank_zero_info(
            f"AccumulationCheck passed: {result.microbatches} micro-batch(es) match one batch of the same examples"
            f" (relative error {result.relative_error:.2e}, ratio {result.ratio:.6f}).{notes}"
        )


# ---------------------------------------------------------------------- helpers


def _prepare_batch(trainer: Trainer, module: LightningModule, batch: Any) -> Any:
    """What Lightning does to a training batch before ``training_step``, through the public hooks."""
    batch = trainer.precision_plugin.convert_input(batch)
    datamodule = getattr(trainer, "datamodule", None)
    if datamodule is not None:
        batch = datamodule.on_before_batch_transfer(batch, 0)
    batch = module.on_before_batch_transfer(batch, 0)
    return trainer.strategy.batch_to_device(batch, dataloader_idx=0)


def _loader_generators(loader: Any) -> list[torch.Generator]:
    """The random generators a loader's sampling draws from, each once."""
    candidates = [
        getattr(loader, "generator", None),
        getattr(getattr(loader, "sampler", None), "generator", None),
        getattr(getattr(getattr(loader, "batch_sampler", None), "sampler", None), "generator", None),
    ]
    unique = {id(g): g for g in candidates if isinstance(g, torch.Generator)}
    return list(unique.values())


def _group_findings(
    module: LightningModule, group: list[Tensor], flat: Tensor, outcome: str, leaks: _Leaks
) -> tuple[list[str], list[str]]:
    """The errors and warnings of the group's own pass: a gradient not finite, graphs kept (``leaks``), no update."""
    errors: list[str] = []
    warnings: list[str] = []
    if not bool(torch.isfinite(flat).all()):
        where = first_nonfinite(module, group)
        errors.append(f"the group's gradient is not finite (first non-finite gradient: {where})")
    if outcome != "apply":
        warnings.append(f"the checked group made no update (outcome: {outcome})")
    for name, shape in leaks:
        errors.append(
            f"`{type(module).__name__}.{name}` keeps a tensor attached to the autograd graph across micro-batches"
            f" (shape {shape}): every micro-batch's graph stays in memory, so memory grows with"
            f" accumulate_grad_batches and over the run. Store `.detach()`ed values (or `.item()` at the update)."
        )
    return errors, warnings


def _partial_group(microbatches: int, accumulate: int, partial_group: str) -> list[str]:
    """The warning of a first group shorter than ``accumulate`` (none for a full one)."""
    if microbatches >= accumulate:
        return []
    if partial_group == "drop":
        return [
            f"the first epoch holds only {microbatches} of {accumulate} micro-batches; with partial_group='drop' its"
            " group makes no update"
        ]
    return [
        f"the first group holds {microbatches} of {accumulate} micro-batches (a partial group, rescaled with its real"
        " denominator)"
    ]


def _checked_size(
    trainer: Trainer, strategy: ExactAccumulation, first_batch: Callable[[], list[Any]]
) -> tuple[int, str | None]:
    """The ``A`` of the group the check runs (the Trainer's, or the schedule's), with the note naming the stage."""
    schedule, replicas, tokens = strategy.batch_schedule, strategy.data_parallel_replicas, strategy.token_sampler
    if tokens is not None:  # the plan's first group: its micro-batches per replica
        return tokens.group_sizes()[0], None
    if schedule is None:
        return trainer.accumulate_grad_batches, None
    m = loader_batch_size(trainer.train_dataloader)
    if m is None:
        first = first_batch()
        m = infer_num_samples(first[0]) if first else None
    if m is None:
        return 1, (
            "under batch_schedule= the check could not tell the samples of a micro-batch (the loader has no"
            " `batch_size` and its first batch no common leading dimension), so it checked a group of one"
            " micro-batch: no stage's accumulation was checked."
        )
    schedule.check(m, replicas)
    sizes = [stage.samples // (m * replicas) for stage in schedule.stages]
    accumulates = replicas > 1 or strategy.slicing.configured is not None  # more than one micro-batch per group
    checked = next((i for i, size in enumerate(sizes) if accumulates or size > 1), 0)
    which = (
        "the run's first group"
        if checked == 0
        else "a group of the loader's first examples (stage 0's groups hold one micro-batch on one replica, which"
        " checks no weighting)"
    )
    note = (
        f"under batch_schedule= the check ran one group of stage {checked} (A = {sizes[checked]} micro-batch(es)"
        f" per replica, {schedule.stages[checked].samples} samples per update): {which}."
    )
    others = [f"{i} (A = {size})" for i, size in enumerate(sizes) if i != checked]
    if others:
        note += (
            f" Not checked: stage(s) {', '.join(others)}. Their first groups hold examples the loader reaches only"
            " during the run, not at set-up, and one group's arithmetic (the weights, c, the close's rescale) is"
            " the same at every A, so a group that accumulates checks it for every stage; a loss divided by"
            " `trainer.accumulate_grad_batches` shows here as a ratio of 1/A."
        )
    return sizes[checked], note


@contextmanager
def _accumulating(trainer: Trainer, accumulate: int) -> Iterator[None]:
    """``trainer.accumulate_grad_batches`` reads ``accumulate`` inside the block, as in the run's group."""
    given = trainer.accumulate_grad_batches
    trainer.accumulate_grad_batches = accumulate
    try:
        yield
    finally:
        trainer.accumulate_grad_batches = given


@contextmanager
def _float32_compute(strategy: Any) -> Iterator[None]:
    """Autocast off for the check's passes under mixed precision, through the plugin's ``forward_context``."""
    plugin = strategy.precision_plugin
    if not isinstance(plugin, MixedPrecision):
        yield
        return
    with patched(plugin, "forward_context", lambda: torch.autocast(plugin.device, enabled=False), wraps=False):
        yield


@contextmanager
def _token_hints_muted() -> Iterator[None]:
    """The token-weighting hint muted on the check's scratch engines (it is the run's to give)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=TokenWeightingWarning)
        yield


def _reset_for_pass(optimizer: Optimizer, seed: int) -> None:
    """Both gradients start from nothing and see the same random numbers."""
    optimizer.zero_grad(set_to_none=True)
    torch.manual_seed(seed)


def _flat(grads: list[Tensor]) -> Tensor:
    return torch.cat([x.reshape(-1).to(torch.float64) for x in grads])


def _relative_error(g: Tensor, reference: Tensor) -> float:
    """``‖g − reference‖ / ‖reference‖``, or the absolute error where the reference is zero."""
    norm = float(reference.norm())
    return float((g - reference).norm() / norm) if norm > 0 else float((g - reference).norm())


def _params(optimizer: Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _graph_attached(module: LightningModule) -> _Leaks:
    """Attributes of ``module`` (not parameters or buffers) that hold tensors with a ``grad_fn``."""
    found = []

    def visit(obj: Any, name: str, depth: int) -> None:
        if isinstance(obj, Tensor):
            if obj.grad_fn is not None:
                found.append((name, tuple(obj.shape)))
        elif depth < 3 and isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                visit(v, f"{name}[{i}]", depth + 1)
                if found:
                    return
        elif depth < 3 and isinstance(obj, dict):
            for k, v in obj.items():
                visit(v, f"{name}[{k!r}]", depth + 1)

    for name, value in vars(module).items():
        if not name.startswith("_"):
            visit(value, name, 0)
    return found


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().to(device)
    if isinstance(obj, Mapping):
        return type(obj)({k: _to_device(v, device) for k, v in obj.items()})  # type: ignore[call-arg]
    if isinstance(obj, (list, tuple)):
        parts = [_to_device(v, device) for v in obj]
        return parts if isinstance(obj, list) else tuple(parts)
    return obj


def _first_device(obj: Any) -> torch.device:
    if isinstance(obj, Tensor):
        return obj.device
    values: Any = obj.values() if isinstance(obj, Mapping) else obj if isinstance(obj, (list, tuple)) else []
    for v in values:
        device = _first_device(v)
        if device.type != "cpu":
            return device
    return torch.device("cpu")


@contextmanager
def _restored(module: LightningModule, optimizer: Optimizer) -> Iterator[None]:
    """Eval mode (BatchNorm excepted), dropout at 0 and logging muted; everything restored after (random state too)."""
    weights = copy.deepcopy(module.state_dict())
    optimizer_state = copy.deepcopy(optimizer.state_dict())
    # BatchNorm keeps its mode: its per-micro-batch statistics are diagnosed as such.
    modes = [(m, m.training) for m in module.modules() if m is not module and not isinstance(m, _BATCHNORM)]
    probabilities = [(m, m.p) for m in module.modules() if isinstance(m, _DROPOUT)]
    fx_name = module._current_fx_name
    # The check's steps are not part of the run's metrics; a user's own instance-level `log` is given back as it was.
    muted = [InstancePatch(module, name, lambda *args, **kwargs: None, wraps=False) for name in ("log", "log_dict")]
    module._current_fx_name = "training_step"
    for m, _ in modes:
        m.training = False
    for m, _ in probabilities:
        m.p = 0.0
    try:
        with _random_state_kept():
            yield
    finally:
        for m, training in modes:
            m.training = training
        for m, p in probabilities:
            m.p = p
        for patch in reversed(muted):
            patch.release()
        module._current_fx_name = fx_name
        optimizer.zero_grad(set_to_none=True)
        module.load_state_dict(weights)
        optimizer.load_state_dict(optimizer_state)


@contextmanager
def _random_state_kept() -> Iterator[None]:
    """The random generators (torch's, CUDA's, Python's, NumPy's) as they were before the block, after it."""
    rng_cpu = torch.get_rng_state()
    rng_cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    rng_python = random.getstate()
    rng_numpy = numpy.random.get_state()
    try:
        yield
    finally:
        torch.set_rng_state(rng_cpu)
        if rng_cuda is not None:
            torch.cuda.set_rng_state_all(rng_cuda)
        random.setstate(rng_python)
        numpy.random.set_state(rng_numpy)
