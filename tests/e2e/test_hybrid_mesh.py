"""A hybrid attention + Mamba2 model served end to end (issue #35): a tiny random-weight Bamba
(layers mamba / attention / mamba) with SmolLM2's tokenizer, served by gateway, scheduler,
worker and kvstore processes on a real Redis with the offload tier on.

- Greedy completions, alone and several at once, equal transformers' fp32 generate.
- A second prompt sharing a long prefix is served from the scheduler's prefix cache (the state
  left at a block boundary plus the attention blocks: `cached_tokens` > 0) and its text equals
  the reference too.
- The tier stores attention chunks only: no Redis payload key names the state group.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import redis
import torch
from transformers import AutoTokenizer, BambaForCausalLM

from tests.e2e.conftest import E2E_ENV
from tests.e2e.hybrid_bamba import make_bamba_model
from tests.support.mesh import Mesh
from tests.support.tiny_llama import random_prompt, reference_greedy

BLOCK = 16
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def model_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_bamba_model(tmp_path_factory, smollm2_dir, "tiny-bamba")


@pytest.fixture(scope="module")
def mesh(model_dir: Path) -> Iterator[Mesh]:
    env = {
        **E2E_ENV,
        "MESHLLM_MODEL": str(model_dir),
        "MESHLLM_MAX_MODEL_LEN": "512",
        "MESHLLM_BLOCK_SIZE": str(BLOCK),
        "MESHLLM_KV_OFFLOAD": "true",
        "MESHLLM_KV_STORE_POLICY": "always",
    }
    with Mesh(services=("gateway", "scheduler", "worker", "kvstore"), env=env) as m:
        yield m


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> BambaForCausalLM:
    return BambaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def complete(mesh: Mesh, prompt: list[int]) -> tuple[str, int]:
    client = openai.OpenAI(base_url=mesh.api, api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    resp = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"min_tokens": MAX_TOKENS},
    )
    details = resp.usage.prompt_tokens_details if resp.usage else None
    return resp.choices[0].text, (details.cached_tokens or 0) if details else 0


def expected_text(model_dir: Path, reference: BambaForCausalLM, prompt: list[int]) -> str:
    ids = reference_greedy(reference, prompt, MAX_TOKENS, min_tokens=MAX_TOKENS)
    return AutoTokenizer.from_pretrained(model_dir).decode(ids)


def test_greedy_text_equals_transformers_alone_and_batched(
    mesh: Mesh, model_dir: Path, reference: BambaForCausalLM
) -> None:
    prompts = [random_prompt(n, seed) for seed, n in enumerate((5, 23, 47, 70), start=11)]
    alone = complete(mesh, prompts[2])[0]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        together = [text for text, _ in pool.map(lambda p: complete(mesh, p), prompts)]
    wanted = [expected_text(model_dir, reference, p) for p in prompts]
    assert together == wanted
    assert alone == wanted[2]


def test_a_shared_prefix_is_served_from_the_prefix_cache_with_the_same_text(
    mesh: Mesh, model_dir: Path, reference: BambaForCausalLM
) -> None:
    prefix = random_prompt(3 * BLOCK, 5)
    first = [*prefix, *random_prompt(9, 6)]
    second = [*prefix, *random_prompt(12, 7)]
    text1, _ = complete(mesh, first)
    text2, cached = complete(mesh, second)
    assert cached >= 3 * BLOCK - BLOCK  # at least the blocks before the last boundary state
    assert cached % BLOCK == 0
    assert text1 == expected_text(model_dir, reference, first)
    assert text2 == expected_text(model_dir, reference, second)


def test_the_tier_stores_no_state_group(mesh: Mesh) -> None:
    complete(mesh, random_prompt(4 * BLOCK + 3, 21))
    r = redis.Redis.from_url(mesh.redis.url, decode_responses=True)
    prefix = f"meshllm:{mesh.cluster}:kv:"
    deadline = time.monotonic() + 30
    groups: set[str] = set()
    while time.monotonic() < deadline:
        keys = [k[len(prefix) :] for k in r.scan_iter(prefix + "*", count=1000)]
        groups = {k.rsplit(":", 2)[-2] for k in keys}
        if groups:
            break
        time.sleep(0.2)
    r.close()
    assert groups == {"0"}  # the attention group; group 1 (state) is never stored
