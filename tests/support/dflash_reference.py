"""z-lab's DFlash drafting (`dflash/model.py`: `DFlashDraftModel.forward` inside
`dflash_generate`) rebuilt from transformers' Qwen3 pieces over a checkpoint's raw tensors, as
the independent reference of services/worker/spec/dflash.py: dense tensors, no paged cache, the
context and the block concatenated per layer exactly as the reference does.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, rotate_half


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def reference_dflash_drafts(draft_dir: Path, target, tokens: list[int], k: int) -> list[int]:  # type: ignore[no-untyped-def]
    """Greedy drafts of the block after `tokens` (the target has read all but the last), in
    float64: `target` an HF causal LM. The block is the draft's whole `block_size` (as
    `dflash_generate` runs it); its first `k` drafts are returned."""
    hf = json.loads((draft_dir / "config.json").read_text())
    w = {n: t.double() for n, t in load_file(str(draft_dir / "model.safetensors")).items()}
    eps, heads, kv_heads = hf["rms_norm_eps"], hf["num_attention_heads"], hf["num_key_value_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    layer_ids = hf["dflash_config"]["target_layer_ids"]
    with torch.no_grad():
        out = target(torch.tensor([tokens[:-1]]), output_hidden_states=True)
        ctx = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)[0].double()
        ctx = _rms(ctx @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
        block = [tokens[-1]] + [hf["dflash_config"]["mask_token_id"]] * (hf["block_size"] - 1)
        hidden = target.get_input_embeddings()(torch.tensor(block)).double()
        n_ctx, q_len = ctx.shape[0], len(block)
        config = Qwen3Config(**{**hf, "head_dim": head_dim})
        rotary = Qwen3RotaryEmbedding(config)
        positions = torch.arange(n_ctx + q_len)[None]
        cos, sin = (t[0].double() for t in rotary(hidden[None].float(), positions))
        for i in range(hf["num_hidden_layers"]):
            p = f"layers.{i}."
            normed = _rms(hidden, w[p + "input_layernorm.weight"], eps)
            q = (normed @ w[p + "self_attn.q_proj.weight"].T).view(q_len, heads, head_dim)
            q = _rms(q, w[p + "self_attn.q_norm.weight"], eps)
            kk = torch.cat((ctx, normed)) @ w[p + "self_attn.k_proj.weight"].T
            kk = _rms(kk.view(-1, kv_heads, head_dim), w[p + "self_attn.k_norm.weight"], eps)
            v = (torch.cat((ctx, normed)) @ w[p + "self_attn.v_proj.weight"].T).view(
                -1, kv_heads, head_dim
            )
            q = q * cos[-q_len:, None] + rotate_half(q) * sin[-q_len:, None]
            kk = kk * cos[:, None] + rotate_half(kk) * sin[:, None]
            rep = heads // kv_heads
            attn = F.scaled_dot_product_attention(  # non-causal: no mask
                q.transpose(0, 1),
                kk.repeat_interleave(rep, 1).transpose(0, 1),
                v.repeat_interleave(rep, 1).transpose(0, 1),
            )
            attn = attn.transpose(0, 1).reshape(q_len, heads * head_dim)
            hidden = hidden + attn @ w[p + "self_attn.o_proj.weight"].T
            normed = _rms(hidden, w[p + "post_attention_layernorm.weight"], eps)
            gate = normed @ w[p + "mlp.gate_proj.weight"].T
            up = normed @ w[p + "mlp.up_proj.weight"].T
            hidden = hidden + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        hidden = _rms(hidden, w["norm.weight"], eps)
        logits = hidden[1:] @ target.get_output_embeddings().weight.double().T
    return logits.argmax(-1)[:k].tolist()  # type: ignore[no-any-return]
