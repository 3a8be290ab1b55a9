"""The options of exact accumulation: allowed values, validation, and one frozen record of them.

Pure Python: no torch, no Lightning. The strategies take these as keyword arguments and hand them to the
engine as one :class:`AccumulationOptions`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = [
    "NORMALIZE_CHOICES",
    "ON_NONFINITE_CHOICES",
    "PARTIAL_GROUP_CHOICES",
    "SCHEDULE_ON_CHOICES",
    "AccumulationOptions",
    "validate_choice",
]

NORMALIZE_CHOICES: tuple[str, ...] = ("auto", "tokens", "samples", "batches", "documents")
PARTIAL_GROUP_CHOICES: tuple[str, ...] = ("rescale", "drop")
SCHEDULE_ON_CHOICES: tuple[str, ...] = ("applied", "attempted")
ON_NONFINITE_CHOICES: tuple[str, ...] = ("skip", "raise", "ignore")


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
        normalize: The unit each micro-batch is weighted by: ``"tokens"``, ``"samples"``, ``"batches"``,
            ``"documents"``, or ``"auto"`` (documents if the step reports them, else tokens, else samples, else
            batches).
        count_tokens: Optional ``batch -> int | Tensor`` used when the step does not return ``num_tokens``.
        partial_group: ``"rescale"`` updates a partial final group with its real denominator; ``"drop"`` makes
            no update for it and records what it held.
        schedule_on: ``"applied"``: step-interval schedules advance once per applied update; ``"attempted"``:
            once per attempt (skipped ones included), as Lightning does.
        on_nonfinite: Without a GradScaler, what a non-finite group gradient does: ``"skip"`` the update,
            ``"raise"`` an error, or ``"ignore"`` it (update anyway).
        max_consecutive_skips: Stop with an error after this many consecutive skipped updates; ``None`` never
            stops.
        global_order: ``True``: the training data is read in one seeded order dealt to the replicas
            (:class:`~lightning_accum.sampler.GlobalOrderSampler`), so that group ``g`` holds the positions
            ``[g·B, (g+1)·B)`` of that order at any ``m``, ``A``, ``D``; ``False`` (the default): the loaders'
            samplers stay Lightning's (see ``docs/howto.md``).

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
        cls, owner: str, keywords: Mapping[str, Any], passed_to: Callable[..., Any] | None = None
    ) -> tuple[AccumulationOptions, dict[str, Any]]:
        """The options among ``keywords``, validated, and the others, for ``passed_to`` (the framework strategy's
        ``__init__`` under ``owner``; ``None``: no others; one with ``**kwargs`` takes them all).

        Raises:
            TypeError: A keyword neither takes, naming the options and ``passed_to``'s parameters.
        """
        names = [field.name for field in fields(cls)]
        others = {key: value for key, value in keywords.items() if key not in names}
        parameters = inspect.signature(passed_to).parameters if passed_to is not None else {}
        if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
            accepted = [name for name, p in parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
            for key in others.keys() - set(accepted):
                framework = getattr(passed_to, "__qualname__", "").partition(".")[0]
                besides = f"; and {', '.join(accepted)} ({framework}'s)" if accepted else ""
                raise TypeError(
                    f"{owner}() got an unexpected keyword argument {key!r}. It takes the options of exact"
                    f" accumulation: {', '.join(names)} (see `AccumulationOptions`){besides}. Pass one of those."
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
