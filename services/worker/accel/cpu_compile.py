"""The model's forward and logits compiled by inductor for CPU (`MESHLLM_CPU_COMPILE`).

Eager bf16 decoding on CPU spends as long on small ops as on the matmuls: every RMSNorm is
seven elementwise passes, RoPE four, SwiGLU two, each a dispatch of a few microseconds on
tensors of a few kilobytes. Compiled with freezing, the weights become constants that inductor
packs for oneDNN once, and each chain of elementwise ops becomes one vectorised C++ loop. The
attention stays the eager paged path behind an opaque op (bound_attention.py), so one graph
serves every step: decode batches, prefill chunks and mixed steps, of any size (the token
count is unbacked, so size 1 is not specialised into a graph of its own).

The compiled forward is the faster one on small-model CPU decode steps. Compiling takes tens of
seconds at every start-up: frozen graphs bypass inductor's on-disk graph cache, so a second
start is no faster.

Numerics: fused chains keep fp32 intermediates that eager bf16 rounds, so outputs are close to
the eager path, not bit-identical (as in vLLM, whose CPU backend compiles the same way).

Memory: the packed weights are copies; the model keeps its checkpoint-layout ones too (dynamo
guards on them), so the linears' weights take twice their size (SmolLM2-135M: +270 MB).
"""

from __future__ import annotations

import logging
import os
import shutil
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from services.worker.attention.bound import LayerAttention, bind
from services.worker.attention.reference import AttentionMetadata
from services.worker.attention.select import TritonAttentionMetadata
from services.worker.models.base import CausalLM, per_layer_metadata
from shared.model.config import ModelConfig

log = logging.getLogger(__name__)


def compile_supported(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> str:
    """'' when the forward can be compiled for this model and device, else why not."""
    if device.type != "cpu":
        return f"{device.type}: CUDA workers use their Triton kernels and CUDA graphs"
    if dtype != torch.bfloat16:
        return f"{dtype}: only bfloat16 is compiled (float32 is the reference-parity path)"
    if config.num_moe_layers:
        return "MoE routing is data-dependent Python (and records routed experts eagerly)"
    if config.mamba is not None:
        return "the Mamba2 layers' per-request state reads and writes run eagerly"
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:  # inductor builds its CPU kernels with it
        return f"no C++ compiler ({compiler}; set CXX or install g++)"
    headers = python_headers()
    if not (headers / "Python.h").exists():  # its kernels' modules are Python extensions
        return f"no Python headers ({headers}/Python.h; install python3-dev)"
    return ""


def python_headers() -> Path:
    return Path(sysconfig.get_paths()["include"])


class CompiledForward:
    """`forward` and `compute_logits` of a CausalLM, compiled; same signatures as the model's.

    The model's linears must be plain `nn.Linear` (not PackedLinear): freezing packs them
    itself, and cannot take weights that are already packed.
    """

    def __init__(self, model: CausalLM) -> None:
        # Imported here, not at the top: ~0.9 s of every worker's start-up, and only bf16 CPU
        # workers compile.
        import torch._inductor.config as inductor_config

        self.model = model
        num_layers = model.config.num_hidden_layers
        # One list reused on every call, so the compiled graph's guards on it always hold.
        self._layers = [LayerAttention(i) for i in range(num_layers)]
        # Freezing is read from the global config when a graph is compiled (passing it in
        # torch.compile's `options` does not reach that check: measured, the linears then stay
        # unpacked aten.mm). Nothing else in the worker compiles, so setting it globally is safe.
        inductor_config.freezing = True
        # The graph's wrapper (the code calling each kernel and op in turn) in C++, not
        # Python: hundreds of calls a step, each paying the interpreter otherwise. Steps are
        # faster; warm-up is longer (the wrapper is compiled too).
        inductor_config.cpp_wrapper = True
        self._forward = torch.compile(model.forward, dynamic=False)
        self._logits = torch.compile(model.compute_logits, dynamic=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata | TritonAttentionMetadata | Sequence[AttentionMetadata],
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        # The token count is the one dimension that varies: unbacked, so a 1-token step uses
        # the same graph (a backed size of 1 would be specialised into a graph of its own),
        # and never equated with a cache dimension that happens to have the same size.
        if isinstance(attn, TritonAttentionMetadata):
            raise TypeError("a compiled forward runs the CPU attention path only")
        torch._dynamo.decorators.mark_unbacked(input_ids, 0)
        torch._dynamo.decorators.mark_unbacked(positions, 0)
        with bind(per_layer_metadata(attn, len(self._layers))):
            # The model sees the layers' stand-ins where its metadata would be.
            layers: Any = self._layers
            hidden: torch.Tensor = self._forward(input_ids, positions, layers, kv_caches)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        torch._dynamo.decorators.mark_unbacked(hidden, 0)
        logits: torch.Tensor = self._logits(hidden)
        return logits
