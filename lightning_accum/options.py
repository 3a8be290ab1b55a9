"""The options of exact accumulation: allowed values, validation, and one frozen record of them (pure Python)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

__all__ = [
    "NORMALIZE_CHOICES",
    "ON_NONFINITE_CHOICES",
    "PARTIAL_GROUP_CHOICES",
    "SCHEDULE_ON_CHOICES",
    "AccumulationOptions",
    "Normalize",
    "OnNonfinite",
    "PartialGroup",
    "ScheduleOn",
    "TokenCounter",
    "validate_choice",
]

# The string options as `Literal`s in the strategies' constructors: LightningCLI's `--help` lists their choices.
Normalize = Literal["auto", "tokens", "samples", "batches", "documents"]
PartialGroup = Literal["rescale", "drop"]
ScheduleOn = Literal["applied", "attempted"]
OnNonfinite = Literal["skip", "raise", "ignore"]
#: ``count_tokens=``: ``batch -> int | Tensor`` (``Any``: a ``Tensor`` in it makes ``--help`` list its subclasses).
TokenCounter = Callable[[Any], Any]
NORMALIZE_CHOICES: tuple[str, ...] = get_args(Normalize)
PARTIAL_GROUP_CHOICES: tuple[str, ...] = get_args(PartialGroup)
SCHEDULE_ON_CHOICES: tuple[str, ...] = get_args(ScheduleOn)
ON_NONFINITE_CHOICES: tuple[str, ...] = get_args(OnNonfinite)


def validate_choice(argument: str, value: object, choices: Iterable[str]) -> str:
    """Return ``value`` if it is one of ``choices``, else raise a ``ValueError`` that lists them.

    Example:
        >>> validate_choice("partial_group", "drop", PARTIAL_GROUP_CHOICES)
        'drop'
        >>> validate_choice("partial_group", "keep", PARTIAL_GROUP_CHOICES)
        Traceback (most recent call last):
        ...
        ValueError: `partial_group` must be one of 'rescale', 'drop'; got 'keep'. Pass one of those values.
    """
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"`{argument}` must be one of {listed}; got {value!r}. Pass one of those values.")
    return value


@dataclass(frozen=True)
class AccumulationOptions:
    """What the user chose, validated once.

    Attributes:
        normalize: The unit each micro-batch is weighted by; ``"auto"``: documents if the step reports them, else
            tokens, else samples, else batches.
        count_tokens: ``batch -> int | Tensor``, used when the step does not return ``num_tokens``.
        partial_group: A partial final group is updated with its real denominator (``"rescale"``) or dropped and
            recorded (``"drop"``).
        schedule_on: Step-interval schedules advance once per ``"applied"`` update, or per ``"attempted"`` one.
        on_nonfinite: Without a GradScaler, what a non-finite group gradient does: ``"skip"`` the update,
            ``"raise"`` an error, or ``"ignore"`` it (update anyway).
        max_consecutive_skips: Stop with an error after this many skipped updates in a row; ``None`` never stops.
        global_order: Read the training data in one seeded order dealt to the replicas
            (:class:`~lightning_accum.sampler.GlobalOrderSampler`): group ``g`` holds the same examples at any ``m``,
            ``A``, ``D`` (docs/howto.md); ``False``: the loaders' samplers stay Lightning's.

    Example:
        >>> AccumulationOptions(partial_group="drop").partial_group
        'drop'
        >>> AccumulationOptions(max_consecutive_skips=0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: `max_consecutive_skips` must be a positive int or None, got 0. Pass e.g. ...
    """

    normalize: str = "auto"
    count_tokens: Callable[[Any], Any] | None = None
    partial_group: str = "rescale"
    schedule_on: str = "applied"
    on_nonfinite: str = "skip"
    max_consecutive_skips: int | None = 100
    global_order: bool = False

    @classmethod
    def pick(cls, values: Mapping[str, Any]) -> AccumulationOptions:
        """The options among ``values``, validated: a constructor that declares them one by one (as LightningCLI
        needs) passes its ``locals()``.

        Example:
            >>> AccumulationOptions.pick({"self": None, "partial_group": "drop", "device": "cpu"}).partial_group
            'drop'
        """
        return cls(**{field.name: values[field.name] for field in fields(cls) if field.name in values})

    @classmethod
    def split(
        cls,
        owner: str,
        keywords: Mapping[str, Any],
        passed_to: Callable[..., Any] | None = None,
        own: tuple[str, ...] = (),
    ) -> tuple[AccumulationOptions, dict[str, Any]]:
        """The options among ``keywords``, validated, and the others: ``owner``'s ``own`` and those for ``passed_to``
        (the framework strategy's ``__init__``; ``None``: none; one with ``**kwargs`` takes them all).

        Raises:
            TypeError: A keyword none of them takes, naming what each takes.
        """
        names = [field.name for field in fields(cls)]
        others = {key: value for key, value in keywords.items() if key not in names}
        parameters = inspect.signature(passed_to).parameters if passed_to is not None else {}
        if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
            accepted = [name for name, p in parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
            for key in others.keys() - {*accepted, *own}:
                framework = getattr(passed_to, "__qualname__", "").partition(".")[0]
                besides = f"; and {', '.join(accepted)} ({framework}'s)" if accepted else ""
                raise TypeError(
                    f"{owner}() got an unexpected keyword argument {key!r}. It takes the options of exact"
                    f" accumulation: {', '.join(names)} (see `AccumulationOptions`){''.join(', ' + n for n in own)}"
                    f"{besides}. Pass one of those."
                )
        return cls.pick(keywords), others

    def __post_init__(self) -> None:
        validate_choice("normalize", self.normalize, NORMALIZE_CHOICES)
        validate_choice("partial_group", self.partial_group, PARTIAL_GROUP_CHOICES)
        validate_choice("schedule_on", self.schedule_on, SCHEDULE_ON_CHOICES)
        validate_choice("on_nonfinite", self.on_nonfinite, ON_NONFINITE_CHOICES)
        limit = self.max_consecutive_skips
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(
                f"`max_consecutive_skips` must be a positive int or None, got {limit!r}."
                " Pass e.g. `max_consecutive_skips=100`, or None to never stop."
            )
        if not isinstance(self.global_order, bool):
            raise TypeError(
                f"`global_order` must be a bool, got {self.global_order!r}. Pass True to read the training data in one"
                " seeded order dealt to the replicas, or False to keep Lightning's samplers."
            )
        if self.count_tokens is not None and not callable(self.count_tokens):
            raise TypeError(
                f"`count_tokens` must be a callable `batch -> int | Tensor` or None, got "
                f"{type(self.count_tokens).__name__}. Pass e.g. `count_tokens=lambda b: (b['labels'] != -100).sum()`."
            )
