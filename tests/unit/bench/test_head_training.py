"""The draft-head training of bench/head_training.py runs the heads' serving modules over dense
batches: its unrolled steps and blocks must give the drafts the serving path proposes (else a
trained head learns a different algorithm than the one that drafts), and training must lower
each head's loss."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from bench.head_training import (
    DFlashTrainer,
    DraftModelTrainer,
    FeatureHeadTrainer,
    TrainingTarget,
    batches,
    run_target,
    train,
)
from services.worker.loader import load_model
from services.worker.spec import SpeculativeConfig
from services.worker.spec.drafts import Drafter
from tests.support.spec_heads import (
    drafts_after,
    write_dflash_draft,
    write_eagle3_head,
    write_eagle_head,
    write_mtp_target,
)
from tests.support.tiny_llama import make_tiny_llama

PROMPTS = ([5, 17, 99, 3, 250, 41, 8], list(range(20, 45)), [7, 7, 300, 12])
K = 3


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("training") / "target"
    make_tiny_llama(path, seed=0)
    return path


def write_head(method: str, target_dir: Path, path: Path, std: float = 0.3) -> Path:
    """A random head; the wide spread makes drafts differ across steps and prompts."""
    if method == "eagle":
        return write_eagle_head(target_dir, path, std=std)
    if method == "eagle3":
        return write_eagle3_head(target_dir, path, std=std, aux_layers=(0, 1, 2))
    if method == "mtp":
        return write_mtp_target(target_dir, path, std=std)
    return write_dflash_draft(target_dir, path, std=std, block_size=5)


def serving(method: str, target_dir: Path, head_dir: Path) -> tuple[Drafter, Any]:
    target, _ = load_model(target_dir, torch.float32)
    spec = SpeculativeConfig(method=method, model=str(head_dir), num_spec_tokens=K)
    return Drafter(spec, vocab_size=target.config.vocab_size, target=target), target


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp"])
def test_unrolled_steps_draft_as_the_serving_path(
    method: str, target_dir: Path, tmp_path: Path
) -> None:
    head_dir = write_head(method, target_dir, tmp_path / method)
    for tokens in PROMPTS:
        drafter, target = serving(method, target_dir, head_dir)
        want = drafts_after(drafter, target, tokens, K)
        head = drafter.features.head  # type: ignore[union-attr]
        aux = tuple(head.aux_layers) if method == "eagle3" else ()
        trainer = FeatureHeadTrainer(module=head, steps=K, aux_layers=aux)
        # the unrolled steps read the drafts as the tokens that followed the prompt
        seq = torch.tensor([tokens + want[:-1]])
        batch = run_target(target, seq, torch.tensor([seq.shape[1]]), aux)
        base = len(tokens) - 2
        with torch.no_grad():
            got = [
                int(logits.view(1, seq.shape[1] - 1, -1)[0, base].argmax())
                for _, logits, _, _ in trainer.unrolled(batch, TrainingTarget(target))
            ]
        assert got == want
    assert len(set(want)) > 1


def test_blocks_draft_as_the_serving_path(target_dir: Path, tmp_path: Path) -> None:
    head_dir = write_head("dflash", target_dir, tmp_path / "dflash")
    for tokens in PROMPTS:
        drafter, target = serving("dflash", target_dir, head_dir)
        want = drafts_after(drafter, target, tokens, K)
        head = drafter.features.head  # type: ignore[union-attr]
        trainer = DFlashTrainer(module=head)
        seq = torch.tensor([tokens])
        batch = run_target(target, seq, torch.tensor([len(tokens)]), head.aux_layers)
        with torch.no_grad():
            logits = trainer.block_logits(
                batch, TrainingTarget(target), torch.tensor([[len(tokens) - 1]])
            )
        assert logits[0, 0, :K].argmax(-1).tolist() == want


def test_training_lowers_every_heads_loss(target_dir: Path, tmp_path: Path) -> None:
    target, _ = load_model(target_dir, torch.float32)
    heads: dict[str, Any] = {}
    for method in ("eagle", "eagle3", "mtp", "dflash"):
        head_dir = write_head(method, target_dir, tmp_path / method, std=0.02)
        drafter, _ = serving(method, target_dir, head_dir)
        heads[method] = drafter.features.head  # type: ignore[union-attr]
    draft = LlamaForCausalLM.from_pretrained(target_dir, num_hidden_layers=1, dtype=torch.float32)
    trainers: dict[str, Any] = {
        "eagle": FeatureHeadTrainer(module=heads["eagle"], steps=2, regress=True),
        "eagle3": FeatureHeadTrainer(
            module=heads["eagle3"], steps=2, aux_layers=tuple(heads["eagle3"].aux_layers)
        ),
        "mtp": FeatureHeadTrainer(module=heads["mtp"], steps=2),
        "dflash": DFlashTrainer(
            module=heads["dflash"], anchors=4, generator=torch.Generator().manual_seed(0)
        ),
        "draft": DraftModelTrainer(module=draft),
    }
    # the target's own greedy text would be too easy; a fixed random corpus of 16 sequences
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 512, size=(16, 24)).astype(np.int64)
    lengths = rng.integers(12, 25, size=16).astype(np.int64)
    curves = train(
        target,
        trainers,
        batches(tokens, lengths, 8, "cpu"),
        steps=80,
        lr={n: 3e-3 for n in trainers},
        log=lambda _: None,
    )
    for name, curve in curves.items():
        first, last = np.mean(curve[:4]), np.mean(curve[-4:])
        assert last < 0.7 * first, (name, first, last)
