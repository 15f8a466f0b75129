"""The DFlash draft (services/worker/spec/dflash.py, block_drafter.py): its block drafts equal
z-lab's algorithm rebuilt on transformers' Qwen3 pieces in float64 (tests/support/
dflash_reference.py), the checkpoint is read as z-lab writes it, and what cannot be served is
refused at start-up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from services.worker.loader import load_model
from services.worker.loader.checkpoint_names import CheckpointError
from services.worker.spec import SpeculativeConfig
from services.worker.spec.dflash import default_target_layers
from services.worker.spec.drafts import Drafter
from tests.support.dflash_reference import reference_dflash_drafts
from tests.support.spec_heads import drafts_after, write_dflash_draft
from tests.support.tiny_llama import make_tiny_llama

PROMPTS = ([5, 17, 99, 3, 250, 41, 8], list(range(20, 45)), [7, 7, 300, 12])


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dflash") / "target"
    make_tiny_llama(path, seed=0)
    return path


def drafter(target_dir: Path, draft_dir: Path, k: int):  # type: ignore[no-untyped-def]
    target, _ = load_model(target_dir, torch.float32)
    spec = SpeculativeConfig(method="dflash", model=str(draft_dir), num_spec_tokens=k)
    return Drafter(spec, vocab_size=target.config.vocab_size, target=target), target


@pytest.mark.parametrize(
    ("num_layers", "target_layers", "k"), [(1, None, 7), (2, (0, 1), 7), (2, (1, 0), 3)]
)
def test_block_drafts_equal_the_reference_algorithm(
    target_dir: Path, tmp_path: Path, num_layers: int, target_layers, k: int
) -> None:
    # A wide init spread, so the drafts depend on the context and differ across the block.
    draft_dir = write_dflash_draft(
        target_dir, tmp_path / "d", std=0.3, num_layers=num_layers, target_layers=target_layers
    )
    hf = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    got, want = [], []
    for tokens in PROMPTS:
        spec, target = drafter(target_dir, draft_dir, k)
        got.append(drafts_after(spec, target, tokens, k))
        want.append(reference_dflash_drafts(draft_dir, hf, tokens, k))
    assert got == want
    assert all(len(d) == k for d in got)
    assert len({tuple(d) for d in got}) > 1  # the context matters
    assert any(len(set(d)) > 1 for d in got)  # and the position in the block


def test_the_checkpoint_names_its_target_layers_or_gets_z_labs_default(
    target_dir: Path, tmp_path: Path
) -> None:
    assert default_target_layers(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layers(3, 1) == (1,)
    path = write_dflash_draft(target_dir, tmp_path / "d")
    hf = json.loads((path / "config.json").read_text())
    assert hf["architectures"] == ["DFlashDraftModel"] and hf["block_size"] == 8
    assert hf["dflash_config"] == {"mask_token_id": 511, "target_layer_ids": [1]}
    spec, target = drafter(target_dir, path, 4)
    assert target.aux_hidden_layers == (2,)  # the stream leaving layer 1 enters layer 2
    assert spec.features.kv.non_causal


def test_what_cannot_be_served_is_refused(target_dir: Path, tmp_path: Path) -> None:
    path = write_dflash_draft(target_dir, tmp_path / "d", block_size=4)
    with pytest.raises(ValueError, match="exceed the DFlash draft's block of 4"):
        drafter(target_dir, path, 4)
    last = write_dflash_draft(target_dir, tmp_path / "last")
    hf = json.loads((last / "config.json").read_text())
    hf["dflash_config"]["target_layer_ids"] = [2]  # the last layer's stream is not available
    (last / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match=r"target layers \[2\] outside"):
        drafter(target_dir, last, 3)
    hf = json.loads((path / "config.json").read_text())
    del hf["dflash_config"]
    (path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match="not a DFlash draft"):
        drafter(target_dir, path, 3)
    target, _ = load_model(target_dir, torch.float32)
    with pytest.raises(ValueError, match="needs MESHLLM_SPEC_MODEL"):
        Drafter(SpeculativeConfig(method="dflash"), target=target)
