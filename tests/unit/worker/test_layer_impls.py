"""Layer implementations chosen when a model is built (services/worker/models/layer_impls.py):
every family builds its Linear, RMSNorm and gated MLP from the LayerImpls it is given, the
Triton ones keep the reference's parameters, and on CPU tensors they compute the reference's
result bit for bit (their fallback). The kernels themselves are tested in tests/kernels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from services.worker.accel.cuda_layers import TRITON, GemvGatedMLP, GemvLinear, TritonRMSNorm
from services.worker.attention.reference import AttentionMetadata
from services.worker.loader import layer_impls_for, load_model
from services.worker.models.base import CausalLM
from services.worker.models.layer_impls import REFERENCE
from services.worker.models.layers import GatedMLP, GemmaRMSNorm, RMSNorm
from services.worker.runner.kv_cache import KVCache
from shared.model.config import ModelConfig
from tests.support.tiny_llama import make_tiny_llama
from tests.support.tiny_models import FAMILIES, make_tiny

PROMPT = [1, 17, 40, 3, 99, 250, 7, 31, 8]
#: families whose loaded model is a plain LlamaForCausalLM with SiLU and no o/down bias
CHAIN_FAMILIES = {"llama", "mistral", "qwen2", "qwen3"}
#: families with no dense gated MLP (every layer sparse, no shared expert)
ALL_SPARSE = {"mixtral", "qwen3_moe"}


def _logits(model: CausalLM, config: ModelConfig) -> torch.Tensor:
    n = len(PROMPT)
    kv = KVCache.allocate(config, 8, 4, torch.float32, "cpu")
    meta = AttentionMetadata.build(
        query_lens=np.array([n]), seq_lens=np.array([n]), block_tables=np.arange(8)[None],
        block_size=4, slot_mapping=np.arange(n),
    )  # fmt: skip
    with torch.inference_mode():
        hidden = model(torch.tensor(PROMPT), torch.arange(n), meta, kv.layers)
        return model.compute_logits(hidden)


@pytest.mark.parametrize("family", ["llama", *sorted(FAMILIES)])
def test_triton_layers_keep_the_reference_parameters_and_cpu_results(
    tmp_path: Path, family: str
) -> None:
    if family == "llama":
        make_tiny_llama(tmp_path)
    else:
        make_tiny(tmp_path, family)
    reference, config = load_model(tmp_path, torch.float32, "cpu")
    triton, _ = load_model(tmp_path, torch.float32, "cpu", impls=TRITON)
    ref_state, tri_state = reference.state_dict(), triton.state_dict()
    assert ref_state.keys() == tri_state.keys()
    for name, value in ref_state.items():
        assert torch.equal(value, tri_state[name]), name

    kinds = {type(m) for m in triton.modules()}
    assert GemvLinear in kinds and nn.Linear not in kinds  # attention, MLP, router, head
    assert GatedMLP not in kinds and (GemvGatedMLP in kinds) != (family in ALL_SPARSE)
    assert RMSNorm not in kinds
    norm = GemmaRMSNorm if family == "gemma3" else TritonRMSNorm  # Gemma's (1 + w) has no kernel
    assert {type(m) for m in triton.modules() if isinstance(m, RMSNorm)} == {norm}
    assert not any(isinstance(m, (GemvLinear, TritonRMSNorm)) for m in reference.modules())

    assert (triton.decode_chain is not None) == (family in CHAIN_FAMILIES)
    assert reference.decode_chain is None
    assert torch.equal(_logits(triton, config), _logits(reference, config))


def test_the_loader_picks_the_layers_by_device() -> None:
    assert layer_impls_for(torch.device("cpu")) is REFERENCE
    assert layer_impls_for(torch.device("cuda")) is TRITON  # a device name: no GPU needed
    assert REFERENCE.rms_norm(8, 1e-6).__class__ is RMSNorm
    mlp = TRITON.gated_mlp(8, 12)
    assert type(mlp) is GemvGatedMLP and type(mlp.down_proj) is GemvLinear
    gemma = TRITON.with_norm(GemmaRMSNorm)
    assert type(gemma.rms_norm(8, 1e-6)) is GemmaRMSNorm and gemma.linear_cls is GemvLinear
