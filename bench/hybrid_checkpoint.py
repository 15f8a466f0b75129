"""A random-weight hybrid (attention + Mamba2) checkpoint of a chosen size, with the embedded
SmolLM2 tokenizer, for benchmarks: `MESHLLM_MODEL=<dir>` serves it and transformers loads the
same directory, so `bench.cpu_compare` compares the two on one hybrid model.

    python -m bench.hybrid_checkpoint /tmp/bamba-smol                 # SmolLM2-sized Bamba
    python -m bench.hybrid_checkpoint /tmp/bamba-8b --shape 8b --dtype bfloat16 --meta

Shapes: `smol` (SmolLM2-135M's width and depth: hidden 576, 30 layers, every sixth attention,
the rest Mamba2 with 18 heads of 64 and a 64-wide state) and `8b` (Bamba-9B's: hidden 4096, 32
layers, attention at 9, 18, 27; 128 Mamba heads of 64, state 128). `--meta` writes only the
config (for shape-only uses such as kernel bandwidth arithmetic).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import BambaConfig, BambaForCausalLM

from shared.config import ModelSettings
from shared.model.source import resolve_model

SHAPES: dict[str, dict[str, Any]] = {
    "smol": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "attn_layer_indices": [5, 11, 17, 23, 29],
        "mamba_n_heads": 18,
        "mamba_d_head": 64,
        "mamba_d_state": 64,
        "mamba_chunk_size": 64,
    },
    "8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "attn_layer_indices": [9, 18, 27],
        "mamba_n_heads": 128,
        "mamba_d_head": 64,
        "mamba_d_state": 128,
        "mamba_chunk_size": 256,
    },
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def make(out: Path, shape: str, dtype: torch.dtype, seed: int, meta: bool) -> BambaConfig:
    tokenizer_dir = resolve_model("", ModelSettings(model="").model_cache_dir).hf_dir
    config = BambaConfig(
        **SHAPES[shape],
        vocab_size=49152,
        max_position_embeddings=8192,
        mamba_n_groups=1,
        mamba_d_conv=4,
        mamba_expand=2,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    out.mkdir(parents=True, exist_ok=True)
    if meta:
        config.save_pretrained(out)
    else:
        torch.manual_seed(seed)
        model = BambaForCausalLM(config).to(dtype).eval()
        model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    return config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--shape", choices=sorted(SHAPES), default="smol")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--meta", action="store_true", help="the config and tokenizer only")
    args = p.parse_args()
    make(args.out, args.shape, getattr(torch, args.dtype), args.seed, args.meta)
    print(args.out)


if __name__ == "__main__":
    main()
