"""Recipe: LightningCLI with exact accumulation, everything set in a YAML file (``examples/cli.yaml``).

The strategy (with its options), ``accumulate_grad_batches`` and the package's callbacks are ordinary
Trainer arguments, so a config file or the command line sets them like any other::

    python examples/cli.py fit --config examples/cli.yaml
    python examples/cli.py fit --config examples/cli.yaml --trainer.accumulate_grad_batches 8 --data.batch_size 2

The logs (curves on the tokens axis) and the run record go to ``runs/cli``.
"""

from __future__ import annotations

import os
import sys

import lightning as L
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the recipes' shared model and data

from _data import RandomSequences, TinyLM

import lightning_accum  # noqa: F401  (importing registers the strategy strings)


class SequenceData(L.LightningDataModule):
    """Variable-length sequences, in a fixed order."""

    def __init__(self, batch_size: int = 4, num_examples: int = 256, seq_len: int = 16) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.data = RandomSequences(num_examples, seq_len)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size)


def main(args: list[str] | None = None) -> LightningCLI:
    return LightningCLI(TinyLM, SequenceData, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
