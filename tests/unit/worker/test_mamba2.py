"""The Mamba2 mixer of hybrid models (services/worker/models/mamba2.py) against transformers'
own mixer (`BambaMixer`, its torch_forward path) on tiny random weights, the entry rule's
state placement (services/worker/attention/state_metadata.py), and the hybrid families'
ModelConfig parsing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import BambaConfig
from transformers.models.bamba.modeling_bamba import BambaMixer

from services.worker.attention.state_metadata import PrefillSpan, StateMetadata
from services.worker.models.mamba2 import Mamba2Mixer
from services.worker.runner.kv_cache import KVCache, bytes_per_block, state_block_bytes
from services.worker.runner.state_cache import MambaState
from shared.kv.groups import STATE
from shared.model.config import ModelConfig, UnsupportedModelError
from tests.support.tiny_models import make_tiny

CPU = torch.device("cpu")
BS = 4
NUM_BLOCKS = 16


def _hf_config(**overrides: Any) -> BambaConfig:
    settings: dict[str, Any] = {
        "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "attn_layer_indices": [1], "mamba_n_heads": 4,
        "mamba_d_head": 16, "mamba_n_groups": 2, "mamba_d_state": 8, "mamba_d_conv": 4,
        "mamba_expand": 2, "mamba_chunk_size": 8, "rms_norm_eps": 1e-5,
    }  # fmt: skip
    return BambaConfig(**{**settings, **overrides})


def _mixers(seed: int = 0) -> tuple[BambaMixer, Mamba2Mixer]:
    """transformers' mixer with random weights (A_log, D, dt_bias and the norm included) and
    ours with the same parameters."""
    torch.manual_seed(seed)
    hf_config = _hf_config()
    reference = BambaMixer(hf_config, layer_idx=0).eval()
    with torch.no_grad():
        for param in reference.parameters():
            param.copy_(torch.randn_like(param) * 0.3)
    config = ModelConfig.from_hf_dict(
        {**hf_config.to_dict(), "architectures": ["BambaForCausalLM"]}
    )
    ours = Mamba2Mixer(config).eval()
    ours.load_state_dict(reference.state_dict())
    return reference, ours


def _state(ours: Mamba2Mixer) -> MambaState:
    config = ModelConfig.from_hf_dict(
        {**_hf_config().to_dict(), "architectures": ["BambaForCausalLM"]}
    )
    assert config.mamba is not None
    return MambaState.allocate(config.mamba, NUM_BLOCKS, torch.float32, CPU)


def _run(
    ours: Mamba2Mixer,
    state: MambaState,
    x: torch.Tensor,
    table: np.ndarray,
    query_lens: list[int],
    seq_lens: list[int],
) -> torch.Tensor:
    meta = StateMetadata.build(table, np.array(query_lens), np.array(seq_lens), BS, CPU)
    with torch.no_grad():
        return ours(x, meta, state)


def test_mixer_output_equals_transformers_for_a_prompt() -> None:
    reference, ours = _mixers()
    x = torch.randn(1, 19, 32)
    with torch.no_grad():
        want = reference(x)[0]
    table = np.arange(1, 6)[None]
    got = _run(ours, _state(ours), x[0], table, [19], [19])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("splits", [[5], [4, 8], [1, 2, 3, 11, 17], [7, 13]])
def test_segmented_run_equals_one_shot(splits: list[int]) -> None:
    """A prompt computed in chunks ending anywhere (mid-block, on a boundary, one token) gives
    the one-shot outputs, and every state the entry rule stores is the state after exactly the
    tokens its block ends at (or, for the last entry, all of them)."""
    reference, ours = _mixers(1)
    total = 19
    x = torch.randn(1, total, 32)
    with torch.no_grad():
        want = reference(x)[0]
    table = np.arange(1, 6)[None]  # entries 0..4 -> blocks 1..5
    state = _state(ours)
    outs = []
    for start, stop in zip([0, *splits], [*splits, total], strict=True):
        outs.append(_run(ours, state, x[0, start:stop], table, [stop - start], [stop]))
    torch.testing.assert_close(torch.cat(outs), want, rtol=1e-5, atol=1e-5)

    one_shot = _state(ours)
    _run(ours, one_shot, x[0], table, [total], [total])
    for block in range(1, 6):
        torch.testing.assert_close(state.ssm[block], one_shot.ssm[block], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state.conv[block], one_shot.conv[block])
    # the boundary state after 8 tokens (entry 1 = block 2) continues like the prefix itself
    cont = _state(ours)
    cont.ssm[9], cont.conv[9] = one_shot.ssm[2], one_shot.conv[2]
    tail = _run(ours, cont, x[0, 8:], np.array([[0, 9, 10, 11, 12]]), [total - 8], [total])
    torch.testing.assert_close(tail, want[8:], rtol=1e-5, atol=1e-5)


def test_batched_decodes_and_prefills_equal_separate_runs() -> None:
    """One step with two one-token requests (one starting at 0) and two prefill spans gives
    each request what it gets alone."""
    _, ours = _mixers(2)
    lens = [(0, 1), (6, 7), (0, 9), (3, 10)]  # (n, m) per request; decodes first
    xs = [torch.randn(m - n, 32) for n, m in lens]
    tables = np.array([[1, 0, 0], [2, 3, 0], [4, 5, 6], [7, 8, 9]])
    alone_state, batch_state = _state(ours), _state(ours)
    for i, (n, _) in enumerate(lens):  # a prior state in the read entries
        if n:
            entry = -(-n // BS) - 1
            for state in (alone_state, batch_state):
                torch.manual_seed(10 + i)
                state.ssm[tables[i, entry]] = torch.randn_like(state.ssm[0])
                state.conv[tables[i, entry]] = torch.randn_like(state.conv[0])
    alone = [
        _run(ours, alone_state, xs[i], tables[i : i + 1], [m - n], [m])
        for i, (n, m) in enumerate(lens)
    ]
    batched = _run(
        ours, batch_state, torch.cat(xs), tables, [m - n for n, m in lens], [m for _, m in lens]
    )
    torch.testing.assert_close(batched, torch.cat(alone), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batch_state.ssm, alone_state.ssm, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batch_state.conv, alone_state.conv, rtol=1e-5, atol=1e-5)


def test_entry_rule_reads_and_writes() -> None:
    table = np.array([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]])
    # decodes: n=4 -> m=5 (reads entry 0, writes entry 1); n=0 -> m=1 (zero state, entry 0)
    # prefills: n=4 -> m=13 (reads entry 0; boundaries 8, 12 -> entries 1, 2; final 13 -> 3)
    #           n=2 -> m=8 (reads entry 0, which it continues; boundary 4 -> 0, final 8 -> 1)
    meta = StateMetadata.build(table, np.array([1, 1, 9, 6]), np.array([5, 1, 13, 8]), BS, CPU)
    assert meta.num_decodes == 2
    assert meta.decode_read.tolist()[0] == 1 and meta.decode_has_state.tolist() == [1.0, 0.0]
    assert meta.decode_write.tolist() == [2, 5]
    assert meta.prefills == [
        PrefillSpan(2, 11, 9, [(4, 10), (8, 11), (9, 12)], lead=0),
        PrefillSpan(11, 17, 13, [(2, 13), (6, 14)], lead=2),
    ]


def test_hybrid_configs(tmp_path: Path) -> None:
    make_tiny(tmp_path / "bamba", "bamba")
    make_tiny(tmp_path / "granite", "granitemoehybrid")
    make_tiny(tmp_path / "dense", "granitemoehybrid_dense")
    bamba = ModelConfig.from_hf_dir(tmp_path / "bamba")
    assert bamba.layer_types == ["mamba", "full_attention", "mamba", "mamba"]
    assert bamba.layer_windows == [STATE, None, STATE, STATE]
    assert [(g.kind, g.layer_indices) for g in bamba.kv_groups] == [
        ("full", [1]),
        ("state", [0, 2, 3]),
    ]
    assert bamba.mamba is not None and bamba.mamba.conv_dim == 128 + 2 * 2 * 16
    assert (bamba.mamba.n_heads, bamba.mamba.head_dim, bamba.mamba.chunk_size) == (8, 16, 8)
    assert bamba.rope.partial_rotary_factor == 0.5 and bamba.num_experts == 0
    granite = ModelConfig.from_hf_dir(tmp_path / "granite")
    assert granite.num_experts == 4 and granite.moe_intermediate_size == 48
    assert granite.shared_mlp_intermediate_size == 40 and granite.use_rope
    assert (granite.embedding_multiplier, granite.attention_multiplier) == (2.0, 0.2)
    assert (granite.residual_multiplier, granite.logits_scaling) == (0.5, 2.0)
    dense = ModelConfig.from_hf_dir(tmp_path / "dense")
    assert dense.num_experts == 0 and not dense.use_rope
    assert [g.kind for g in dense.kv_groups] == ["full", "state"]
    # an attention block: K/V of 1 attention layer; a state block: both states of 3 mamba layers
    kv = 2 * BS * 2 * 16 * 4
    states = (192 * 3 + 8 * 16 * 16) * 4
    assert bytes_per_block(bamba, BS, torch.float32) == kv
    assert state_block_bytes(bamba, torch.float32) == 3 * states
    cache = KVCache.allocate(bamba, 5, BS, torch.float32, "cpu", num_state_blocks=3)
    assert cache.nbytes == 5 * kv + 3 * 3 * states
    assert isinstance(cache.layers[0], MambaState) and len(cache.attention_layers) == 1
    assert cache.layers[0].ssm.shape[0] == 3 and cache.attention_layers[0].shape[1] == 5


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"time_step_limit": [0.1, 10.0]}, "time_step_limit"),
        ({"layer_types": ["mamba", "cross"]}, "layer types"),
        ({"position_embedding_type": "alibi"}, "position_embedding_type"),
        ({"shared_intermediate_size": 0}, "shared MLP"),
    ],
)
def test_unsupported_hybrid_settings_are_refused(overrides: dict[str, Any], message: str) -> None:
    hf = {
        "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
        "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 48, "vocab_size": 64, "layer_types": ["mamba", "attention"],
        "mamba_n_heads": 4, "mamba_d_head": 16, "shared_intermediate_size": 24,
    }  # fmt: skip
    assert ModelConfig.from_hf_dict(hf).mamba is not None
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_hf_dict({**hf, **overrides})
