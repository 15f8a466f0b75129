"""The tiny sliding-window model of the offload/P-D e2e tests: a random-weight Gemma-3 (window
16) with SmolLM2's tokenizer, and the mesh settings every such test starts from."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import E2E_ENV
from tests.support.tiny_llama import copy_tokenizer
from tests.support.tiny_models import make_tiny

BLOCK = 16
WINDOW = 16


def make_swa_model(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    out = tmp_path_factory.mktemp(name)
    make_tiny(out, "gemma3", seed=5, vocab_size=49152, sliding_window=WINDOW,
              max_position_embeddings=512)  # fmt: skip
    copy_tokenizer(smollm2_dir, out)
    return out


def swa_env(model_dir: Path, **overrides: str) -> dict[str, str]:
    """E2E_ENV with the model, its block size and the KV tier on; `overrides` win."""
    return {
        **E2E_ENV,
        "MESHLLM_MODEL": str(model_dir),
        "MESHLLM_MAX_MODEL_LEN": "512",
        "MESHLLM_BLOCK_SIZE": str(BLOCK),
        "MESHLLM_HEARTBEAT_INTERVAL_S": "0.5",
        "MESHLLM_KV_OFFLOAD": "true",
        **overrides,
    }
