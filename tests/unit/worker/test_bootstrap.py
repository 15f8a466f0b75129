"""The worker refuses a KV cache that cannot hold one sequence of the advertised context."""

from __future__ import annotations

import pytest

from services.worker.bootstrap import build_runner
from services.worker.kv_cache import KVCacheSizeError
from shared.config import WorkerSettings
from shared.model_source import ModelSource


def test_kv_cache_smaller_than_one_context_is_refused(smollm2_dir):
    source = ModelSource("smollm2", smollm2_dir, smollm2_dir)
    # SmolLM2 fp32 KV: 30 layers x 2 x 3 heads x 64 x 4 bytes = 46 KiB per token.
    settings = WorkerSettings(kv_cache_bytes=64 * 2**20, max_model_len=8192, dtype="float32")
    with pytest.raises(KVCacheSizeError, match="MESHLLM_MAX_MODEL_LEN"):
        build_runner(source, settings, "inc")


def test_kv_cache_holding_the_context_starts(smollm2_dir):
    source = ModelSource("smollm2", smollm2_dir, smollm2_dir)
    settings = WorkerSettings(kv_cache_bytes=64 * 2**20, max_model_len=1024, dtype="float32")
    runner, ready = build_runner(source, settings, "inc")
    assert ready.max_model_len == 1024
    assert (ready.num_kv_blocks - 1) * ready.block_size >= 1024
    assert runner.batch.num_reqs == 0
