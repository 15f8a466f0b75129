"""EAGLE-3 heads as vLLM and speculators define them, on a tiny random Llama target.

- The target returns the residual stream entering each auxiliary layer: equal to transformers'
  `hidden_states[i]` (the input of layer i), in the head's order after the final hidden state.
- A head saved in either format (EAGLE/vLLM `midlayer.*`, speculators `layers.0.*`) loads to
  the same weights and drafts the same tokens, reaching the target vocabulary through d2t.
- The head's forward equals a reference built from transformers' own Llama layer the way
  speculators builds its first layer (q/k/v over cat(input_layernorm(embeds),
  hidden_norm(h)) [2H], residual h), and its logits lm_head(norm(.)).
- Checkpoints this worker cannot run are refused with errors that say why.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer as HFLayer,
)
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from services.worker.loader import load_model
from services.worker.loader.checkpoint_names import CheckpointError
from services.worker.spec import SpeculativeConfig
from services.worker.spec.drafts import Drafter
from services.worker.spec.eagle3 import (
    Eagle3Head,
    default_aux_layers,
    load_eagle3_head,
    random_eagle3_head,
    save_eagle3_head,
)
from services.worker.spec.head_io import hf_tensors
from services.worker.spec.row_kv import RowKV
from tests.support.spec_heads import drafts_after, head_layer_hf
from tests.support.tiny_llama import make_tiny_llama

MAX_LEN = 64
TOKENS = [5, 17, 99, 3, 250, 41, 7, 7, 300]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    hf_model = make_tiny_llama(path, seed=0, num_hidden_layers=6)
    return path, hf_model


def eagle3_drafter(path, model) -> Drafter:
    spec = SpeculativeConfig(method="eagle3", model=str(path), num_spec_tokens=3)
    return Drafter(
        spec, vocab_size=model.config.vocab_size, max_num_reqs=2, max_model_len=MAX_LEN,
        target=model,
    )  # fmt: skip


def test_the_target_returns_the_streams_entering_its_auxiliary_layers(target) -> None:
    path, hf_model = target
    model, config = load_model(path, torch.float32)
    assert default_aux_layers(6) == (2, 3, 3)
    model.aux_hidden_layers = (4, 0, 2)
    from services.worker.attention.reference import AttentionMetadata
    from services.worker.runner.kv_cache import KVCache

    n = len(TOKENS)
    kv = KVCache.allocate(config, 1, 16, torch.float32, "cpu")
    attn = AttentionMetadata.build(
        query_lens=np.array([n]),
        seq_lens=np.array([n]),
        block_tables=np.zeros((1, 1), dtype=np.int64),
        block_size=16,
        slot_mapping=np.arange(n),
    )
    with torch.inference_mode():
        out = model(torch.tensor(TOKENS), torch.arange(n), attn, kv.layers)
        ref = hf_model(torch.tensor([TOKENS]), output_hidden_states=True).hidden_states
    hidden = config.hidden_size
    assert out.shape == (n, 4 * hidden)
    torch.testing.assert_close(out[:, :hidden], ref[-1][0], atol=1e-5, rtol=1e-5)
    for j, layer in enumerate((4, 0, 2)):
        part = out[:, (1 + j) * hidden : (2 + j) * hidden]
        torch.testing.assert_close(part, ref[layer][0], atol=1e-5, rtol=1e-5)


def test_both_checkpoint_formats_load_the_same_head_and_draft_alike(target, tmp_path) -> None:
    path, _ = target
    model, _ = load_model(path, torch.float32)
    head = random_eagle3_head(
        head_layer_hf(path), num_target_layers=6, draft_vocab_size=128, max_model_len=MAX_LEN,
        seed=1, std=0.2,
    )  # fmt: skip
    target_ids = torch.arange(128) * 4 + 2  # draft i -> target 4i + 2
    d2t = target_ids - torch.arange(128)
    save_eagle3_head(head, tmp_path / "vllm", d2t=d2t)
    save_eagle3_head(head, tmp_path / "speculators", speculators=True, d2t=d2t)
    vllm_names = _names(tmp_path / "vllm")
    assert {"fc.weight", "midlayer.hidden_norm.weight", "midlayer.self_attn.q_proj.weight"} <= (
        vllm_names
    )
    assert "layers.0.self_attn.q_proj.weight" in _names(tmp_path / "speculators")
    assert (
        json.loads((tmp_path / "speculators" / "config.json").read_text())["speculators_model_type"]
        == "eagle3"
    )
    drafts = []
    for fmt in ("vllm", "speculators"):
        loaded, loaded_d2t = load_eagle3_head(tmp_path / fmt, 6, torch.float32, "cpu", MAX_LEN)
        assert loaded.aux_layers == (2, 3, 3)
        assert loaded_d2t is not None and torch.equal(loaded_d2t, d2t)
        for name, tensor in head.state_dict().items():
            assert torch.equal(tensor, loaded.state_dict()[name]), name
        drafter = eagle3_drafter(tmp_path / fmt, model)
        assert drafter.features is not None and torch.equal(drafter.features.vocab_map, target_ids)
        assert model.aux_hidden_layers == (2, 3, 3)  # the drafter asked the target for them
        out = drafts_after(drafter, model, TOKENS, 3)
        assert len(out) == 3 and all((t - 2) % 4 == 0 for t in out)
        drafts.append(out)
        model.aux_hidden_layers = ()
    assert drafts[0] == drafts[1]


def reference_forward(
    head: Eagle3Head, embeds: torch.Tensor, features: torch.Tensor
) -> torch.Tensor:
    """The head's output over one causal sequence, from transformers' Llama layer patched as
    speculators patches its first layer."""
    hf = LlamaConfig(**{k: v for k, v in head.layout.layer_hf.items() if k != "architectures"})
    hf._attn_implementation = "eager"
    hidden = hf.hidden_size
    layer = HFLayer(hf, 0)
    attn = layer.self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        old = getattr(attn, name)
        setattr(attn, name, torch.nn.Linear(2 * hidden, old.out_features, bias=False))
    hidden_norm = LlamaRMSNorm(hidden, eps=hf.rms_norm_eps)
    ours = hf_tensors(head.state_dict(), head.config)
    layer.load_state_dict(
        {n.removeprefix("layers.0."): t for n, t in ours.items() if n.startswith("layers.0.")},
        strict=False,
    )
    hidden_norm.weight.data.copy_(ours["layers.0.hidden_norm.weight"])
    n = embeds.shape[0]
    cos, sin = LlamaRotaryEmbedding(hf)(embeds[None], torch.arange(n)[None])
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        x = torch.cat((layer.input_layernorm(embeds), hidden_norm(features)), dim=-1)
        out, _ = attn(x[None], position_embeddings=(cos, sin), attention_mask=mask)
        h = features + out[0]
        return h + layer.mlp(layer.post_attention_layernorm(h))  # type: ignore[no-any-return]


def test_the_forward_equals_speculators_first_layer_built_from_transformers(target) -> None:
    path, _ = target
    head = random_eagle3_head(
        head_layer_hf(path), num_target_layers=6, draft_vocab_size=512, max_model_len=MAX_LEN,
        seed=2, std=0.2,
    )  # fmt: skip
    n, hidden = 7, head.config.hidden_size
    generator = torch.Generator().manual_seed(3)
    embeds = torch.randn(n, hidden, generator=generator)
    features = torch.randn(n, hidden, generator=generator)
    kv = RowKV(head.kv_config, 1, MAX_LEN, 16, torch.float32, torch.device("cpu"))
    positions = np.arange(n)
    attn = kv.metadata(np.array([0]), np.array([n]), np.array([n]), positions)
    with torch.inference_mode():
        g = head(embeds, features, torch.from_numpy(positions), attn, kv.layers)
        logits = head.draft_logits(g, None)  # type: ignore[arg-type]
    ref = reference_forward(head, embeds, features)
    torch.testing.assert_close(g, ref, atol=1e-5, rtol=1e-5)
    normed = LlamaRMSNorm(hidden, eps=head.config.rms_norm_eps)
    normed.weight.data.copy_(head.norm.weight)
    with torch.no_grad():
        torch.testing.assert_close(logits, head.lm_head(normed(ref)), atol=1e-5, rtol=1e-5)


def test_heads_this_worker_cannot_run_are_refused_clearly(target, tmp_path) -> None:
    path, _ = target
    head = random_eagle3_head(
        head_layer_hf(path), num_target_layers=6, draft_vocab_size=512, max_model_len=MAX_LEN,
        aux_layers=(1, 2, 9),
    )  # fmt: skip
    save_eagle3_head(head, tmp_path / "deep")
    with pytest.raises(CheckpointError, match=r"auxiliary layers \[9\] outside"):
        load_eagle3_head(tmp_path / "deep", 6, torch.float32, "cpu", MAX_LEN)
    (tmp_path / "e1").mkdir()
    (tmp_path / "e1" / "config.json").write_text(json.dumps(head_layer_hf(path)))
    save_file({"fc.weight": torch.zeros(64, 128)}, str(tmp_path / "e1" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="not an EAGLE-3 head"):
        load_eagle3_head(tmp_path / "e1", 6, torch.float32, "cpu", MAX_LEN)
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_eagle3_head(tmp_path, 6, torch.float32, "cpu", MAX_LEN)


def _names(path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return set(f.keys())
