"""Every input error of the KV insert launchers raises a clear error before any launch."""

from __future__ import annotations

import pytest
import torch

from meshllm_kernels.attention.kv_insert import insert_kv, insert_qkv
from meshllm_kernels.runtime.tensor_checks import FP8_E4M3
from tests.kernels.rope_cache import cos_sin_cache

T, HQ, HKV, D = 6, 4, 2, 16


def _args() -> dict[str, object]:
    return {
        "query": torch.randn(T, HQ, D, dtype=torch.float16),
        "key": torch.randn(T, HKV, D, dtype=torch.float16),
        "value": torch.randn(T, HKV, D, dtype=torch.float16),
        "kv_cache": torch.zeros(2, 4, 4, HKV, D, dtype=torch.float16),
        "slot_mapping": torch.arange(T, dtype=torch.int64),
        "positions": torch.arange(T, dtype=torch.int64),
        "cos_sin_cache": cos_sin_cache(32, D, torch.device("cpu")),
    }


def f16(*shape: int, device: str = "cpu") -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float16, device=device)


def _fp8_cache(a: dict[str, object]) -> dict[str, object]:
    return {"kv_cache": torch.zeros(2, 4, 4, HKV, D).to(FP8_E4M3)}


CASES = [
    (
        TypeError,
        r"slot_mapping has dtype torch\.int32.*int64",
        lambda a: {"slot_mapping": torch.arange(T, dtype=torch.int32)},
    ),
    (ValueError, "slot_mapping has shape", lambda a: {"slot_mapping": torch.arange(T + 1)}),
    (ValueError, "an fp8 kv_cache needs k_scale and v_scale", _fp8_cache),
    (ValueError, "needs k_scale and v_scale", lambda a: {**_fp8_cache(a), "k_scale": 0.5}),
    (
        ValueError,
        "k_scale must be positive",
        lambda a: {**_fp8_cache(a), "k_scale": 0.0, "v_scale": 1.0},
    ),
    (ValueError, "only for an fp8 kv_cache", lambda a: {"k_scale": 0.5, "v_scale": 0.5}),
    (
        TypeError,
        "unsupported kv_cache dtype torch.int8",
        lambda a: {"kv_cache": torch.zeros(2, 4, 4, HKV, D, dtype=torch.int8)},
    ),
    (
        TypeError,
        "unsupported kv_cache dtype torch.float64",
        lambda a: {"kv_cache": torch.zeros(2, 4, 4, HKV, D, dtype=torch.float64)},
    ),
    (
        ValueError,
        "token records must be contiguous",
        lambda a: {"kv_cache": f16(2, 4, 4, D, HKV).transpose(3, 4)},
    ),
    (ValueError, "key has 3 heads; kv_cache has 2", lambda a: {"key": f16(T, 3, D)}),
    (ValueError, "value has 5 tokens; key has 6", lambda a: {"value": f16(5, HKV, D)}),
    (ValueError, "key head_dim 8 != kv_cache head_dim 16", lambda a: {"key": f16(T, HKV, 8)}),
    (
        TypeError,
        "key has dtype torch.int64",
        lambda a: {"key": torch.zeros(T, HKV, D, dtype=torch.int64)},
    ),
    (
        ValueError,
        "key must have a contiguous last dimension",
        lambda a: {"key": f16(T, HKV, 2 * D)[..., ::2]},
    ),
    (ValueError, "query has 5 tokens", lambda a: {"query": f16(5, HQ, D)}),
    (ValueError, "positions has shape", lambda a: {"positions": torch.arange(T + 2)}),
    (
        TypeError,
        "positions has dtype torch.float32",
        lambda a: {"positions": torch.arange(T).float()},
    ),
    (TypeError, "positions must be a torch.Tensor", lambda a: {"positions": None}),
    (ValueError, "positions must lie in 0..31", lambda a: {"positions": torch.arange(T) + 30}),
    (ValueError, "must be even and in 1..16", lambda a: {"cos_sin_cache": torch.zeros(32, 18)}),
    (ValueError, "must be even and in 1..16", lambda a: {"cos_sin_cache": torch.zeros(32, 7)}),
    (
        ValueError,
        "is on meta but kv_cache is on cpu",
        lambda a: {"value": f16(T, HKV, D, device="meta")},
    ),
    (ValueError, "max_tile_programs must be >= 1", lambda a: {"max_tile_programs": 0}),
]


@pytest.mark.parametrize(("exc", "message", "override"), CASES)
def test_qkv_rejects(exc, message, override) -> None:  # type: ignore[no-untyped-def]
    args = _args()
    args.update(override(args))
    with pytest.raises(exc, match=message):
        insert_qkv(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(("exc", "message", "override"), [c for c in CASES if "query" not in c[1]])
def test_kv_only_rejects(exc, message, override) -> None:  # type: ignore[no-untyped-def]
    args = _args()
    args.update(override(args))
    del args["query"]
    with pytest.raises(exc, match=message):
        insert_kv(**args)  # type: ignore[arg-type]


def test_qkv_needs_a_query() -> None:
    args = _args()
    args["query"] = None
    with pytest.raises(ValueError, match="use insert_kv"):
        insert_qkv(**args)  # type: ignore[arg-type]
