"""Where the bf16 GPU forward departs from transformers: one prefill of an 8B-shaped Llama
(random weights copied from a transformers model), compared against transformers in fp32,
with the worker's CUDA pieces switched on one at a time.

    python3 -m bench.gpu.parity_probe --layers 2 32           # on the GPU

Modes: `torch` (the PyTorch reference attention and layers, on the GPU), `triton-attn` (fused
RoPE/KV insert and Triton attention, PyTorch layers), `full` (plus Triton RMSNorm and GEMV, as
the worker runs). Printed: ||ours - fp32|| / ||fp32|| of the last-token logits and of the
final hidden state, next to transformers' own bf16 error.
"""

from __future__ import annotations

import argparse
import copy

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from services.worker.attention import AttentionMetadata
from services.worker.attention_select import TritonAttentionMetadata
from services.worker.cuda_layers import install_cuda_kernels
from services.worker.kv_cache import KVCache
from services.worker.loader.checkpoint_names import assemble
from services.worker.models.random_init import PRESETS, build_random_model


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def probe(layers: int, prompt_len: int, decode_rows: int, dtype: torch.dtype) -> None:
    cfg = dict(PRESETS["llama-3-8b"], num_hidden_layers=layers)
    hf_cfg = {k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")}
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = LlamaForCausalLM(LlamaConfig(**hf_cfg)).to(torch.bfloat16).eval()
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 32])
    parser.add_argument("--prompt", type=int, default=300)
    parser.add_argument("--logit-rows", type=int, default=2, help="rows through compute_logits")
    parser.add_argument("--fp32", action="store_true", help="run ours in fp32 (same weights)")
    args = parser.parse_args()
    dtype = torch.float32 if args.fp32 else torch.bfloat16
    for layers in args.layers:
        probe(layers, args.prompt, args.logit_rows, dtype)


if __name__ == "__main__":
    main()
