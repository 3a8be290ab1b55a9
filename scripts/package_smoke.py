"""The installed wheel used as a user uses it: run by scripts/check-package.sh in a fresh venv that holds the wheel and
what it requires (or one extra besides), never the source tree. Run it with ``python -I`` so that neither the working
directory nor PYTHONPATH can put the repository's copy of the package first.

    python -I scripts/package_smoke.py core      # the installed distribution, a Trainer fit and a Fabric loop
    python -I scripts/package_smoke.py hf        # an extra: what it is installed for (hf, loggers, rich, litgpt, demo)

Each check compares numbers with a float64 reference computed here, not only that the code ran, and prints one line.
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from packaging.requirements import Requirement

VOCAB, LENGTH = 32, 12


def examples(count: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Token sequences whose supervised lengths vary from 2 to LENGTH (the rest of the labels is -100)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        input_ids = torch.randint(0, VOCAB, (LENGTH,), generator=generator)
        labels = torch.randint(0, VOCAB, (LENGTH,), generator=generator)
        labels[int(torch.randint(2, LENGTH + 1, (1,), generator=generator)) :] = -100
        out.append({"input_ids": input_ids, "labels": labels})
    return out


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, VOCAB))


def group_loss(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> float:
    """The exact group loss in float64: Σ token losses / Σ supervised tokens over every micro-batch of the group."""
    model = copy.deepcopy(model).double()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            logits = model(batch["input_ids"])
            total += float(F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum"))
            tokens += int((batch["labels"] != -100).sum())
    return total / tokens


def check_installed() -> None:
    import lightning_accum

    dist = importlib.metadata.distribution("lightning-accum")
    where = Path(lightning_accum.__file__).resolve()
    assert where.is_relative_to(Path(sys.prefix).resolve()), f"lightning_accum imported from {where}, not the venv"
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    assert not direct.get("dir_info", {}).get("editable"), f"an editable install: {direct}"
    assert dist.version == lightning_accum.__version__, (dist.version, lightning_accum.__version__)
    assert dist.metadata["License-Expression"] == "Apache-2.0", dist.metadata["License-Expression"]
    files = {str(f) for f in dist.files or []}
    assert any(f.endswith("licenses/LICENSE") for f in files) and "lightning_accum/py.typed" in files, sorted(files)
    # The floor above the advisories' ranges: 2.5.0 to 2.6.5 are affected by CVE-2026-58659 (docs/project.md).
    (lightning,) = [r for r in map(Requirement, dist.requires or []) if r.name == "lightning"]
    assert lightning.specifier.contains("2.6.6") and not lightning.specifier.contains("2.6.5"), lightning
    print(f"[smoke] lightning-accum {dist.version} ({lightning}) installed from its wheel at {where.parent}")


def language_model() -> Any:
    """The README's kind of module: a mean token loss and the tokens it averages over, returned by the step."""
    import lightning as L

    class LM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net()

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
            logits = self.net(batch["input_ids"])
            loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
            return {"loss": loss, "num_tokens": (batch["labels"] != -100).sum()}

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.5)

    return LM()


def check_trainer(folder: Path) -> None:
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_accum import AccumulationReport, AxisLogger

    data = examples(16, seed=1)
    loader = DataLoader(data, batch_size=4)  # type: ignore[arg-type,var-annotated]  # 4 micro-batches, A = 2: 2 updates
    model = language_model()
    first_group = group_loss(model.net, list(loader)[:2])
    trainer = L.Trainer(
        strategy="accum",
        accumulate_grad_batches=2,
        max_epochs=1,
        accelerator="cpu",
        callbacks=[AxisLogger(axis="tokens"), AccumulationReport(path=str(folder / "report.json"))],
        logger=L.pytorch.loggers.TensorBoardLogger(str(folder / "runs")),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    losses: list[float] = []
    trainer.strategy.add_group_listener(lambda record, _: losses.append(record.loss))  # type: ignore[attr-defined]
    trainer.fit(model, loader)
    ledger = trainer.strategy.ledger  # type: ignore[attr-defined]
    tokens = sum(int((e["labels"] != -100).sum()) for e in data)
    assert ledger.updates_applied == 2 and ledger.tokens == tokens, (ledger.updates_applied, ledger.tokens, tokens)
    assert abs(losses[0] - first_group) < 1e-6, (losses[0], first_group)
    report = json.loads((folder / "report.json").read_text())
    assert report["accumulate_grad_batches"] == 2 and report["tokens"]["total"] == tokens, report
    assert list((folder / "runs").rglob("events.out.tfevents.*")), "no TensorBoard event file"
    print(f"[smoke] Trainer: 2 updates over {tokens} tokens, first group loss {losses[0]:.6f} = float64 reference")


def check_fabric() -> None:
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_accum import supervised_tokens

    fabric = L.Fabric(strategy="accum", accelerator="cpu", loggers=[])
    model = net()
    group = list(DataLoader(examples(8, seed=2), batch_size=4))  # type: ignore[arg-type]  # one group of 2 micro-batches
    reference = group_loss(model, group)
    module, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    for i, batch in enumerate(group):
        with fabric.no_backward_sync(module, enabled=i + 1 < len(group)):
            logits = module(batch["input_ids"])
            loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
            n = supervised_tokens(batch["labels"], shift=False)
            fabric.backward(fabric.strategy.accumulate(loss, num_tokens=n))  # type: ignore[attr-defined]
    record = fabric.strategy.close_group(optimizer)  # type: ignore[attr-defined]
    optimizer.step()
    optimizer.zero_grad()
    assert abs(record.loss - reference) < 1e-6, (record.loss, reference)
    assert fabric.strategy.ledger.updates_applied == 1  # type: ignore[attr-defined]
    print(f"[smoke] Fabric: group loss {record.loss:.6f} = float64 reference")


def check_hf() -> None:
    import lightning  # torchmetrics imports transformers when it is installed: the two must agree
    import transformers

    import lightning_accum

    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=LENGTH, vocab_size=VOCAB)
    model = transformers.GPT2LMHeadModel(config)
    batch = {key: torch.stack([e[key] for e in examples(2, seed=3)]) for key in ("input_ids", "labels")}
    loss = model(**batch).loss  # Hugging Face shifts the labels: the tokens are counted as shifted
    assert torch.isfinite(loss) and int(lightning_accum.causal_lm_tokens(batch)) > 0
    print(f"[smoke] hf: transformers {transformers.__version__} beside lightning {lightning.__version__}")


def check_loggers(folder: Path) -> None:
    import os

    import lightning as L
    import mlflow
    import wandb
    from lightning.pytorch.loggers import MLFlowLogger, WandbLogger
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient
    from packaging.version import Version
    from torch.utils.data import DataLoader

    from lightning_accum import AxisLogger

    # As docs/project.md says: W&B offline, MLflow on a local file store, which mlflow 3.13 and later refuse unless
    # MLFLOW_ALLOW_FILE_STORE=true. Without it first, so that the set-up the docs give stays the one needed.
    os.environ.update(WANDB_MODE="offline", WANDB_DIR=str(folder))
    for variable in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        os.environ[variable] = str(folder)
    os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)
    uri = "file:" + str(folder / "mlruns")
    if Version(mlflow.__version__) >= Version("3.13"):
        try:
            MLFlowLogger(experiment_name="refused", tracking_uri=uri).experiment  # noqa: B018  # the store is made here
        except MlflowException as error:
            assert "MLFLOW_ALLOW_FILE_STORE" in str(error), error
        else:
            raise AssertionError(f"mlflow {mlflow.__version__} takes a file store unasked: the docs' set-up is stale")
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"

    # AxisLogger with both loggers in one fit: MLflow's steps are the token counts after each update.
    data = examples(16, seed=5)
    loader = DataLoader(data, batch_size=4)  # type: ignore[arg-type,var-annotated]  # 4 micro-batches, A = 2: 2 updates
    mlflow_logger = MLFlowLogger(experiment_name="smoke", tracking_uri=uri)
    wandb_logger = WandbLogger(project="smoke", save_dir=str(folder))
    trainer = L.Trainer(
        strategy="accum",
        accumulate_grad_batches=2,
        max_epochs=1,
        accelerator="cpu",
        callbacks=[AxisLogger(axis="tokens")],
        logger=[mlflow_logger, wandb_logger],
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    ledger = trainer.strategy.ledger  # type: ignore[attr-defined]
    counts: list[int] = []
    trainer.strategy.add_group_listener(lambda record, _: counts.append(ledger.tokens))  # type: ignore[attr-defined]
    try:
        trainer.fit(language_model(), loader)
        run_dir = Path(wandb_logger.experiment.dir).parent
    finally:
        wandb_logger.experiment.finish()
        wandb.teardown()
    history = MlflowClient(tracking_uri=uri).get_metric_history(str(mlflow_logger.run_id), "accum/loss")
    assert len(counts) == 2 and [m.step for m in history] == counts, (history, counts)
    (run_file,) = run_dir.glob("*.wandb")
    assert run_file.stat().st_size > 7, run_file  # more than the header: the run's records were written
    print(
        f"[smoke] loggers: AxisLogger's accum/loss at tokens {counts} read back from mlflow {mlflow.__version__}"
        f" (its file store refused until MLFLOW_ALLOW_FILE_STORE=true), wandb {wandb.__version__} offline run written"
    )


def check_rich() -> None:
    from lightning_accum import AxisRichProgressBar

    AxisRichProgressBar()  # Lightning's RichProgressBar raises without rich
    print(f"[smoke] rich: AxisRichProgressBar on rich {importlib.metadata.version('rich')}")


def check_litgpt() -> None:
    from litgpt.config import Config
    from litgpt.model import GPT

    import lightning_accum

    config = Config(n_layer=1, n_head=2, n_embd=16, block_size=LENGTH, vocab_size=VOCAB, padded_vocab_size=VOCAB)
    logits = GPT(config)(torch.stack([b["input_ids"] for b in examples(2, seed=4)]))
    assert logits.shape == (2, LENGTH, VOCAB) and lightning_accum.__version__
    print(f"[smoke] litgpt {importlib.metadata.version('litgpt')}: a GPT forward beside lightning-accum")


def check_demo(folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots()
    axes.plot([0, 1], [1, 0])
    figure.savefig(folder / "demo.png")
    assert (folder / "demo.png").read_bytes()[:4] == b"\x89PNG"
    print(f"[smoke] demo: matplotlib {matplotlib.__version__} draws the demo's figure")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["core", "hf", "loggers", "rich", "litgpt", "demo"])
    what = parser.parse_args(argv).what
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)

        def core() -> None:
            check_installed()
            check_trainer(folder)
            check_fabric()

        checks: dict[str, Callable[[], None]] = {
            "core": core,
            "hf": check_hf,
            "loggers": lambda: check_loggers(folder),
            "rich": check_rich,
            "litgpt": check_litgpt,
            "demo": lambda: check_demo(folder),
        }
        checks[what]()


if __name__ == "__main__":
    main()
