"""MTP modules in DeepSeek-V3's spelling (`model.layers.{L}.enorm/hnorm/eh_proj/shared_head`
plus a decoder layer, `num_nextn_predict_layers` in config.json), appended to a tiny random
Llama checkpoint.

- The target loads from that checkpoint exactly as without the module (its tensors skipped),
  and still refuses stray layers when the config declares no MTP module.
- The module's forward equals a reference built from transformers' own Llama layer with
  DeepSeek's formula: eh_proj(cat(enorm(embed), hnorm(h))) through the layer, logits from
  shared_head.head(shared_head.norm(.)); the embedding at position 0 is zeroed (vLLM).
- It drafts through the Drafter like every head.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer as HFLayer
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from services.worker.attention.reference import AttentionMetadata
from services.worker.loader import load_model
from services.worker.loader.checkpoint_names import CheckpointError
from services.worker.runner.kv_cache import KVCache
from services.worker.spec import SpeculativeConfig
from services.worker.spec.drafts import Drafter
from services.worker.spec.head_io import hf_tensors
from services.worker.spec.mtp import MtpHead, load_mtp_head
from services.worker.spec.row_kv import RowKV
from tests.support.spec_heads import drafts_after, write_mtp_target
from tests.support.tiny_llama import make_tiny_llama

MAX_LEN = 64
TOKENS = [5, 17, 99, 3, 250, 41, 7, 7, 300]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    make_tiny_llama(root / "target", seed=0)
    write_mtp_target(root / "target", root / "mtp", std=0.2)
    return root / "target", root / "mtp"


def forward_all(model, tokens: list[int]) -> torch.Tensor:
    n = len(tokens)
    kv = KVCache.allocate(model.config, 1, 16, torch.float32, "cpu")
    attn = AttentionMetadata.build(
        query_lens=np.array([n]),
        seq_lens=np.array([n]),
        block_tables=np.zeros((1, 1), dtype=np.int64),
        block_size=16,
        slot_mapping=np.arange(n),
    )
    with torch.inference_mode():
        return model(torch.tensor(tokens), torch.arange(n), attn, kv.layers)  # type: ignore[no-any-return]


def test_the_target_loads_without_its_mtp_modules(dirs, tmp_path) -> None:
    target_dir, mtp_dir = dirs
    plain, plain_config = load_model(target_dir, torch.float32)
    with_mtp, config = load_model(mtp_dir, torch.float32)
    assert config.num_mtp_layers == 1 and plain_config.num_mtp_layers == 0
    assert torch.equal(forward_all(plain, TOKENS), forward_all(with_mtp, TOKENS))
    stray = tmp_path / "stray"  # MTP tensors but a config that declares none
    stray.mkdir()
    for item in mtp_dir.iterdir():
        (stray / item.name).symlink_to(item.resolve())
    (stray / "config.json").unlink()
    (stray / "config.json").write_text((target_dir / "config.json").read_text())
    with pytest.raises(CheckpointError, match="unexpected"):
        load_model(stray, torch.float32)
    with pytest.raises(CheckpointError, match="no MTP layers"):
        load_mtp_head(target_dir, plain, torch.float32, "cpu", MAX_LEN)


def reference_forward(
    head: MtpHead, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Module 0 over one causal sequence, built from transformers' Llama layer."""
    raw = head.config.model_dump()
    hf = LlamaConfig(
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw["num_key_value_heads"],
        rms_norm_eps=raw["rms_norm_eps"],
        rope_parameters={"rope_type": "default", "rope_theta": raw["rope"]["theta"]},
        max_position_embeddings=raw["max_position_embeddings"],
    )
    hf._attn_implementation = "eager"
    module = head.module(0)
    layer = HFLayer(hf, 0)
    ours = hf_tensors(head.state_dict(), head.config)
    layer.load_state_dict(
        {n.removeprefix("layers.0.block."): t for n, t in ours.items() if ".block." in n}
    )
    enorm = LlamaRMSNorm(hf.hidden_size, eps=hf.rms_norm_eps)
    hnorm = LlamaRMSNorm(hf.hidden_size, eps=hf.rms_norm_eps)
    enorm.weight.data.copy_(module.enorm.weight)
    hnorm.weight.data.copy_(module.hnorm.weight)
    n = embeds.shape[0]
    cos, sin = LlamaRotaryEmbedding(hf)(embeds[None], positions[None])
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        embeds = torch.where((positions == 0)[:, None], 0.0, embeds)
        x = module.eh_proj(torch.cat((enorm(embeds), hnorm(features)), dim=-1))
        return layer(x[None], attention_mask=mask, position_embeddings=(cos, sin))[0]  # type: ignore[no-any-return]


def test_the_forward_equals_deepseeks_formula_on_transformers_layers(dirs) -> None:
    _, mtp_dir = dirs
    target, _ = load_model(mtp_dir, torch.float32)
    head = load_mtp_head(mtp_dir, target, torch.float32, "cpu", MAX_LEN)
    assert head.module(0).shared_head.head is not None  # DeepSeek checkpoints carry their own
    n, hidden = 6, head.hidden_size
    generator = torch.Generator().manual_seed(4)
    embeds = torch.randn(n, hidden, generator=generator)
    features = torch.randn(n, hidden, generator=generator)
    kv = RowKV(head.kv_config, 1, MAX_LEN, 16, torch.float32, torch.device("cpu"))
    positions = np.arange(n)
    attn = kv.metadata(np.array([0]), np.array([n]), np.array([n]), positions)
    with torch.inference_mode():
        g = head(embeds, features, torch.from_numpy(positions), attn, kv.layers)
        logits = head.draft_logits(g, target)
    ref = reference_forward(head, embeds, features, torch.from_numpy(positions))
    torch.testing.assert_close(g, ref, atol=1e-5, rtol=1e-5)
    shared = head.module(0).shared_head
    norm = LlamaRMSNorm(hidden, head.config.rms_norm_eps)
    norm.weight.data.copy_(shared.norm.weight)
    assert shared.head is not None
    with torch.no_grad():
        torch.testing.assert_close(logits, shared.head(norm(ref)), atol=1e-5, rtol=1e-5)


def test_it_drafts_through_the_drafter(dirs) -> None:
    _, mtp_dir = dirs
    target, config = load_model(mtp_dir, torch.float32)
    spec = SpeculativeConfig(method="mtp", model=str(mtp_dir), num_spec_tokens=3)
    drafter = Drafter(
        spec, vocab_size=config.vocab_size, max_num_reqs=2, max_model_len=MAX_LEN, target=target
    )
    assert drafter.features is not None and drafter.features.vocab_map is None
    drafts = drafts_after(drafter, target, TOKENS, 3)
    assert len(drafts) == 3 and all(0 <= t < config.vocab_size for t in drafts)
