"""A validation or test set's loss weighted by its units over every replica, logged under :data:`EVALUATION_KEYS`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor

from lightning_accum.core.adapter import EngineAdapter
from lightning_accum.engine import AccumulationEngine
from lightning_accum.evaluation_loss import (
    SLOTS,
    EvaluationLoss,
    EvaluationRecord,
    evaluation_weight,
    no_unit_message,
    repeats_message,
)
from lightning_accum.patching import InstancePatch

__all__ = ["EVALUATION_KEYS", "ExactEvaluation", "outside_the_contract"]

#: The keys logged per stage: (loss, perplexity). Part of the public contract.
EVALUATION_KEYS = {
    "validate": ("accum/val_loss", "accum/val_perplexity"),
    "test": ("accum/test_loss", "accum/test_perplexity"),
}
#: The step each stage's outputs come from, for messages; the module hook the values are logged from.
_STEP_NAMES = {"validate": "validation_step", "test": "test_step"}
_EPOCH_END = {"validate": "on_validation_epoch_end", "test": "on_test_epoch_end"}
#: Before the loaders' vectors (each ``SLOTS`` long): ranks with a batch, ranks whose steps gave no exact value, ranks
#: with an error.
_HEADER = 3


def outside_the_contract(output: Any) -> str | None:
    """What an evaluation step's ``output`` is, for the message, when it is not the training contract, else ``None``.

    Example:
        >>> outside_the_contract({"preds": 1})
        "a dict without 'loss' (keys: 'preds')"
    """
    if output is None:
        return "nothing"
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if isinstance(output, Mapping) and loss is None:
        keys = ", ".join(repr(k) for k in list(output)[:6]) or "none"
        return f"a dict without 'loss' (keys: {keys})"
    if not isinstance(loss, Tensor):
        where = "'loss' as " if isinstance(output, Mapping) else ""
        return f"{where}a {type(loss).__name__}, not a tensor"
    if loss.numel() != 1:
        return f"a tensor of shape {tuple(loss.shape)} (predictions or per-sample values, not a mean loss)"
    return None


class _Run:
    """One evaluation loop on this rank: what its steps reported and the sums."""

    __slots__ = ("adapter", "batches", "broken", "engine", "error", "loaders", "stage", "unit", "why")

    def __init__(self, stage: str, engine: AccumulationEngine, adapter: EngineAdapter) -> None:
        self.stage, self.engine, self.adapter = stage, engine, adapter
        self.unit: str | None = None
        self.why: str | None = None  # why this rank's steps give no exact value (None: they do, or no batch yet)
        self.broken = False  # a later batch did not follow the contract the first ones followed
        self.error: str | None = None  # a later batch dropped the count the first ones reported: raised at the end
        self.batches = 0
        self.loaders: dict[int, EvaluationLoss] = {}

    def loader(self, index: int) -> EvaluationLoss:
        """The sums of loader ``index`` (empty until its first batch)."""
        if index not in self.loaders:
            strategy = self.adapter.strategy
            self.loaders[index] = EvaluationLoss(self.engine, self.adapter.reduce_sum, lambda: strategy.root_device)
        return self.loaders[index]

    @property
    def inactive(self) -> bool:
        """This rank's steps give no exact value."""
        return self.why is not None or self.broken or self.error is not None

    def reduce(self, count: int) -> list[float]:
        """One all-reduce of this rank's header and its loaders' vectors, read on the host once."""
        header = torch.tensor([self.batches > 0, self.inactive, self.error is not None], dtype=torch.float64)
        parts = [self.loader(index).local() for index in range(count)]
        return self.adapter.reduce_sum(torch.cat([header.to(parts[0].device, non_blocking=True), *parts])).tolist()


class ExactEvaluation:
    """The strategy's part for evaluation steps; ``findings``: per stage, why its exact loss was not logged, or None."""

    def __init__(self) -> None:
        self._run: _Run | None = None
        self.findings: dict[str, str | None] = {}
        self._said: set[str] = set()
        self._gate: InstancePatch | None = None  # the module's epoch-end hook, gated for one loop

    # ------------------------------------------------------------------ the loop

    def start(self, stage: str, module: Any, engine: AccumulationEngine, adapter: EngineAdapter) -> None:
        """A new evaluation loop of ``stage``: fresh sums, and the module's epoch-end hook gated to log them."""
        self.end()
        self._run = run = _Run(stage, engine, adapter)
        if module.trainer.barebones:  # Lightning logs nothing then
            self._run = None
            return

        def epoch_end(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            self._reduce_and_log(run, module)
            return result

        # A user's own instance-level hook is kept and given back as it was (see `lightning_accum.patching`).
        self._gate = InstancePatch(module, _EPOCH_END[stage], epoch_end)

    def end(self) -> None:
        """End the loop's run and remove the epoch-end gate."""
        self._run = None
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.release()

    def step(self, output: Any, args: tuple[Any, ...], kwargs: dict[str, Any], engine: AccumulationEngine) -> None:
        """Add the ``output`` of an evaluation step called with ``args``/``kwargs`` to its loader's sums."""
        run = self._run
        if run is None:
            return
        run.batches += 1
        if run.inactive:
            return
        what = outside_the_contract(output)
        if what is not None:
            if run.unit is None:  # the first batch: this evaluation is not on the training's footing
                run.why = _not_the_contract(run.stage, what)
            else:
                self._break(run, f"returns {what}")
            return
        # Lightning passes (batch, batch_idx[, dataloader_idx]) positionally; a direct call may name them.
        read = engine.read(output, args[0] if args else kwargs.get("batch"))
        try:
            unit, weight = evaluation_weight(engine, run.unit, read)
        except ValueError as error:  # a finer unit than the one fixed: raised on every rank at the loop's end
            run.error = str(error)
            return
        if weight is None and run.unit is None:  # the first batch: a loss without the count of the run's unit
            run.unit, run.why = unit, _missing_count(unit, run.stage, engine.options.normalize)
        elif weight is None:  # raised on every rank at the loop's end, so that no rank waits for one that stopped
            run.error = (
                f"`{_STEP_NAMES[run.stage]}` reported a loss and its {run.unit} for its first batch but not for batch"
                f" {run.batches - 1}: every batch of one evaluation must return the same contract"
                " (`{'loss': loss, 'num_tokens': n}`), or the weighted loss of the set would leave batches out."
                " Return the count from every call."
            )
        else:
            run.unit = unit
            loader = int(kwargs.get("dataloader_idx", args[2] if len(args) > 2 else 0))
            run.loader(loader).include(read.loss, weight, unit)  # type: ignore[arg-type]  # the contract has a loss

    def _break(self, run: _Run, what: str) -> None:
        run.broken = True
        step = _STEP_NAMES[run.stage]
        self._say(
            run.stage + ":broken",
            rank_zero_warn,
            f"lightning_accum: `{step}` returned the training contract for its first batches but {what} for batch"
            f" {run.batches - 1} of this {run.stage} loop, so `{EVALUATION_KEYS[run.stage][0]}` is not logged (the"
            " set's weighted loss would leave batches out). Return `{'loss': loss, 'num_tokens': n}` from every call.",
        )

    # ------------------------------------------------------------------ the end of the loop

    def _reduce_and_log(self, run: _Run, module: Any) -> None:
        trainer, adapter = module.trainer, run.adapter
        stage, loss_key = run.stage, EVALUATION_KEYS[run.stage][0]
        replicas = adapter.data_parallel_size
        if replicas > 1 and _may_skip_ranks(module, trainer):
            self._finding(run, _SKIPPED_RANKS.format(key=loss_key))
            return
        count = max([*run.loaders, _loader_count(trainer, stage) - 1], default=0) + 1  # alike on every rank
        values = run.reduce(count)  # the evaluation's one collective and one host read
        with_batches, inactive, errors = values[:_HEADER]
        if not with_batches:
            return  # no rank ran a batch (`limit_val_batches=0`, an empty set): Lightning logs nothing either
        if errors:
            raise ValueError(run.error or f"{int(errors)} other replica(s) stopped this {stage} loop: see their error.")
        where, sums = f"by `{_STEP_NAMES[stage]}` in this {stage} loop", values[_HEADER:]
        records = [
            run.loader(i).record(sums[SLOTS * i : SLOTS * (i + 1)], f"`{loss_key}`", where) for i in range(count)
        ]
        if inactive:
            active = with_batches - inactive
            if active:  # some ranks' steps followed the contract and others' did not: a program that differs by rank
                raise RuntimeError(_disagreement(stage, int(active), int(inactive), int(replicas)))
            self._finding(run, run.why or _ELSEWHERE.format(key=loss_key), say=False)
            return
        self.findings[stage] = None
        if with_batches < replicas:
            self._say(
                stage + ":empty",
                rank_zero_info,
                f"lightning_accum: {int(replicas - with_batches)} of {replicas} replicas ran no {stage} batch;"
                f" `{loss_key}` is the loss of the batches the others ran (every rank logs it).",
            )
        self._say_repeats(run, trainer, replicas)
        for index, record in enumerate(records):
            if record.batches:
                self._log(module, stage, record, index if count > 1 else None, adapter.strategy.root_device)

    def _log(self, module: Any, stage: str, record: EvaluationRecord, index: int | None, device: torch.device) -> None:
        loss_key, perplexity_key = EVALUATION_KEYS[stage]
        suffix = f"/dataloader_idx_{index}" if index is not None else ""
        if not record.units:
            self._say(stage + ":nan", rank_zero_warn, _nan_message(loss_key + suffix, stage, record.unit))
        options = {"on_step": False, "on_epoch": True, "add_dataloader_idx": False, "batch_size": 1}
        module.log(loss_key + suffix, torch.tensor(record.loss, dtype=torch.float64, device=device), **options)
        if record.perplexity is not None:
            perplexity = torch.tensor(record.perplexity, dtype=torch.float64, device=device)
            module.log(perplexity_key + suffix, perplexity, **options)

    def _finding(self, run: _Run, why: str, say: bool = True) -> None:
        self.findings[run.stage] = why
        if not say and run.why is None:
            return
        # Not the contract at all: one line, not a warning (a loss without the run's count is probably a mistake).
        plain = not say and run.unit is None
        self._say(run.stage + ":finding", rank_zero_info if plain else rank_zero_warn, f"lightning_accum: {why}")

    def _say_repeats(self, run: _Run, trainer: Any, replicas: int) -> None:
        loaders = trainer.test_dataloaders if run.stage == "test" else trainer.val_dataloaders
        for loader in loaders if isinstance(loaders, list | tuple) else [loaders]:
            message = repeats_message(loader, f"`{EVALUATION_KEYS[run.stage][0]}`", f"the {run.stage} set", replicas)
            if message is not None:
                self._say(run.stage + ":repeats", rank_zero_warn, message)

    def _say(self, kind: str, say: Callable[[str], None], message: str) -> None:
        if kind not in self._said:
            self._said.add(kind)
            say(message)


_SKIPPED_RANKS = (
    "`{key}` is not logged: the module sets `allow_zero_length_dataloader_with_multiple_devices=True`, so Lightning"
    " skips the evaluation loop on a rank whose sized loaders are empty, and such a rank would not join the reduction"
    " of the set's sums. Give every rank at least one batch and unset the flag, or evaluate on one device."
)
_ELSEWHERE = "`{key}` is not logged: the steps do not return the training contract (this rank ran no batch)."


def _nan_message(key: str, stage: str, unit: str | None) -> str:
    return (
        f"{no_unit_message(f'`{key}`', f'the {stage} set', unit)} `ModelCheckpoint` ranks a NaN as the worst value;"
        " `EarlyStopping(check_finite=True)` stops on it."
    )


def _loader_count(trainer: Any, stage: str) -> int:
    if stage == "test":
        limits = trainer.num_test_batches
    else:
        limits = trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches
    return len(limits)


def _may_skip_ranks(module: Any, trainer: Any) -> bool:
    datamodule = getattr(trainer, "datamodule", None)
    flag = bool(getattr(module, "allow_zero_length_dataloader_with_multiple_devices", False))
    return flag or bool(getattr(datamodule, "allow_zero_length_dataloader_with_multiple_devices", False))


#: The words of a finding about a step that returns predictions, nothing, or another object: ordinary Lightning code.
_PLAIN = "the step runs as under Lightning, and what it logs itself is unchanged"


def plain_evaluation(finding: str) -> bool:
    """Whether ``finding`` is about a step outside the contract (information rather than a warning)."""
    return _PLAIN in finding


def _not_the_contract(stage: str, what: str | None) -> str:
    step, key = _STEP_NAMES[stage], EVALUATION_KEYS[stage][0]
    it = "returns no loss" if what == "nothing" else f"returns {what}, not a loss"
    return (
        f"`{step}` {it}, so `{key}` is not logged ({_PLAIN}). Return `{{'loss': loss, 'num_tokens': n}}` from"
        f" `{step}`, as from `training_step`, to get the"
        " loss of the whole set weighted by its tokens over every replica."
    )


def _missing_count(unit: str, stage: str, normalize: str) -> str:
    """Why a step that returns a loss without its count of ``unit`` logs no exact loss."""
    step, key = _STEP_NAMES[stage], EVALUATION_KEYS[stage][0]
    if unit == "tokens":
        return (
            f"`{step}` returns a loss without a token count while the run weights by tokens"
            f" (`normalize={normalize!r}`), so `{key}` is not logged. Return `{{'loss': loss, 'num_tokens': n}}`"
            f" from `{step}` (e.g. `n = lightning_accum.supervised_tokens(labels, shift=True)`), or pass"
            " `count_tokens=` to the strategy."
        )
    if unit == "documents":
        return (
            f"`{step}` returns a loss without a document count while the run weights by documents"
            f" (`normalize={normalize!r}`), so `{key}` is not logged. Return"
            f" `lightning_accum.document_mean_loss(logits, labels, position_ids=...)` from `{step}`, as from"
            " `training_step`."
        )
    return (
        f"`{step}` returns a loss but the number of samples of its batch cannot be inferred, so `{key}` is not"
        f" logged. Return `{{'loss': loss, 'num_samples': n}}` from `{step}`."
    )


def _disagreement(stage: str, active: int, inactive: int, replicas: int) -> str:
    step, key = _STEP_NAMES[stage], EVALUATION_KEYS[stage][0]
    return (
        f"`{step}` returned the training contract on {active} of {replicas} replicas and something else on"
        f" {inactive}: `{key}` cannot be formed from some replicas' batches only. Make `{step}` return the same"
        " kind of output on every rank (the contract `{'loss': loss, 'num_tokens': n}`, or not at all)."
    )
