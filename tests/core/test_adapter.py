"""core/adapter: a failed collective is recognised by its type or where it was raised, never by an error's words."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import IGNORE, ListDataset, ResumableLoader, TinyLM, ddp_trainer, make_examples, random_lengths, run_ddp
from torch import Tensor

from lightning_accum import DDPAccumulationStrategy


class _FailsWithWords(TinyLM):
    """Both ranks raise, after micro-batch 4 (inside the group 3, 4, 5), errors of the user's own code whose words a
    failed collective also uses: "timeout", "gloo"."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 4:
            if self.global_rank == 0:
                raise RuntimeError("HTTP read timeout while sending metrics")
            raise ValueError("unknown metrics backend 'gloo'")


def _words_worker(rank: int, folder: str) -> None:
    import json

    from helpers import RankStridedSampler
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    examples = make_examples(random_lengths(24, seed=70), seed=70)
    callback = OnExceptionCheckpoint(dirpath=folder, filename="words")
    trainer = ddp_trainer(DDPAccumulationStrategy(start_method="popen"), accumulate=3, callbacks=[callback])
    loader = ResumableLoader(ListDataset(examples), batch_size=2, sampler=RankStridedSampler(len(examples)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(_FailsWithWords(optimizer="adamw"), loader)
        except (RuntimeError, ValueError) as err:
            error = f"{type(err).__name__}: {err}"
    said = [str(w.message) for w in caught]
    Path(folder, f"words-rank{rank}.json").write_text(json.dumps({"error": error, "warnings": said}))


@pytest.mark.ddp
@pytest.mark.timeout(240)
def test_an_error_of_the_users_code_is_not_taken_for_a_lost_peer_by_its_words(tmp_path: Path) -> None:
    # Lost peers were recognised by words ("timeout", "gloo", ...): these two errors of the user's code made the
    # exception checkpoint leave out the open group and skip the barrier. They are recognised now by the exception's
    # type (torch.distributed.DistError) or by where it was raised (a collective, DDP's wrapper, a synchronising
    # backward): the peers are alive, so the open group is carried.
    import json

    run_ddp(_words_worker, str(tmp_path))
    for rank in (0, 1):
        result = json.loads((tmp_path / f"words-rank{rank}.json").read_text())
        assert ("timeout" if rank == 0 else "'gloo'") in result["error"]
        assert not any("a collective failed" in m for m in result["warnings"]), result["warnings"]
    group = torch.load(tmp_path / "words.ckpt", weights_only=True)["lightning_accum"]["open_group"]
    assert group["carried"] is True and (group["microbatches"], group["total_microbatches"]) == (2, 4)
    assert set(group["gradients"]) == {"embed.weight", "head.weight", "head.bias"}


class _ModifiesInPlace(TinyLM):
    """At micro-batch 5, the last of the group 3, 4, 5 (a backward that synchronises over the replicas), a tensor saved
    for the backward is modified in place: the user's own autograd error, on both ranks."""

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Any:
        if batch_idx != 5:
            return super().training_step(batch, batch_idx)
        hidden = torch.tanh(self.embed(batch["input_ids"]))  # tanh keeps its output for the backward
        logits = self.head(hidden)
        hidden.mul_(1.0)  # the mistake
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE)
        return {"loss": loss, "num_tokens": (batch["labels"] != IGNORE).sum()}


def _in_place_worker(rank: int, folder: str) -> None:
    from helpers import RankStridedSampler

    examples = make_examples(random_lengths(24, seed=70), seed=70)
    trainer = ddp_trainer(DDPAccumulationStrategy(start_method="popen"), accumulate=3)
    loader = ResumableLoader(ListDataset(examples), batch_size=2, sampler=RankStridedSampler(len(examples)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            trainer.fit(_ModifiesInPlace(), loader)
    Path(folder, f"in-place-rank{rank}.json").write_text(json.dumps([str(w.message) for w in caught]))


@pytest.mark.ddp
@pytest.mark.timeout(240)
def test_a_users_autograd_error_in_a_synchronising_backward_is_not_taken_for_a_lost_peer(tmp_path: Path) -> None:
    # Before: raised inside the autograd engine during a backward that synchronises, it was warned on every rank as "a
    # collective failed (...). Either a replica died ...", and the exception checkpoint left the group out for it.
    run_ddp(_in_place_worker, str(tmp_path))
    for rank in (0, 1):
        said = json.loads((tmp_path / f"in-place-rank{rank}.json").read_text())
        assert not any("a collective failed" in m for m in said), said
