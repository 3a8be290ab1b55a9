"""One rulebook behind both doors: every rule of the manual API holds in the Trainer's manual `training_step` and in
a Fabric loop alike, with the same error at the point of the mistake.

Each rule is one scenario, written once against a small `Door` interface and run through both doors: the
`TrainerDoor` inside a real `Trainer.fit` of a manual LightningModule (`self.manual_backward`, `self.clip_gradients`,
`strategy.no_backward_sync()`), the `FabricDoor` in a real Fabric loop (`fabric.backward`, `fabric.clip_gradients`,
`fabric.no_backward_sync(model)`). The rules live in the core (`core/manual.py`, `core/core.py`); a rule
added at one door only fails here at the other."""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import (
    IGNORE,
    TinyLM,
    fit,
    forked_ddp,
    make_examples,
    params_vector,
    random_lengths,
    sgd_reference,
    token_weighted_grad,
)
from test_fabric import TinyNet, micro_batches

from lightning_accum.core.rules import RULES

EXAMPLES = make_examples(random_lengths(16, seed=5), seed=5)
LR = 0.5


class Door:
    """What a scenario does, as each door spells it."""

    model: Any
    optimizers: list[Any]

    def accumulate(self, loss: Any, tokens: torch.Tensor, group_size: int | None = None) -> torch.Tensor:
        raise NotImplementedError

    def backward(self, tensor: torch.Tensor, retain_graph: bool = False) -> None:
        raise NotImplementedError

    def no_sync(self) -> AbstractContextManager[Any]:
        raise NotImplementedError

    def clip(self, optimizer: Any, max_norm: float) -> None:
        raise NotImplementedError

    def close(self, optimizer: Any, group_size: int | None = None) -> Any:
        raise NotImplementedError

    def setup_another_model(self) -> None:
        raise NotImplementedError

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE)
        return loss, (batch["labels"] != IGNORE).sum()

    def micro_batch(
        self, batch: dict[str, torch.Tensor], retain_graph: bool = False, group_size: int | None = None
    ) -> torch.Tensor:
        loss, tokens = self.loss(batch)
        tensor = self.accumulate(loss, tokens, group_size)
        self.backward(tensor, retain_graph=retain_graph)
        return tensor


class TrainerDoor(Door):
    def __init__(self, module: L.LightningModule) -> None:
        self.module, self.model = module, module
        self.strategy: Any = module.trainer.strategy
        optimizers = module.optimizers()
        self.optimizers = optimizers if isinstance(optimizers, list) else [optimizers]

    def accumulate(self, loss: Any, tokens: torch.Tensor, group_size: int | None = None) -> torch.Tensor:
        return self.strategy.accumulate(loss, num_tokens=tokens, group_size=group_size)  # type: ignore[no-any-return]

    def backward(self, tensor: torch.Tensor, retain_graph: bool = False) -> None:
        self.module.manual_backward(tensor, retain_graph=retain_graph)

    def no_sync(self) -> AbstractContextManager[Any]:
        return self.strategy.no_backward_sync()  # type: ignore[no-any-return]

    def clip(self, optimizer: Any, max_norm: float) -> None:
        self.module.clip_gradients(optimizer, gradient_clip_val=max_norm, gradient_clip_algorithm="norm")

    def close(self, optimizer: Any, group_size: int | None = None) -> Any:
        return self.strategy.close_group(optimizer, group_size=group_size)


class FabricDoor(Door):
    def __init__(self, fabric: L.Fabric, model: Any, optimizers: list[Any]) -> None:
        self.fabric, self.model, self.optimizers = fabric, model, optimizers

    def accumulate(self, loss: Any, tokens: torch.Tensor, group_size: int | None = None) -> torch.Tensor:
        strategy: Any = self.fabric.strategy
        return strategy.accumulate(loss, num_tokens=tokens, group_size=group_size)  # type: ignore[no-any-return]

    def backward(self, tensor: torch.Tensor, retain_graph: bool = False) -> None:
        self.fabric.backward(tensor, retain_graph=retain_graph)

    def no_sync(self) -> AbstractContextManager[Any]:
        return self.fabric.no_backward_sync(self.model, enabled=True)

    def clip(self, optimizer: Any, max_norm: float) -> None:
        self.fabric.clip_gradients(self.model, optimizer, max_norm=max_norm)

    def close(self, optimizer: Any, group_size: int | None = None) -> Any:
        return self.fabric.strategy.close_group(optimizer, group_size=group_size)  # type: ignore[attr-defined]

    def setup_another_model(self) -> None:
        self.fabric.setup_module(TinyNet().to(torch.float64))


# ---------------------------------------------------------------------- the scenarios (one per rule)


def clip_inside(door: Door, batches: list[dict[str, torch.Tensor]]) -> None:
    for batch in batches[:2]:
        door.micro_batch(batch)
    door.clip(door.optimizers[0], max_norm=0.5)


def clip_after_close(door: Door, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    for batch in batches:
        door.micro_batch(batch)
    door.close(door.optimizers[0])
    door.clip(door.optimizers[0], max_norm=0.5)
    grads = torch.cat([p.grad.reshape(-1).to(torch.float64) for p in door.model.parameters()])
    door.optimizers[0].step()
    return grads


def plain_backward(door: Door, batches: list[dict[str, torch.Tensor]]) -> None:
    door.micro_batch(batches[0])
    loss, _ = door.loss(batches[1])
    door.backward(loss / 4)  # LitGPT's old line left in a group


def double_backward(door: Door, batches: list[dict[str, torch.Tensor]]) -> None:
    handed = door.micro_batch(batches[0], retain_graph=True)
    door.backward(handed)


def second_close(door: Door, batches: list[dict[str, torch.Tensor]]) -> None:
    door.micro_batch(batches[0])
    door.close(door.optimizers[0])
    door.optimizers[0].step()
    door.close(door.optimizers[0])


def other_optimizer(door: Door, batches: list[dict[str, torch.Tensor]]) -> None:
    for batch in batches[:2]:
        door.micro_batch(batch)
    door.close(door.optimizers[0])  # the embedding's optimizer; the backward reached the head's too


def last_backward_unsynced(door: Door, batches: list[dict[str, torch.Tensor]]) -> str:
    for batch in batches[:2]:
        with door.no_sync():  # the mistake: `enabled=not last` intended
            door.micro_batch(batch)
    door.close(door.optimizers[0])
    door.optimizers[0].step()
    return "closed"


def forgotten_zero_grad(door: Door, batches: list[dict[str, torch.Tensor]]) -> None:
    door.micro_batch(batches[0])
    door.close(door.optimizers[0])
    door.optimizers[0].step()  # the mistake: no `zero_grad()` before the next group
    door.micro_batch(batches[1])
    door.close(door.optimizers[0])


def backward_before_the_group(door: Door, batches: list[dict[str, torch.Tensor]]) -> None:
    loss, _ = door.loss(batches[0])
    door.backward(loss / 4)  # LitGPT's old line left for a group's first micro-batch, before any `accumulate`
    door.micro_batch(batches[1])
    door.close(door.optimizers[0])


def torch_backward_inside(door: Door, batches: list[dict[str, torch.Tensor]]) -> None:
    door.micro_batch(batches[0])
    loss, _ = door.loss(batches[1])
    (loss / 4).backward()  # torch's own backward, LitGPT's old line, inside a group
    door.micro_batch(batches[2])
    door.close(door.optimizers[0])


def zero_grad_inside(door: Door, batches: list[dict[str, torch.Tensor]], set_to_none: bool = True) -> None:
    door.micro_batch(batches[0])
    door.optimizers[0].zero_grad(set_to_none=set_to_none)  # the seed's first symptom: gradients cleared in a group
    door.micro_batch(batches[1])
    door.close(door.optimizers[0])


def zero_grad_in_place_inside(door: Door, batches: list[dict[str, torch.Tensor]]) -> None:
    zero_grad_inside(door, batches, set_to_none=False)


def abandoned_group(door: Door, batches: list[dict[str, torch.Tensor]]) -> None:
    for batch in batches[:2]:
        door.micro_batch(batch)
    door.optimizers[0].zero_grad()  # the group given up without a close, as a plain loop skips one
    for batch in batches[2:4]:
        door.micro_batch(batch)
    door.close(door.optimizers[0])
    door.optimizers[0].step()


def zero_grad_in_place_between_groups(door: Door, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    for group in (batches[:2], batches[2:4]):
        for batch in group:
            door.micro_batch(batch)
        door.close(door.optimizers[0])
        door.optimizers[0].step()
        door.optimizers[0].zero_grad(set_to_none=False)  # zeros kept in place: the next group opens on them
    return params_vector(door.model)


def accumulate_in_automatic(door: Door, batches: list[dict[str, torch.Tensor]]) -> None:
    door.micro_batch(batches[0])  # a Trainer's `training_step` under automatic optimization


def accumulate_before_the_step(door: Door, batches: list[dict[str, torch.Tensor]]) -> None:
    door.micro_batch(batches[0])
    door.close(door.optimizers[0])
    door.micro_batch(batches[1])  # the mistake: the closed group's `optimizer.step()` never ran


def never_backpropagated(door: Door, batches: list[dict[str, torch.Tensor]]) -> None:
    door.accumulate(*door.loss(batches[0]))  # handed out, never back-propagated
    door.close(door.optimizers[0])


def backpropagated_late(door: Door, batches: list[dict[str, torch.Tensor]]) -> None:
    door.accumulate(*door.loss(batches[0]))
    door.accumulate(*door.loss(batches[1]))  # the first one's backward was meant to come first


def loss_as_a_float(door: Door, batches: list[dict[str, torch.Tensor]]) -> None:
    loss, tokens = door.loss(batches[0])
    door.accumulate(loss.item(), tokens)


def group_size_zero(door: Door, batches: list[dict[str, torch.Tensor]]) -> None:
    door.micro_batch(batches[0], group_size=0)


def joins_a_group_of_one(door: Door, batches: list[dict[str, torch.Tensor]]) -> None:
    door.micro_batch(batches[0], group_size=1)
    door.micro_batch(batches[1])


def closed_with_a_smaller_group_size(door: Door, batches: list[dict[str, torch.Tensor]]) -> None:
    for batch in batches[:2]:
        door.micro_batch(batch)
    door.close(door.optimizers[0], group_size=1)


def step_without_close(door: Door, batches: list[dict[str, torch.Tensor]]) -> None:
    door.micro_batch(batches[0])
    door.optimizers[0].step()


def step_of_the_other_optimizer(door: Door, batches: list[dict[str, torch.Tensor]]) -> None:
    for p in door.optimizers[1].param_groups[0]["params"]:
        p.requires_grad_(False)  # the loss reaches the first optimizer's parameters only
    door.micro_batch(batches[0])
    door.close(door.optimizers[0])
    door.optimizers[1].step()


def setup_after_a_loop_left_its_group_open(door: Door, batches: list[dict[str, torch.Tensor]]) -> None:
    door.micro_batch(batches[0])  # the first loop ends here, inside its group
    door.setup_another_model()


SCENARIOS: dict[str, Callable[[Door, list[dict[str, torch.Tensor]]], Any]] = {
    f.__name__: f
    for f in (
        clip_inside,
        clip_after_close,
        plain_backward,
        double_backward,
        second_close,
        other_optimizer,
        last_backward_unsynced,
        forgotten_zero_grad,
        backward_before_the_group,
        torch_backward_inside,
        zero_grad_inside,
        zero_grad_in_place_inside,
        abandoned_group,
        zero_grad_in_place_between_groups,
        accumulate_in_automatic,
        accumulate_before_the_step,
        never_backpropagated,
        backpropagated_late,
        loss_as_a_float,
        group_size_zero,
        joins_a_group_of_one,
        closed_with_a_smaller_group_size,
        step_without_close,
        step_of_the_other_optimizer,
        setup_after_a_loop_left_its_group_open,
    )
}

# ---------------------------------------------------------------------- running a scenario through a door


class ManualScenario(TinyLM):
    """A manual LightningModule that runs one scenario in its first `training_step`."""

    def __init__(self, scenario: str, two_optimizers: bool = False, automatic: bool = False) -> None:
        super().__init__(lr=LR)
        self.automatic_optimization = automatic
        self.scenario, self.two_optimizers = scenario, two_optimizers
        self.result: Any = None

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        batches = micro_batches(EXAMPLES[self.global_rank :: self.trainer.world_size][:8], 2)
        self.result = SCENARIOS[self.scenario](TrainerDoor(self), batches)

    def configure_optimizers(self) -> Any:
        if self.two_optimizers:
            return [torch.optim.SGD(self.embed.parameters(), lr=LR), torch.optim.SGD(self.head.parameters(), lr=LR)]
        return torch.optim.SGD(self.parameters(), lr=LR)


def through_trainer(scenario: str, devices: int = 1, two_optimizers: bool = False, automatic: bool = False) -> Any:
    module = ManualScenario(scenario, two_optimizers, automatic)
    strategy: Any = "accum" if devices == 1 else forked_ddp()
    fit(
        module,
        EXAMPLES[:devices],
        batch_size=1,
        accumulate=1,
        strategy=strategy,
        devices=devices,
        max_steps=1,
        precision="64-true",
    )
    return module.result


def _fabric_worker(fabric: L.Fabric, scenario: str, two_optimizers: bool) -> Any:
    model = fabric.setup_module(TinyNet().to(torch.float64))
    if two_optimizers:
        optimizers = list(
            fabric.setup_optimizers(
                torch.optim.SGD(model.embed.parameters(), lr=LR), torch.optim.SGD(model.head.parameters(), lr=LR)
            )
        )
    else:
        optimizers = [fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR))]
    batches = micro_batches(EXAMPLES[fabric.global_rank :: fabric.world_size][:8], 2)
    return SCENARIOS[scenario](FabricDoor(fabric, model, optimizers), batches)


def through_fabric(scenario: str, devices: int = 1, two_optimizers: bool = False) -> Any:
    from lightning_accum import FabricDDPAccumulationStrategy

    strategy: Any = "accum" if devices == 1 else FabricDDPAccumulationStrategy(start_method="forkserver")
    fabric = L.Fabric(strategy=strategy, devices=devices, accelerator="cpu")
    worker = functools.partial(_fabric_worker, scenario=scenario, two_optimizers=two_optimizers)
    if devices == 1:
        return worker(fabric)
    return fabric.launch(worker)


DOORS = {"trainer": through_trainer, "fabric": through_fabric}


# ---------------------------------------------------------------------- the rules, each over both doors


@dataclass(frozen=True)
class Case:
    """A scenario that breaks one rule, the words its error must say, and how it runs."""

    scenario: str
    match: str
    devices: int = 1  # 2: a rule about replicas, on two processes over gloo
    two_optimizers: bool = False
    doors: tuple[str, ...] = ("trainer", "fabric")  # fewer only where the other door cannot make the mistake
    error: type[Exception] = RuntimeError


CLEARED = r"3 parameter gradient\(s\) set to None \(`optimizer.zero_grad\(\)`.*abandoned without `close_group`"
TOUCHED = r"`backward`: the gradient of the open accumulation group \(\d micro-batch\(es\).*"
STALE = r"`close_group`: the group opened while 3 optimized parameter\(s\) already held a nonzero gradient"

#: Every rule of core/rules.RULES, with the scenarios that break it. Before this table (issue #58): of the 16
#: refusals, 7 were tested through both doors, 6 through one, 3 by no test naming their message.
RULEBOOK: dict[str, list[Case]] = {
    "manual_api_in_automatic_optimization": [
        # Fabric has no automatic optimization: the loop is the user's.
        Case(
            "accumulate_in_automatic",
            r"`strategy.accumulate` is for manual optimization.*'num_tokens'",
            doors=("trainer",),
        ),
    ],
    "step_pending": [
        Case(
            "accumulate_before_the_step", r"`strategy.accumulate` was called while the group closed by .*optimizer.step"
        ),
    ],
    "handed_out_not_backpropagated": [
        Case("never_backpropagated", r"`strategy.close_group` was called while the tensor the last .* never back-prop"),
        Case("backpropagated_late", r"`strategy.accumulate` was called while the tensor the last"),
    ],
    "loss_not_a_tensor": [Case("loss_as_a_float", r"mean loss as a tensor, got float", error=TypeError)],
    "group_size_not_positive": [
        Case("group_size_zero", r"`group_size` must be a positive int or None, got 0", error=ValueError)
    ],
    "sole_microbatch_joined": [
        Case("joins_a_group_of_one", r"reported with `group_size=1`.*Call `close_group\(optimizer\)`")
    ],
    "foreign_backward": [
        Case("plain_backward", "did not hand out, while the open group holds 1 micro-batch"),
        Case("double_backward", "did not hand out, while the open group holds 1 micro-batch"),
    ],
    "gradient_changed_outside": [
        Case("zero_grad_inside", TOUCHED + CLEARED),  # the seed's first symptom
        Case("abandoned_group", TOUCHED + CLEARED),
        Case("zero_grad_in_place_inside", TOUCHED + r"3 parameter gradient\(s\) zeroed in place"),
        # Fabric's own hook refuses `loss.backward()` at once with its words; the core's message matches them.
        Case("torch_backward_inside", r"instead of `loss.backward\(\)`"),
    ],
    "close_without_microbatches": [
        Case("second_close", r"found no micro-batch.*was closed already: a group is closed once")
    ],
    "last_backward_unsynced": [
        Case(
            "last_backward_unsynced",
            r"last backward ran with gradient synchronisation blocked.*`enabled=not last`",
            devices=2,
        ),
    ],
    "another_optimizers_gradient": [
        Case("other_optimizer", r"also reached the parameters of another optimizer \(SGD\)", two_optimizers=True),
    ],
    "group_size_exceeded": [
        Case(
            "closed_with_a_smaller_group_size",
            r"group_size=1\)`: the open group holds 2 micro-batches",
            error=ValueError,
        ),
    ],
    "stale_gradient_at_opening": [Case("forgotten_zero_grad", STALE), Case("backward_before_the_group", STALE)],
    "step_inside_open_group": [
        Case("step_without_close", r"`SGD.step\(\)` was called while 1 micro-batch.*close_group")
    ],
    "step_of_another_optimizer": [
        Case(
            "step_of_the_other_optimizer",
            r"`SGD.step\(\)` was called while the group closed .* another optimizer",
            two_optimizers=True,
        ),
    ],
    "group_left_open_at_setup": [
        # A Trainer's entry point ends its group at its teardown: no second loop can find one open.
        Case(
            "setup_after_a_loop_left_its_group_open",
            r"`fabric.setup_module` was called while an accumulation group",
            doors=("fabric",),
        ),
    ],
    "clipping_inside_open_group": [
        Case(
            "clip_inside", r"was called inside an open accumulation group \(2 micro-batch\(es\) reported\).*close_group"
        ),
    ],
}

RUNS = [
    pytest.param(
        rule, case, door, id=f"{rule}-{case.scenario}-{door}", marks=[pytest.mark.ddp] if case.devices > 1 else []
    )
    for rule, cases in RULEBOOK.items()
    for case in cases
    for door in case.doors
]


def test_every_rule_has_a_scenario_and_every_scenario_a_rule() -> None:
    assert sorted(RULEBOOK) == sorted(RULES)
    assert all(RULEBOOK[rule] for rule in RULEBOOK)
    assert all(case.scenario in SCENARIOS for cases in RULEBOOK.values() for case in cases)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("rule", "case", "door"), RUNS)
def test_every_rule_is_refused_in_its_words_at_every_door(rule: str, case: Case, door: str) -> None:
    options: dict[str, Any] = {"devices": case.devices, "two_optimizers": case.two_optimizers}
    if rule == "manual_api_in_automatic_optimization":
        options["automatic"] = True
    with pytest.raises(Exception, match=case.match) as info:
        DOORS[door](case.scenario, **options)
    # A spawned worker's error comes back in the launch's error, with its type and text.
    assert isinstance(info.value, case.error) or case.error.__name__ in str(info.value)
    assert RULES[rule].error is case.error


# ---------------------------------------------------------------------- what the rules let through


@pytest.mark.parametrize("door", DOORS)
def test_clipping_after_the_close_clips_the_groups_exact_gradient(door: str) -> None:
    grads = DOORS[door]("clip_after_close")
    expected = token_weighted_grad(TinyNet().to(torch.float64), EXAMPLES[:8])
    clipped = expected * min(1.0, 0.5 / (float(expected.norm()) + 1e-6))  # torch's clip_grad_norm_
    torch.testing.assert_close(grads, clipped, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("door", DOORS)
def test_a_last_backward_without_sync_is_fine_on_one_replica(door: str) -> None:
    assert DOORS[door]("last_backward_unsynced") == "closed"  # nothing to combine: no rule to break


@pytest.mark.parametrize("door", DOORS)
def test_a_gradient_zeroed_in_place_before_the_group_opens_trains_exactly(door: str) -> None:
    # Before: refused at both doors (`zero_grad(set_to_none=False)` could not be told from a stale gradient).
    expected = sgd_reference(TinyNet(), [EXAMPLES[:4], EXAMPLES[4:8]], lr=LR)
    torch.testing.assert_close(DOORS[door]("zero_grad_in_place_between_groups"), expected, rtol=1e-12, atol=1e-14)
