"""A mid-group `fabric.save` resumes exactly under another strategy class and another replica count, both ways
(`accum` on one device -> `accum_ddp` on two processes, and back), against the float64 one-device run; after
`fabric.launch(fn)` under spawn the main process's ledger holds the run's counts; a loop of micro-batches cut by
tokens resumes its plan mid-epoch in a later epoch."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import IGNORE, ListDataset, TinyLM, make_examples, params_vector, random_lengths, sgd_reference
from test_fabric import LR, TinyNet, stack
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_accum import FabricAccumulationStrategy, FabricDDPAccumulationStrategy, TokenBatches
from lightning_accum.core.entry import CHECKPOINT_KEY

EXAMPLES = make_examples(random_lengths(24, seed=21), seed=21)
GROUP = 8  # examples per update, whatever the split
TOKENS = sum(int((e["labels"] != IGNORE).sum()) for e in EXAMPLES)


def _plan(rank: int, world: int, m: int, start: int, stop: int) -> list[list[dict[str, Tensor]]]:
    """Per group of examples [start, stop): this rank's micro-batches of `m` (rank r reads every world-th example)."""
    bounds = [start, *range((start // GROUP + 1) * GROUP, stop, GROUP), stop]  # the one-device groups' ends
    groups = []
    for first, end in itertools.pairwise(bounds):
        mine = EXAMPLES[first:end][rank::world]
        groups.append([stack(mine[i : i + m]) for i in range(0, len(mine), m)])
    return groups


def _setup(fabric: L.Fabric) -> tuple[Any, Any]:
    model = TinyNet(seed=0).double()  # float64 under "32-true": the one-device reference's precision
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    return fabric.setup(model, optimizer)


def _train(
    fabric: L.Fabric, model: Any, optimizer: Any, groups: list[list[dict[str, Tensor]]], save: Any, size: Any = None
) -> None:
    """LitGPT's loop shape; `save = (group, after, path)`: save after that many micro-batches of that group, stop;
    `size`: the `group_size=` each close passes (a group's micro-batches per replica)."""
    for g, group in enumerate(groups):
        for i, batch in enumerate(group):
            last = i == len(group) - 1
            with fabric.no_backward_sync(model, enabled=not last):
                logits = model(batch["input_ids"])
                loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE)
                tokens = (batch["labels"] != IGNORE).sum()
                fabric.backward(fabric.strategy.accumulate(loss, num_tokens=tokens, batch=batch))
            if save is not None and (g, i + 1) == save[:2]:
                fabric.save(save[2], {"model": model, "optimizer": optimizer})
                return
        fabric.strategy.close_group(optimizer, group_size=size)
        optimizer.step()
        optimizer.zero_grad()


def _part(
    fabric: L.Fabric, m: int, start: int, stop: int, save: Any = None, load: str | None = None, sized: bool = False
) -> dict[str, Any]:
    model, optimizer = _setup(fabric)
    if load is not None:
        fabric.load(load, {"model": model, "optimizer": optimizer})
    size = GROUP // (m * fabric.world_size) if sized else None
    _train(fabric, model, optimizer, _plan(fabric.global_rank, fabric.world_size, m, start, stop), save, size)
    return {"params": params_vector(model).tolist(), "ledger": fabric.strategy.ledger.state_dict()}


def _two_processes(*args: Any, partial_group: str = "rescale") -> tuple[L.Fabric, dict[str, Any]]:
    strategy = FabricDDPAccumulationStrategy(start_method="forkserver", partial_group=partial_group)
    fabric = L.Fabric(strategy=strategy, devices=2, accelerator="cpu")
    return fabric, fabric.launch(_part, *args)


def _one_device(*args: Any) -> dict[str, Any]:
    return _part(L.Fabric(strategy="accum", accelerator="cpu"), *args)  # type: ignore[arg-type]


def _check(result: dict[str, Any]) -> None:
    reference = sgd_reference(TinyNet(seed=0), [EXAMPLES[i : i + GROUP] for i in range(0, 24, GROUP)], lr=LR)
    params = torch.tensor(result["params"], dtype=torch.float64)
    torch.testing.assert_close(params, reference, rtol=0, atol=1e-12)
    ledger = result["ledger"]
    assert (ledger["updates_applied"], ledger["samples"], ledger["tokens"]) == (3, 24, TOKENS)


@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_one_device_to_two_processes_resumes_a_group_exactly(tmp_path: Path) -> None:
    path = str(tmp_path / "one.ckpt")
    # One device, m = 2: group 1 (examples 8-15) saved after 2 of its micro-batches (examples 8-11).
    _one_device(2, 0, 24, (1, 2, path))
    entry = torch.load(path, weights_only=True)[CHECKPOINT_KEY]
    assert entry["config"]["strategy"] == "FabricAccumulationStrategy" and entry["open_group"]["carried"] is True
    # Two processes, m = 1, from example 12: the rest of group 1 on each rank (12, 14 / 13, 15), then group 2.
    fabric, result = _two_processes(1, 12, 24, None, path)
    _check(result)
    # The spawned run's counts are back in the main process (Fabric's launcher returns only rank zero's value).
    assert fabric.strategy.ledger.state_dict() == result["ledger"]  # type: ignore[attr-defined]


@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_two_processes_to_one_device_resumes_a_group_exactly(tmp_path: Path) -> None:
    path = str(tmp_path / "two.ckpt")
    # Two processes, m = 1: group 1 saved after 2 micro-batches per rank (examples 8, 10 / 9, 11).
    _two_processes(1, 0, 24, (1, 2, path))
    entry = torch.load(path, weights_only=True)[CHECKPOINT_KEY]
    assert entry["config"] == {
        "strategy": "FabricDDPAccumulationStrategy",
        "replicas": 2,
        "normalize": "auto",
        "partial_group": "rescale",
    }
    # Before: KeyError 'accumulate' (a second copy of the configuration, without that key). One device, m = 2.
    _check(_one_device(2, 12, 24, None, path))


@pytest.mark.ddp
@pytest.mark.timeout(300)
@pytest.mark.parametrize("partial_group", ["drop", "rescale"])
def test_a_group_completed_across_a_change_of_m_and_d_is_complete(tmp_path: Path, partial_group: str) -> None:
    path = str(tmp_path / "one.ckpt")
    # One device, m = 2 (group_size=4): group 1 (examples 8-15) saved after its first micro-batch (examples 8, 9).
    _one_device(2, 0, 24, (1, 1, path), None, True)
    # Two processes, m = 1 (group_size=4, still 8 examples per update), from example 10: 3 micro-batches per rank
    # finish group 1. Before: its place was taken as 1 carried micro-batch // 2 replicas = 0, so the complete group
    # was a partial one: dropped under "drop" (4.8e-2 off), counted as partial under "rescale", with an info line
    # about an epoch end that never happened. Now the carried examples say where it resumes.
    _, result = _two_processes(1, 10, 24, None, path, True, partial_group=partial_group)
    _check(result)
    assert result["ledger"]["partial_groups"] == 0 and result["ledger"]["dropped_microbatches"] == 0


ROWS = [{**row, "index": torch.tensor(i)} for i, row in enumerate(make_examples(random_lengths(44, seed=59), seed=59))]
TOKENS_OPTION = TokenBatches(
    max_tokens=8, lengths=[int((r["labels"] != IGNORE).sum()) for r in ROWS], samples_per_update=8
)


def _token_loop(path: Path, epochs: range, save: tuple[int, int, int] | None = None) -> tuple[Tensor, list[int]]:
    """A LitGPT-style loop over the token plan for `epochs`, from `path`'s state when the range does not start at 0;
    `save = (epoch, group, micro-batch)`: save there (the sampler's state after the micro-batches run) and stop."""
    fabric = L.Fabric(strategy=FabricAccumulationStrategy(token_batches=TOKENS_OPTION), accelerator="cpu")
    model = TinyLM(seed=59).double()  # float64 under "32-true": the checkpoint's weights restore unrounded
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
    loader = fabric.setup_dataloaders(DataLoader(ListDataset(ROWS), batch_size=4, shuffle=True))
    sampler, seen = loader.batch_sampler, []
    if epochs.start:
        fabric.load(str(path), {"model": model, "optimizer": optimizer, "sampler": sampler})
    for epoch in epochs:
        ran = 0  # this epoch's micro-batches run by this loop (what the sampler's state counts)
        for g, (size, batches) in enumerate(sampler.groups(loader)):
            for i, batch in enumerate(batches):
                loss = torch.nn.functional.cross_entropy(
                    model(batch["input_ids"]).flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE
                )
                fabric.backward(fabric.strategy.accumulate(loss, num_tokens=(batch["labels"] != IGNORE).sum()))
                seen += batch["index"].tolist()
                ran += 1
                if (epoch, g, i) == save:
                    fabric.save(str(path), {"model": model, "optimizer": optimizer, "sampler": sampler.state_dict(ran)})
                    return params_vector(model), seen
            fabric.strategy.close_group(optimizer, group_size=size)
            optimizer.step()
            optimizer.zero_grad()
    return params_vector(model), seen


def test_a_token_plan_resumes_mid_epoch_in_a_later_epoch_of_a_fabric_loop(tmp_path: Path) -> None:
    path = tmp_path / "tokens.ckpt"
    whole, order = _token_loop(path, range(3))
    _, before = _token_loop(path, range(3), save=(1, 2, 1))  # epoch 1, group 2, after its second micro-batch
    assert torch.load(path, weights_only=True)["sampler"]["epoch"] == 1
    # Fabric's loader sets the order's epoch from its own count of iterations, 0 after the resume: the sampler
    # counts it from the epoch its state continues (before, the resumed loop read epoch 0's order).
    resumed, after = _token_loop(path, range(1, 3))
    assert before + after == order
    diff = float((resumed - whole).abs().max())
    print(f"Fabric loop resumed inside group 2 of epoch 1: |params - uninterrupted| = {diff:.1e}")
    assert diff < 1e-12
