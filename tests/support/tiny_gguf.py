"""Write a transformers model to GGUF the way llama.cpp's convert_hf_to_gguf.py does, for tests.

Tensor names come from gguf-py's own HF->GGUF map (`gguf.get_tensor_name_map`, the table the
converter uses), not from our loader's tables, so a wrong mapping in the loader shows up as a
failed load or different logits. The converter's value changes are reproduced here: Q/K row
permutation for the `llama` architecture, experts stacked into [E, rows, cols] tensors, Gemma
norm weights stored as 1 + w. fp32 tensors, so loading must reproduce the weights exactly.

`GGUF_FAMILIES` holds, per tiny family of tests/support/tiny_models.py, the GGUF architecture
and the overrides that keep the tiny config within what a GGUF file expresses (llama.cpp stores
no Qwen2 sliding-window layers, no Qwen-MoE dense layers, and fixes Gemma3's layer pattern,
local RoPE base and attention scale). The hybrid attention + Mamba2 families (`granitehybrid`)
are converted by tests/support/tiny_gguf_hybrid.py, llama.cpp's GraniteHybridModel; their
overrides say what that converter cannot express.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import load_file
from transformers import PreTrainedModel

from tests.support import tiny_gguf_hybrid
from tests.support.tiny_gguf_hybrid import llama_cpp_permute
from tests.support.tiny_models import make_tiny

_GEMMA3_ROPE = {
    "full_attention": {"rope_type": "default", "rope_theta": 100000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
}
#: What llama.cpp's GraniteHybridModel cannot express, for every hybrid: the SSD chunk size (its
#: scan has none: transformers' default 256 is read back). GraniteMoeHybrid: a hybrid always
#: gets `rope.scaling.finetuned` = false, llama.cpp's "no RoPE", and the context 2**20. (Bamba's
#: partial rotary factor, fixed at 0.5 by transformers, reaches the file only as IBM's
#: `attn_rotary_emb`, which a transformers-saved config lacks: the file then says the whole
#: head, and the reader takes transformers' 0.5.)
_HYBRID = {"mamba_chunk_size": 256}
_GRANITE_HYBRID = {**_HYBRID, "position_embedding_type": "nope", "max_position_embeddings": 2**20}
#: tiny family -> (GGUF architecture, overrides for make_tiny)
GGUF_FAMILIES: dict[str, tuple[gguf.MODEL_ARCH, dict[str, Any]]] = {
    "qwen2": (gguf.MODEL_ARCH.QWEN2, {"use_sliding_window": False}),
    "qwen3": (gguf.MODEL_ARCH.QWEN3, {}),
    "mistral": (gguf.MODEL_ARCH.LLAMA, {}),
    "mixtral": (gguf.MODEL_ARCH.LLAMA, {}),
    "qwen2_moe": (gguf.MODEL_ARCH.QWEN2MOE, {"mlp_only_layers": []}),
    "qwen3_moe": (gguf.MODEL_ARCH.QWEN3MOE, {}),
    "gemma3": (
        gguf.MODEL_ARCH.GEMMA3,
        {
            "num_hidden_layers": 6,  # llama.cpp: layers 0-4 slide, layer 5 is full
            "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
            "query_pre_attn_scalar": 16,  # = head_dim, llama.cpp's scale below 27B
            "rope_parameters": _GEMMA3_ROPE,
        },
    ),
    "bamba": (gguf.MODEL_ARCH.GRANITE_HYBRID, _HYBRID),
    "granitemoehybrid": (gguf.MODEL_ARCH.GRANITE_HYBRID, _GRANITE_HYBRID),
    "granitemoehybrid_dense": (gguf.MODEL_ARCH.GRANITE_HYBRID, _GRANITE_HYBRID),
}
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)
_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<part>\w+)\.weight$")


def make_tiny_gguf(directory: Path, family: str, seed: int = 0) -> tuple[Path, PreTrainedModel]:
    """(GGUF file, the transformers model it holds); the HF dir is `directory / "hf"`."""
    arch, overrides = GGUF_FAMILIES[family]
    model = make_tiny(directory / "hf", family, seed=seed, **overrides)
    if arch == gguf.MODEL_ARCH.GRANITE_HYBRID:
        _as_ibm_config(directory / "hf")
    path = directory / f"{family}.gguf"
    write_gguf(directory / "hf", model.config, arch, path)
    return path, model


def _as_ibm_config(hf_dir: Path) -> None:
    """GraniteMoeHybrid's layer types in IBM's spelling (mamba/attention), as its released
    checkpoints have them: the converter looks for "attention" and would take transformers 5's
    full_attention/linear_attention for all-mamba. transformers and our loader read both."""
    file = hf_dir / "config.json"
    hparams = json.loads(file.read_text())
    if "layer_types" in hparams:
        spelling = {"full_attention": "attention", "linear_attention": "mamba"}
        hparams["layer_types"] = [spelling.get(t, t) for t in hparams["layer_types"]]
        file.write_text(json.dumps(hparams, indent=2))


def write_gguf(hf_dir: Path, config: Any, arch: gguf.MODEL_ARCH, path: Path) -> None:
    """Convert the saved checkpoint in `hf_dir` (as the converter does: from the files)."""
    name = gguf.MODEL_ARCH_NAMES[arch]
    writer = gguf.GGUFWriter(str(path), name)
    if arch == gguf.MODEL_ARCH.GRANITE_HYBRID:
        hparams = json.loads((hf_dir / "config.json").read_text())
        tiny_gguf_hybrid.write_metadata(writer, hparams)
        tensors = tiny_gguf_hybrid.converted_tensors(hf_dir, hparams)
    else:
        _write_metadata(writer, config, name)
        tensors = _gguf_named(_converted_tensors(hf_dir, config, name), arch, config)
    _write_tokenizer(writer, config)
    for gguf_name, array in tensors:
        writer.add_tensor(gguf_name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_named(
    tensors: list[tuple[str, np.ndarray]], arch: gguf.MODEL_ARCH, config: Any
) -> list[tuple[str, np.ndarray]]:
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    out = []
    for hf_name, array in tensors:
        base, _, kind = hf_name.rpartition(".")
        gguf_base = names.get_name(base)
        if gguf_base is None:
            raise KeyError(f"gguf-py has no {gguf.MODEL_ARCH_NAMES[arch]} name for {hf_name}")
        out.append((f"{gguf_base}.{kind}", array))
    return out


def _write_metadata(writer: gguf.GGUFWriter, config: Any, arch: str) -> None:
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = config.rope_parameters
    rope = rope.get("full_attention", rope)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    if getattr(config, "sliding_window", None) and config.model_type in ("mistral", "gemma3_text"):
        writer.add_sliding_window(config.sliding_window)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if getattr(config, "moe_intermediate_size", None):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if getattr(config, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)


def _write_tokenizer(writer: gguf.GGUFWriter, config: Any) -> None:
    tokens, types, merges = _byte_level_vocab(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_chat_template(CHAT_TEMPLATE)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)


def _byte_level_vocab(size: int) -> tuple[list[str], list[int], list[str]]:
    """A GPT-2 style vocabulary of `size` tokens: 3 control tokens (pad, bos, eos as in the tiny
    configs), the 256 byte symbols, then merges of two lowercase letters."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    specials = ["<pad>", "<s>", "</s>"]
    symbols = list(bytes_to_unicode().values())
    letters = "abcdefghijklmnopqrstuvwxyz"
    pairs = [a + b for a in letters for b in letters][: size - len(specials) - len(symbols)]
    tokens = specials + symbols + pairs
    types = [int(gguf.TokenType.CONTROL)] * 3 + [int(gguf.TokenType.NORMAL)] * (size - 3)
    return tokens, types, [f"{p[0]} {p[1]}" for p in pairs]


def _converted_tensors(hf_dir: Path, config: Any, arch: str) -> list[tuple[str, np.ndarray]]:
    """HF-named tensors after the converter's value changes; experts stacked under
    `<prefix>.experts.<part>.weight` (Mixtral's w1/w3/w2 keep their names: gguf-py maps both)."""
    out: list[tuple[str, np.ndarray]] = []
    experts: dict[str, dict[int, np.ndarray]] = {}
    tensors = load_file(hf_dir / "model.safetensors")
    for hf_name, tensor in sorted(tensors.items()):
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = tensor.to(torch.float32).numpy().copy()
        match = _EXPERT.match(hf_name)
        if match:
            key = f"{match['prefix']}.{match['part']}.weight"
            experts.setdefault(key, {})[int(match["expert"])] = array
            continue
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, config.num_attention_heads)
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, config.num_key_value_heads)
        elif arch == "gemma3" and hf_name.endswith("norm.weight"):
            array = array + 1.0
        out.append((hf_name, array))
    for key, parts in experts.items():
        out.append((key, np.stack([parts[e] for e in range(len(parts))])))
    return out
