"""The EAGLE head's checkpoint format and draft vocabulary, on a tiny random Llama target:
save -> load round trip (EAGLE names, q/k/v and gate/up split), an own smaller lm_head reaching
the target only through d2t, and clear errors for heads this worker cannot run."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from services.worker.loader import load_model
from services.worker.loader.checkpoint_names import CheckpointError
from services.worker.spec import SpeculativeConfig
from services.worker.spec.drafts import Drafter
from services.worker.spec.eagle import load_eagle_head, random_eagle_head, save_eagle_head
from services.worker.spec.vocab_map import DraftVocabError
from tests.support.spec_heads import drafts_after
from tests.support.tiny_llama import make_tiny_llama

MAX_LEN = 64
TOKENS = [5, 17, 99, 3, 250, 41, 7, 7, 300]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    make_tiny_llama(path, seed=0)
    model, _ = load_model(path, torch.float32)
    hf = json.loads((path / "config.json").read_text())
    hf.update(num_hidden_layers=1)
    return model, hf


def eagle_drafter(path, model) -> Drafter:
    spec = SpeculativeConfig(method="eagle", model=str(path), num_spec_tokens=3)
    return Drafter(
        spec, vocab_size=model.config.vocab_size, max_num_reqs=2, max_model_len=MAX_LEN,
        target=model,
    )  # fmt: skip


def test_a_saved_head_loads_to_the_same_weights_and_drafts(target, tmp_path) -> None:
    model, hf = target
    head = random_eagle_head(hf, max_model_len=MAX_LEN, seed=1, std=0.2)
    save_eagle_head(head, tmp_path)
    names = _names(tmp_path)
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight"} <= names
    assert "layers.0.input_layernorm.weight" not in names  # EAGLE's first layer: no input norm
    loaded, d2t = load_eagle_head(tmp_path, torch.float32, "cpu", MAX_LEN)
    assert d2t is None
    theirs = loaded.state_dict()
    for name, tensor in head.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name
    drafter = eagle_drafter(tmp_path, model)
    assert drafter.features is not None and drafter.features.vocab_map is None  # target's vocab
    drafts = drafts_after(drafter, model, TOKENS, 3)
    assert len(drafts) == 3
    drafter.features.head = head  # the in-memory original proposes the same from the same state
    assert drafts_after(drafter, model, TOKENS, 3) == drafts


def test_an_own_smaller_lm_head_drafts_target_ids_through_d2t(target, tmp_path) -> None:
    model, hf = target
    head = random_eagle_head(hf, max_model_len=MAX_LEN, seed=2, std=0.2, draft_vocab_size=64)
    target_ids = torch.arange(64) * 7 + 3  # draft i -> target 7i + 3
    save_eagle_head(head, tmp_path / "mapped", d2t=target_ids - torch.arange(64))
    drafter = eagle_drafter(tmp_path / "mapped", model)
    assert drafter.features is not None and drafter.features.head.norm is not None
    assert torch.equal(drafter.features.vocab_map, target_ids)
    drafts = drafts_after(drafter, model, TOKENS, 3)
    assert len(drafts) == 3 and all((d - 3) % 7 == 0 for d in drafts)
    save_eagle_head(head, tmp_path / "unmapped")
    with pytest.raises(DraftVocabError, match="no draft->target map"):
        eagle_drafter(tmp_path / "unmapped", model)


def test_heads_this_worker_cannot_run_are_refused_clearly(target, tmp_path) -> None:
    model, hf = target
    with pytest.raises(ValueError, match="needs MESHLLM_SPEC_MODEL"):
        Drafter(SpeculativeConfig(method="eagle"), vocab_size=512, target=model)
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_eagle_head(tmp_path, torch.float32, "cpu", MAX_LEN)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    save_file({"midlayer.hidden_norm.weight": torch.ones(64)}, str(tmp_path / "m.safetensors"))
    with pytest.raises(CheckpointError, match="EAGLE-3"):
        load_eagle_head(tmp_path, torch.float32, "cpu", MAX_LEN)
    wide = random_eagle_head({**hf, "hidden_size": 128}, max_model_len=MAX_LEN)
    save_eagle_head(wide, tmp_path / "wide")
    (tmp_path / "wide" / "config.json").write_text(json.dumps(hf))  # config says hidden 64
    with pytest.raises(CheckpointError, match="do not fit"):
        load_eagle_head(tmp_path / "wide", torch.float32, "cpu", MAX_LEN)


def _names(path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return set(f.keys())
