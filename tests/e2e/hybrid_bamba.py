"""The tiny hybrid model of the hybrid e2e tests: a random-weight Bamba (layers mamba /
attention / mamba / mamba: a full-attention and a state KV group) with SmolLM2's tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.tiny_llama import copy_tokenizer
from tests.support.tiny_models import make_tiny


def make_bamba_model(
    tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path, name: str
) -> Path:
    out = tmp_path_factory.mktemp(name)
    make_tiny(out, "bamba", seed=3, vocab_size=49152, max_position_embeddings=512)
    copy_tokenizer(smollm2_dir, out)
    return out
