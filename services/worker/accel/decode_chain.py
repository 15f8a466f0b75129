"""The decode chain: a Llama stack's decode-sized CUDA forward with each output projection's
split-K reduce fused into the residual add and the RMSNorm that follows it.

The layer-by-layer forward runs, per layer, RMSNorm(+residual), qkv GEMV, attention, o GEMV
and its split-K reduce, RMSNorm(+residual), gate_up GEMV, down GEMV and its reduce. Here the o
and down projections go through `meshllm_kernels.decode_chain.gemv.gemv_add_rmsnorm`: the kernel
that sums their partials also adds the residual stream and normalizes it with the norm that comes
next (the layer's post-attention norm, the next layer's input norm, the final norm after the last
layer), so each layer launches two kernels fewer and the residual stream never round-trips through a
separate reduce output. The rounding is the unfused chain's, step for step (bit-identical;
tests/kernels/test_gemv_add_rmsnorm.py, tests/unit/worker/test_decode_chain.py).

Where the step allows it (`fused_attention_takes`: all decodes, no window, the strided split-K
decode, plain qkv projections), each layer's attention also runs from the qkv GEMV's split-K
partials in one kernel (meshllm_kernels/decode_chain/decode_from_qkv.py: the reduce, RoPE + KV
insert and the decode attention; bit-identical to the three launches): 7 launches a layer instead of
9.

It needs the next norm's weight inside a layer, so it is a model-level forward: the loader sets
`model.decode_chain = decode_chain_for(model)` (through cuda_layers.TRITON) on a plain
`LlamaForCausalLM` (Llama, Mistral, Qwen2/3) built with the CUDA layers of cuda_layers.py, with
no bias on o/down and a SiLU MLP (`chain_fits`); other families and models keep None. The
model's `forward` hands it the steps it `takes`: 1..16 rows on CUDA (the GEMV's tuned range; more
where the worker raises `gemv_max_rows`); larger steps run the layer-by-layer forward (cuBLAS
GEMMs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F

from services.worker.accel.cuda_layers import (
    GEMV_DTYPES,
    GemvGatedMLP,
    GemvLinear,
    TritonRMSNorm,
    gemv_max_rows,
)
from services.worker.attention.reference import AttentionMetadata
from services.worker.attention.select import TritonAttentionMetadata
from services.worker.models.base import per_layer_metadata
from services.worker.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


def chain_fits(model: torch.nn.Module) -> bool:
    """Whether `model` and every layer of it have the structure the chain runs (see the module
    doc). Exactly LlamaForCausalLM: a family's subclass changes the embedding or the layers."""
    if type(model) is not LlamaForCausalLM or type(model.norm) is not TritonRMSNorm:
        return False
    dtype = model.norm.weight.dtype
    return dtype in GEMV_DTYPES and all(_layer_fits(layer, dtype) for layer in model.layers)


def _layer_fits(layer: torch.nn.Module, dtype: torch.dtype) -> bool:
    if type(layer) is not LlamaDecoderLayer or type(layer.self_attn) is not LlamaAttention:
        return False
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.o_proj, getattr(mlp, "down_proj", None))
    return (
        type(mlp) is GemvGatedMLP
        and mlp.act is F.silu
        and all(type(lin) is GemvLinear and lin.bias is None for lin in linears)
        and all(type(norm) is TritonRMSNorm for norm in _norms(layer))
        and all(lin.weight.dtype == dtype for lin in linears)  # type: ignore[union-attr]
    )


def _norms(layer: LlamaDecoderLayer) -> tuple[torch.nn.Module, torch.nn.Module]:
    return layer.input_layernorm, layer.post_attention_layernorm


def chain_forward(
    model: LlamaForCausalLM,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    attn: AttentionMetadata | Sequence[AttentionMetadata],
    kv_caches: list[torch.Tensor],
) -> torch.Tensor:
    """`model.forward` with the fused reduces: input_ids [T] (1..128) -> final normed hidden."""
    from meshllm_kernels.decode_chain.embed_rmsnorm import embed_rmsnorm
    from meshllm_kernels.decode_chain.gemv import gemv_add_rmsnorm

    layers: Sequence[LlamaDecoderLayer] = model.layers  # type: ignore[assignment]
    first = layers[0].input_layernorm
    fed = attn.fed_tokens if isinstance(attn, TritonAttentionMetadata) else None
    normed, stream = embed_rmsnorm(
        input_ids, model.embed_tokens.weight, first.weight, first.eps, latest=fed
    )
    attends = _attends(model, input_ids.shape[0], positions, attn, kv_caches)
    for i, (layer, attend) in enumerate(zip(layers, attends, strict=True)):
        attn_out = attend(normed)
        post = layer.post_attention_layernorm
        normed, stream = gemv_add_rmsnorm(
            attn_out, layer.self_attn.o_proj.weight, stream, post.weight, post.eps
        )
        mlp: GemvGatedMLP = layer.mlp  # type: ignore[assignment]
        gate_up = mlp.gate_up_proj(normed)
        nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.norm
        normed, stream = gemv_add_rmsnorm(
            gate_up, mlp.down_proj.weight, stream, nxt.weight, nxt.eps, gated=True
        )
    return normed


def _attends(
    model: LlamaForCausalLM,
    rows: int,
    positions: torch.Tensor,
    attn: AttentionMetadata | Sequence[AttentionMetadata],
    kv_caches: list[torch.Tensor],
) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    """Per layer: normed hidden -> attention output. The fused attention reads each
    position's RoPE row from the model's cos | sin table itself (no per-step lookup)."""
    layers: Sequence[LlamaDecoderLayer] = model.layers  # type: ignore[assignment]
    if fused_attention_takes(model, attn, rows):
        if len(kv_caches) != len(layers):
            raise ValueError(f"{len(kv_caches)} KV caches for {len(layers)} layers")
        metas = per_layer_metadata(attn, len(layers))
        table = model.rotary.cos_sin
        return [
            partial(fused_attention, layer.self_attn, positions, table, meta, kv_cache)  # type: ignore[arg-type]
            for layer, meta, kv_cache in zip(layers, metas, kv_caches, strict=True)
        ]
    return [
        partial(_attend, layer.self_attn, cos, sin, meta, kv_cache)  # type: ignore[arg-type]
        for layer, (cos, sin, meta, kv_cache) in zip(
            layers, model.layer_inputs(positions, attn, kv_caches), strict=True
        )
    ]


def _attend(
    attn: LlamaAttention,
    cos: torch.Tensor,
    sin: torch.Tensor,
    meta: AttentionMetadata,
    kv_cache: torch.Tensor,
    normed: torch.Tensor,
) -> torch.Tensor:
    out: torch.Tensor = attn.attend(normed, cos, sin, meta, kv_cache)
    return out


def fused_attention_takes(
    model: LlamaForCausalLM, attn: AttentionMetadata | Sequence[AttentionMetadata], rows: int
) -> bool:
    """Whether this step's attention runs from the qkv partials in one kernel
    (meshllm_kernels/decode_chain/decode_from_qkv.py): one metadata for all layers, every row a
    decode, no window, the strided split-K decode, and every layer's qkv without bias or q/k
    norm."""
    from meshllm_kernels.attention.paged_decode import strided_choice

    if not isinstance(attn, TritonAttentionMetadata) or model.rotary_local is not None:
        return False
    meta = attn
    if not (meta.num_decodes == meta.num_tokens == rows and meta.sliding_window is None):
        return False
    if meta.decode_num_splits < 2 or meta.decode_block_tables is None:
        return False
    device = meta.decode_block_tables.device
    if not strided_choice(rows, meta.num_kv_heads, meta.decode_num_splits, device):
        return False
    return all(_plain_qkv(layer.self_attn) for layer in model.layers)  # type: ignore[union-attr]


def _plain_qkv(attn: torch.nn.Module) -> bool:
    return (
        type(attn) is LlamaAttention
        and type(attn.qkv_proj) is GemvLinear
        and attn.qkv_proj.bias is None
        and attn.q_norm is None
        and attn.k_norm is None
    )


def fused_attention(
    attn: LlamaAttention,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    meta: TritonAttentionMetadata,
    kv_cache: torch.Tensor,
    normed: torch.Tensor,
) -> torch.Tensor:
    """`attn.attend` for a step `fused_attention_takes`: the qkv GEMV's partials, then the
    reduce, RoPE + KV insert and decode attention in one launch; bit-identical. Row t's
    rotation is row positions[t] of cos_sin ([max_position, rotary_dim] = cos | sin)."""
    from meshllm_kernels.decode_chain.decode_from_qkv import decode_from_qkv
    from meshllm_kernels.decode_chain.gemv import gemv_partials

    part = gemv_partials(normed, attn.qkv_proj.weight)
    assert meta.decode_block_tables is not None and meta.decode_seq_lens is not None
    out = decode_from_qkv(
        part, kv_cache, meta.decode_block_tables, meta.decode_seq_lens, meta.slot_mapping,
        positions, cos_sin, num_heads=attn.num_heads,
        num_splits=meta.decode_num_splits, dtype=normed.dtype, sm_scale=attn.scale,
    )  # fmt: skip
    return out.view(normed.shape[0], -1)


def chain_takes(input_ids: torch.Tensor) -> bool:
    """A step the chain runs: on CUDA, 1..gemv_max_rows() tokens."""
    return input_ids.is_cuda and input_ids.dim() == 1 and 1 <= input_ids.shape[0] <= gemv_max_rows()


class DecodeChain:
    """The decode chain of one loaded model: what `LlamaForCausalLM.forward` consults."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model

    def takes(self, input_ids: torch.Tensor) -> bool:
        # The chain returns the final hidden state only: EAGLE-3's auxiliary layer states
        # (aux_hidden_layers) come from the layer-by-layer forward.
        return not self.model.aux_hidden_layers and chain_takes(input_ids)

    def reads_fed_ids(self, num_tokens: int) -> bool:
        """Whether a CUDA decode graph of `num_tokens` rows runs the chain, whose first kernel
        reads fed token ids itself (TritonAttentionMetadata.fed_tokens; cuda_graphs.py)."""
        return not self.model.aux_hidden_layers and 1 <= num_tokens <= gemv_max_rows()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata | Sequence[AttentionMetadata],
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        return chain_forward(self.model, input_ids, positions, attn, kv_caches)


def decode_chain_for(model: torch.nn.Module) -> DecodeChain | None:
    """The chain of a loaded model (weights in place: their dtypes are checked), or None
    where it does not fit."""
    if not chain_fits(model):
        return None
    assert isinstance(model, LlamaForCausalLM)
    return DecodeChain(model)
