"""Where the bf16 GPU forward departs from transformers: one prefill of an 8B-shaped Llama
(random weights copied from a transformers model), compared against transformers in fp32,
with the worker's CUDA pieces switched on one at a time.

    python3 -m bench.gpu.parity_probe --layers 2 32           # on the GPU

Modes: `torch` (the PyTorch reference attention and layers, on the GPU), `triton-attn` (fused
RoPE/KV insert and Triton attention, PyTorch layers), `full` (plus Triton RMSNorm and GEMV, as
the worker runs). Printed: ||ours - fp32|| / ||fp32|| of the last-token logits and of the
final hidden state, next to transformers' own bf16 error.

transformers' model is cast to bf16, then its RoPE frequencies are restored to fp32 (see
bench/gpu/hf_rope.py: the cast rounds them; `--keep-bf16-inv-freq` keeps them rounded, the
earlier behaviour). Its config is built by bench.gpu.hf_rope.hf_llama_config, which checks that its
rotary embedding really uses the preset's theta (5e5); `--plain-config` uses `LlamaConfig(**preset)`
as before instead. Also printed: transformers' version, the theta each config spelling yields,
and the largest difference between our RoPE cos/sin table and transformers' at the prompt's
positions.
"""

from __future__ import annotations

import argparse
import copy

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.gpu.hf_rope import effective_theta, hf_llama_config, restore_fp32_inv_freq
from services.worker.accel.cuda_layers import install_cuda_kernels
from services.worker.attention.reference import AttentionMetadata
from services.worker.attention.select import TritonAttentionMetadata
from services.worker.loader.checkpoint_names import assemble
from services.worker.models.random_init import PRESETS, build_random_model
from services.worker.runner.kv_cache import KVCache


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def probe(
    layers: int,
    prompt_len: int,
    decode_rows: int,
    dtype: torch.dtype,
    plain: bool,
    keep_bf16_freqs: bool,
) -> None:
    cfg = dict(PRESETS["llama-3-8b"], num_hidden_layers=layers)
    hf_cfg = {k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")}
    if plain:
        hf_config = LlamaConfig(**hf_cfg)
    else:
        hf_config, report = hf_llama_config(num_hidden_layers=layers)
        print("config spellings:", report)
    print(f"layers={layers} transformers theta in use: {effective_theta(hf_config):.1f}")
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = LlamaForCausalLM(hf_config).to(torch.bfloat16).eval()
    if not keep_bf16_freqs:
        change = restore_fp32_inv_freq(hf)
        print(f"layers={layers} inv_freq restored to fp32 (bf16 cast had moved it by {change:.2e})")
    ids = torch.randint(0, cfg["vocab_size"], (prompt_len,), device="cuda")
    with torch.inference_mode():
        out_bf16 = hf(ids[None], output_hidden_states=True)
        hf32 = copy.deepcopy(hf).float()
        out32 = hf32(ids[None], output_hidden_states=True)
    del hf32
    ref_logits, ref_hidden = out32.logits[0, -1], out32.hidden_states[-1][0, -1]
    print(
        f"layers={layers} transformers bf16: logits {rel(out_bf16.logits[0, -1], ref_logits):.4f}"
        f" hidden {rel(out_bf16.hidden_states[-1][0, -1], ref_hidden):.4f}"
    )
    rope_diff = _rope_table_diff(hf, cfg, prompt_len)
    print(f"layers={layers} max |cos/sin ours - transformers| over the prompt: {rope_diff:.2e}")
    state = assemble(hf.state_dict().items(), dtype, torch.device("cuda"), False)
    for mode in ("torch", "triton-attn", "full"):
        ours, config = build_random_model(cfg, dtype, "cuda", 1024)
        ours.load_state_dict(state, strict=True)
        if mode == "full":
            install_cuda_kernels(ours)
        kv = KVCache.allocate(config, 64, 16, dtype, "cuda")
        blocks = -(-prompt_len // 16)
        kwargs = dict(
            query_lens=np.array([prompt_len]), seq_lens=np.array([prompt_len]),
            block_tables=np.arange(blocks)[None], block_size=16,
            slot_mapping=np.arange(prompt_len), device="cuda",
        )  # fmt: skip
        if mode == "torch":
            meta = AttentionMetadata.build(**kwargs)
        else:
            meta = TritonAttentionMetadata.build(num_kv_heads=8, **kwargs)
        positions = torch.arange(prompt_len, device="cuda")
        with torch.inference_mode():
            hidden = ours(ids, positions, meta, kv.layers)
            rows = hidden[-decode_rows:] if decode_rows > 1 else hidden[-1:]
            logits = ours.compute_logits(rows)[-1]
        print(
            f"layers={layers} {mode:12s} {str(dtype)[6:]}: logits {rel(logits, ref_logits):.4f} "
            f"hidden {rel(hidden[-1], ref_hidden):.4f} (logits rows={rows.shape[0]})"
        )
        del ours, kv
    del hf, state
    torch.cuda.empty_cache()


def _rope_table_diff(hf: LlamaForCausalLM, cfg: dict, prompt_len: int) -> float:
    """Largest difference between our RoPE table and transformers' (fp32, same positions)."""
    ours, _ = build_random_model(dict(cfg, num_hidden_layers=1), torch.float32, "cuda", 1024)
    positions = torch.arange(prompt_len, device="cuda")
    cos, sin = ours.rotary.lookup(positions)
    x = torch.zeros(1, prompt_len, 8, device="cuda", dtype=torch.float32)
    hf_cos, hf_sin = hf.model.rotary_emb.float()(x, positions[None])
    del ours
    return max(
        float((cos[:, 0].float() - hf_cos[0]).abs().max()),
        float((sin[:, 0].float() - hf_sin[0]).abs().max()),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 32])
    parser.add_argument("--prompt", type=int, default=300)
    parser.add_argument("--logit-rows", type=int, default=2, help="rows through compute_logits")
    parser.add_argument("--fp32", action="store_true", help="run ours in fp32 (same weights)")
    parser.add_argument("--plain-config", action="store_true", help="LlamaConfig(**preset)")
    parser.add_argument(
        "--keep-bf16-inv-freq", action="store_true", help="transformers' RoPE freqs as cast"
    )
    args = parser.parse_args()
    dtype = torch.float32 if args.fp32 else torch.bfloat16
    for layers in args.layers:
        probe(
            layers, args.prompt, args.logit_rows, dtype, args.plain_config, args.keep_bf16_inv_freq
        )


if __name__ == "__main__":
    main()
