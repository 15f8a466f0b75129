"""The worker asks the attention backend registry once per configuration, for what its
forwards need, and refuses at start-up what no backend of its path can compute
(services/worker/attention/backend_choice.py; CONTRACTS: "Non-causal draft blocks")."""

from __future__ import annotations

import pytest
import torch

from meshllm_kernels.attention.backends import (
    AttentionRequirements,
    BackendCapabilityError,
    TritonPagedAttention,
)
from services.worker.attention.backend_choice import attention_requirements, resolve_backend
from services.worker.attention.reference import ReferenceAttention
from services.worker.models.random_init import build_random_model
from services.worker.runner.kv_cache import KVCache
from services.worker.runner.model_runner import ModelRunner
from services.worker.spec.row_kv import RowKV
from shared.kv.groups import STATE, kv_groups_for
from tests.support.tiny_llama import RANDOM_TINY_LLAMA

FULL = kv_groups_for([None, None])
WINDOWED = kv_groups_for([8, None])  # one sliding-window layer, one full
HYBRID = kv_groups_for([STATE, None, STATE])  # Mamba2 layers around an attention layer


def test_requirements_follow_the_configuration() -> None:
    assert attention_requirements(FULL, torch.bfloat16) == AttentionRequirements()
    assert attention_requirements(WINDOWED, torch.float32) == AttentionRequirements(
        sliding_window=True
    )
    assert attention_requirements(FULL, torch.float8_e4m3fn) == AttentionRequirements(fp8_kv=True)
    # The target's forwards (verification too) are causal; only a block drafter's own cache
    # (spec/block_drafter.py) asks for non-causal blocks.
    assert not attention_requirements(WINDOWED, torch.float8_e5m2).non_causal
    assert attention_requirements(FULL, torch.float32, non_causal=True).non_causal


def test_the_path_of_each_device_and_grouping() -> None:
    cuda = resolve_backend("cuda", FULL, torch.bfloat16)
    assert isinstance(cuda, TritonPagedAttention)
    # Sliding-window groups build the reference path's metadata, on CUDA too (groups.py).
    assert isinstance(resolve_backend("cuda", WINDOWED, torch.bfloat16), ReferenceAttention)
    # A hybrid's attention group runs the paged kernels (its decode graphs hold them).
    assert [g.kind for g in HYBRID] == ["full", "state"]
    assert isinstance(resolve_backend("cuda", HYBRID, torch.bfloat16), TritonPagedAttention)
    assert isinstance(resolve_backend("cpu", HYBRID, torch.float32), ReferenceAttention)
    assert isinstance(resolve_backend("cpu", FULL, torch.float32), ReferenceAttention)
    assert isinstance(resolve_backend("cpu", WINDOWED, torch.float32), ReferenceAttention)
    # The Triton kernels quantize into an fp8 cache.
    assert isinstance(resolve_backend("cuda", FULL, torch.float8_e4m3fn), TritonPagedAttention)


def test_the_reference_path_declares_what_it_cannot_compute() -> None:
    assert ReferenceAttention.missing(AttentionRequirements(non_causal=True, fp8_kv=True)) == [
        "fp8_kv"
    ]
    assert ReferenceAttention.missing(AttentionRequirements(sliding_window=True)) == []
    with pytest.raises(BackendCapabilityError, match="'reference' does not support fp8_kv"):
        resolve_backend("cpu", FULL, torch.float8_e4m3fn)
    with pytest.raises(BackendCapabilityError, match="'reference' does not support fp8_kv"):
        resolve_backend("cuda", WINDOWED, torch.float8_e4m3fn)


def test_a_runner_that_no_backend_can_serve_fails_at_start_up() -> None:
    model, config = build_random_model(RANDOM_TINY_LLAMA, torch.float32, "cpu")
    fp8 = KVCache.allocate(config, 16, 4, torch.float8_e4m3fn, "cpu")
    with pytest.raises(BackendCapabilityError, match="'reference' does not support fp8_kv"):
        ModelRunner(model, config, fp8, "cpu")
    runner = ModelRunner(model, config, KVCache.allocate(config, 16, 4, torch.float32, "cpu"))
    assert isinstance(runner.attention_backend, ReferenceAttention)


def test_a_drafters_private_cache_resolves_its_backend_once() -> None:
    _, config = build_random_model(RANDOM_TINY_LLAMA, torch.float32, "cpu")
    kv = RowKV(config, 2, 64, 4, torch.float32, torch.device("cpu"))
    assert isinstance(kv.backend, ReferenceAttention)
    with pytest.raises(BackendCapabilityError, match="fp8_kv"):
        RowKV(config, 2, 64, 4, torch.float8_e4m3fn, torch.device("cpu"))
