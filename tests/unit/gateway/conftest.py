"""Gateway test fixtures: the SmolLM2 tokenizer (loaded once), a tiny MoE model dir, and the
gateway harness, with the settings a module names in its `harness` marker
(`pytestmark = pytest.mark.harness(max_model_len=64)`; gateway_harness's keywords) or the
defaults."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.gateway.plan.tokenization import PromptTokenizer
from tests.unit.gateway.harness import GatewayHarness, gateway_harness, load_tokenizer


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir: Path) -> PromptTokenizer:
    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="session")
def moe_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real Qwen3-MoE config (2 layers, 4 experts, top-2) with SmolLM2's tokenizer: the
    gateway reads only the config and the tokenizer, never weights."""
    from transformers import Qwen3MoeConfig

    out = tmp_path_factory.mktemp("tiny-moe")
    Qwen3MoeConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
    ).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2_dir / name, out / name)
    return out


@pytest.fixture
async def gateway(
    request: pytest.FixtureRequest, redis_url: str, tokenizer: PromptTokenizer, smollm2_dir: Path
) -> AsyncIterator[GatewayHarness]:
    marker = request.node.get_closest_marker("harness")
    options = marker.kwargs if marker is not None else {}
    async with gateway_harness(redis_url, tokenizer, smollm2_dir, **options) as harness:
        yield harness
