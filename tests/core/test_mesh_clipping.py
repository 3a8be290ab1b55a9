"""Tensor-parallel runs as users run them: a Hugging Face Llama (built from a config) whose linears are parallelised
and whose embedding, norms and head stay plain tensors, clipped by norm and by value; and the callbacks (AxisLogger,
Horizon, AccumulationReport) with `accum/val_loss` under tp = 2 and dp × tp = 2 × 2, each against the one-device run
of the same groups."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from helpers import ListDataset, make_examples, make_trainer, relative_error, run_ddp
from lightning.pytorch.loggers import TensorBoardLogger
from strategies.test_model_parallel import UNEQUAL, DataParallelStridedSampler, Record, ShardedLM
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_accum import AccumulationReport, AxisLogger, Horizon, ModelParallelAccumulationStrategy, causal_lm_tokens

transformers = pytest.importorskip("transformers")

# ---------------------------------------------------------------------- a Hugging Face Llama, clipped

CLIPS = {"norm": 0.05, "value": 2e-3}  # both well below the first update's gradient (norm 0.9, largest entry 0.1)


class LlamaLM(L.LightningModule):
    """A two-layer Llama from a config; `configure_model` parallelises the attention and MLP linears only."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        config = transformers.LlamaConfig(
            vocab_size=12,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=16,
            tie_word_embeddings=False,
        )
        self.llama = transformers.LlamaForCausalLM(config)

    def configure_model(self) -> None:
        if self.device_mesh is None:
            return
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {
            **{f"self_attn.{name}_proj": ColwiseParallel() for name in ("q", "k", "v")},
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        }
        for layer in self.llama.model.layers:
            parallelize_module(layer, self.device_mesh["tensor_parallel"], plan)  # type: ignore[arg-type]

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Any:
        return self.llama(input_ids=batch["input_ids"], labels=batch["labels"])  # `count_tokens` reads the batch

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _fit_llama(folder: str, name: str, devices: int, algorithm: str | None) -> None:
    strategy: Any = ModelParallelAccumulationStrategy(
        data_parallel_size=1, tensor_parallel_size=2, count_tokens=causal_lm_tokens
    )
    if devices == 1:
        from lightning_accum import AccumulationStrategy

        strategy = AccumulationStrategy(count_tokens=causal_lm_tokens)
    trainer = make_trainer(
        strategy=strategy,
        devices=devices,
        accumulate_grad_batches=2,
        gradient_clip_val=CLIPS[algorithm] if algorithm else None,
        gradient_clip_algorithm=algorithm,
        callbacks=[Record(folder, name)],
    )
    examples = make_examples(UNEQUAL[:12], seed=12)
    trainer.fit(LlamaLM(), DataLoader(ListDataset(examples), batch_size=2))


def _llama_tp_runs(rank: int, folder: str) -> None:
    for algorithm in CLIPS:
        _fit_llama(folder, f"tp-{algorithm}", 2, algorithm)


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_a_llama_with_plain_and_dtensor_parameters_clips_under_tensor_parallelism_as_on_one_device(
    tmp_path: Path,
) -> None:
    folder = str(tmp_path)
    model = LlamaLM()
    kinds = {type(p).__name__ for p in model.parameters()}
    assert kinds == {"Parameter"}  # before sharding; after it, embedding, norms and lm_head stay plain (asserted below)
    run_ddp(_llama_tp_runs, folder)
    for name in ("one-norm", "one-value", "one-unclipped"):
        _fit_llama(folder, name, 1, None if name.endswith("unclipped") else name.split("-")[1])
    unclipped = torch.load(tmp_path / "one-unclipped-rank0.pt", weights_only=True)["params"]
    for algorithm in CLIPS:
        one = torch.load(tmp_path / f"one-{algorithm}-rank0.pt", weights_only=True)["params"]
        for rank in range(2):
            tp = torch.load(tmp_path / f"tp-{algorithm}-rank{rank}.pt", weights_only=True)["params"]
            error = relative_error(tp, one)
            assert error < 2e-6, (algorithm, rank, error)
        # The clipping acted: the clipped run is far from the unclipped one.
        assert relative_error(one, unclipped) > 1e-2, algorithm
        effect = relative_error(one, unclipped)
        print(f"\n{algorithm}: tensor parallel vs one device {error:.1e}; clipped vs unclipped {effect:.1e}")


def _strided_norms(rank: int, folder: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from lightning_accum.core.mesh_clipping import total_norm

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    whole = torch.randn(4, 3)
    local = whole.chunk(2)[rank]  # each rank holds its half, as FSDP2 leaves a parameter's gradient
    norms = {}
    # FSDP2 over a tensor-parallel shard (a 2-D mesh) places the data-parallel dimension as a strided shard.
    for name, placement in (("shard", Shard(0)), ("strided", _StridedShard(0, split_factor=1))):
        grad = DTensor.from_local(local, mesh, [placement], run_check=False)
        norms[name] = total_norm([grad]).item()
    norms["replicated"] = total_norm([DTensor.from_local(whole, mesh, [Replicate()], run_check=False)]).item()
    norms["expected"] = torch.linalg.vector_norm(whole.double()).item()
    with open(os.path.join(folder, f"norms-rank{rank}.json"), "w") as file:
        json.dump(norms, file)


@pytest.mark.ddp
def test_the_norm_counts_a_strided_shard_of_every_rank(tmp_path: Path) -> None:
    # Under dp × tp the norm missed the other data-parallel ranks' parts of every tensor-parallel parameter (torch
    # 2.13's strided shard is no `Shard`): clipping under FSDP2 over tensor parallelism clipped by another factor than
    # one device (the 4-process test of test_model_parallel: 2.9e-3 from the one-device run, 1e-5 allowed).
    run_ddp(_strided_norms, str(tmp_path))
    for rank in range(2):
        norms = json.loads((tmp_path / f"norms-rank{rank}.json").read_text())
        for name in ("shard", "strided", "replicated"):
            assert norms[name] == pytest.approx(norms["expected"], rel=1e-6), (rank, name, norms)


def test_mesh_clipping_equals_torch_on_plain_tensors() -> None:
    from lightning_accum.core.mesh_clipping import clip_grad_norm_, clip_grad_value_, total_norm

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn_like(p)
    grads = [p.grad.clone() for p in params]  # type: ignore[union-attr]
    for norm_type in (2.0, 1.0, float("inf")):
        expected = torch.nn.utils.get_total_norm(grads, norm_type)
        assert total_norm(grads, norm_type).item() == pytest.approx(expected.item(), rel=1e-6)
    ours = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for mine, grad in zip(ours, grads, strict=True):
        mine.grad = grad.clone()
    returned = clip_grad_norm_(ours, 0.5)
    assert returned.item() == pytest.approx(torch.nn.utils.clip_grad_norm_(params, 0.5).item(), rel=1e-6)
    for mine, theirs in zip(ours, params, strict=True):
        assert torch.allclose(mine.grad, theirs.grad, rtol=1e-6, atol=0)  # type: ignore[arg-type]
    clip_grad_value_(ours, 0.1)
    torch.nn.utils.clip_grad_value_(params, 0.1)
    for mine, theirs in zip(ours, params, strict=True):
        assert torch.equal(mine.grad, theirs.grad)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- the callbacks under tp and dp × tp

VALIDATION = make_examples(UNEQUAL[:10], seed=11)


class EvaluatedLM(ShardedLM):
    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Any:
        return self.training_step(batch, batch_idx)


def _callbacks_run(folder: str, name: str, layout: str | None, dp: int, tp: int, accumulate: int) -> None:
    devices = dp * tp
    strategy: Any = "accum"
    if devices > 1:
        strategy = ModelParallelAccumulationStrategy(data_parallel_size=dp, tensor_parallel_size=tp)
    root = os.path.join(folder, name)
    trainer = make_trainer(
        strategy=strategy,
        devices=devices,
        accumulate_grad_batches=accumulate,
        default_root_dir=root,
        logger=TensorBoardLogger(root, name="tb", version=0),
        callbacks=[
            AxisLogger(axis="tokens"),
            Horizon(axis="tokens", validate_every=20, checkpoint_every=30),
            AccumulationReport(path=root),
            Record(folder, name),
        ],
        log_every_n_steps=1,
        check_val_every_n_epoch=None,
        val_check_interval=10**12,  # validation on the tokens axis only (Horizon)
    )
    examples = make_examples(UNEQUAL, seed=8)
    train = DataLoader(ListDataset(examples), batch_size=2, sampler=DataParallelStridedSampler(len(examples), tp))
    val = DataLoader(ListDataset(VALIDATION), batch_size=3, sampler=DataParallelStridedSampler(len(VALIDATION), tp))
    trainer.fit(EvaluatedLM(layout, optimizer="sgd"), train, val)


def _tp_callbacks(rank: int, folder: str) -> None:
    _callbacks_run(folder, "tp", "tp", 1, 2, 2)


def _two_d_callbacks(rank: int, folder: str) -> None:
    _callbacks_run(folder, "2d", "2d", 2, 2, 2)


def _scalars(root: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(root / "tb" / "version_0"), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _compare_with_one_device(folder: Path, name: str, replicas: int) -> None:
    _callbacks_run(str(folder), "one", None, 1, 1, 2 * replicas)  # the same groups on one device: A·D micro-batches
    one, sharded = _scalars(folder / "one"), _scalars(folder / name)
    for tag in ("accum/loss", "accum/val_loss", "accum/val_perplexity", "accum/tokens_per_update"):
        assert [x for x, _ in sharded[tag]] == [x for x, _ in one[tag]], tag  # the same tokens axis
        for (_, got), (_, expected) in zip(sharded[tag], one[tag], strict=True):
            assert got == pytest.approx(expected, rel=1e-5), tag
    assert len(one["accum/val_loss"]) >= 3  # Horizon validated at every 20 tokens
    # Horizon's checkpoints at the same token counts (folders of shards under the model-parallel strategy).
    one_points = sorted(p.name for p in (folder / "one" / "checkpoints").iterdir())
    sharded_points = sorted(p.name for p in (folder / name / "checkpoints").iterdir())
    assert one_points == sharded_points and len(one_points) >= 2, (one_points, sharded_points)
    assert all((folder / name / "checkpoints" / point).is_dir() for point in sharded_points)
    reports = [json.loads((folder / run / "accumulation_report.json").read_text()) for run in ("one", name)]
    for key in ("tokens", "samples", "updates"):
        assert reports[1][key] == reports[0][key], key
    assert reports[1]["data_parallel_replicas"] == replicas and reports[1]["tensor_parallel_size"] == 2
    params = [torch.load(folder / f"{name}-rank{r}.pt", weights_only=True)["params"] for r in range(2 * replicas)]
    expected = torch.load(folder / "one-rank0.pt", weights_only=True)["params"]
    assert max(relative_error(p, expected) for p in params) < 1e-5


@pytest.mark.ddp
@pytest.mark.timeout(600)
def test_axis_logger_horizon_report_and_validation_under_tensor_parallelism(tmp_path: Path) -> None:
    run_ddp(_tp_callbacks, str(tmp_path))
    _compare_with_one_device(tmp_path, "tp", replicas=1)


@pytest.mark.ddp
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_axis_logger_horizon_report_and_validation_under_fsdp2_times_tensor_parallelism(tmp_path: Path) -> None:
    run_ddp(_two_d_callbacks, str(tmp_path), world_size=4)
    _compare_with_one_device(tmp_path, "2d", replicas=2)
