"""Weights and config read straight from a GGUF file with the `gguf` package.

llama.cpp's converter renames tensors (`blk.N.attn_q.weight`) and permutes the rows of Q and K
so its RoPE kernel can rotate adjacent pairs (GPT-J style). Our RoPE rotates halves (neox style,
as transformers' Llama does), so the permutation is undone here. Quantized tensors are
dequantized to fp32 with `gguf.quants.dequantize` (then cast to the serving dtype).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from services.worker.models.config import ModelConfig, RopeScaling, UnsupportedModelError

#: general.architecture -> HF architecture name
_ARCHITECTURES = {"llama": "LlamaForCausalLM"}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str | None:
    """The HF name of a llama.cpp tensor, or None for tensors we derive (e.g. rope_freqs)."""
    match = _LAYER_RE.match(gguf_name)
    if match:
        layer, module, kind = match.groups()
        if module not in _LAYER_NAMES:
            raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no mapping")
        return f"model.layers.{layer}.{_LAYER_NAMES[module]}.{kind}"
    module, _, kind = gguf_name.rpartition(".")
    if module == "rope_freqs":
        return None
    if module not in _GLOBAL_NAMES:
        raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no mapping")
    return f"{_GLOBAL_NAMES[module]}.{kind}"


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute(w, n_head)` on the rows of a Q or K projection."""
    rows = weight.shape[0]
    # llama.cpp: reshape(heads, 2, rows/heads/2, ...).swapaxes(1, 2); this swaps back.
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def config_from_gguf(reader: GGUFReader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {arch!r}; supported: {sorted(_ARCHITECTURES)}"
        )
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _field(reader, f"{arch}.vocab_size") or (len(tokens.data) if tokens else 0)
    rope_dim = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    rope: dict[str, Any] = {
        "theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "partial_rotary_factor": rope_dim / head_dim,
    }
    if scaling in ("linear", "yarn"):
        rope["rope_type"] = scaling
        rope["factor"] = float(_field(reader, f"{arch}.rope.scaling.factor", 1.0))
        original = _field(reader, f"{arch}.rope.scaling.original_context_length")
        if original:
            rope["original_max_position_embeddings"] = int(original)
    elif scaling != "none":
        raise UnsupportedModelError(f"GGUF rope scaling {scaling!r} is not supported")
    eos = [_field(reader, "tokenizer.ggml.eos_token_id")]
    eos.append(_field(reader, "tokenizer.ggml.eot_token_id"))
    tensor_names = {t.name for t in reader.tensors}
    return ModelConfig(
        architecture=_ARCHITECTURES[arch],
        model_type=arch,
        hidden_size=hidden,
        num_hidden_layers=int(_field(reader, f"{arch}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        vocab_size=int(vocab),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope=RopeScaling(**rope),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        mlp_bias="blk.0.ffn_up.bias" in tensor_names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=sorted({int(e) for e in eos if e is not None}),
        torch_dtype="float32",
    )


def iter_gguf(reader: GGUFReader, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, fp32 tensor in HF layout) for every tensor of the file."""
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        array = dequantize(tensor.data, tensor.tensor_type)
        array = array.reshape(tuple(int(d) for d in reversed(tensor.shape)))
        if ".q_proj." in name:
            array = unpermute_rope_rows(array, config.num_attention_heads)
        elif ".k_proj." in name:
            array = unpermute_rope_rows(array, config.num_key_value_heads)
        array = np.ascontiguousarray(array, dtype=np.float32)
        if not array.flags.writeable:  # an F32 tensor is a view of the read-only file mapping
            array = array.copy()
        yield name, torch.from_numpy(array)


def open_gguf(path: Path) -> tuple[GGUFReader, ModelConfig]:
    reader = GGUFReader(str(path))
    return reader, config_from_gguf(reader)
