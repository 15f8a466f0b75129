"""Prefill/decode disaggregation end to end: gateway, kvstore, a prefill group (scheduler with
MESHLLM_ROLE=prefill + worker) and a decode group (MESHLLM_ROLE=decode + worker), as processes
on a real Redis, serving a tiny random-weight Llama (SmolLM2's tokenizer) checked against
transformers.

The prefill lookahead N is 3: the prefill group computes prompt_len - 3 tokens and stores their
full blocks through the offload tier; the decode group loads them, computes the rest and decodes.
Checked: greedy text equals transformers' (the standalone engine is held to the same reference
by the engine and family tests); the decode scheduler's metrics show the loaded prefix; the KV
keys in Redis are exactly the full blocks of the first prompt_len - 3 tokens (nothing of the
last N prompt tokens nor of any output: the decode group stores nothing).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import redis
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from shared.kv.block_hash import extend_block_hashes
from tests.e2e.conftest import E2E_ENV
from tests.support.mesh import Mesh
from tests.support.redis_server import free_port
from tests.support.tiny_llama import (
    copy_tokenizer,
    make_tiny_llama,
    random_prompt,
    reference_greedy,
)

LOOKAHEAD = 3
BLOCK = 16
GROUPS = {"prefill": "p", "decode": "d"}  # role -> worker group


class PDMesh(Mesh):
    """A Mesh whose `scheduler-<role>` / `worker-<role>` services run the scheduler and worker
    modules of one worker group per role."""

    def __init__(self, env: dict[str, str]) -> None:
        roles = [f"{kind}-{role}" for role in GROUPS for kind in ("worker", "scheduler")]
        super().__init__(services=("kvstore", *roles, "gateway"), env=env)
        self.ports.update({name: free_port() for name in roles})

    def start_service(self, name: str, overrides: dict[str, str] | None = None) -> None:
        module, _, role = name.partition("-")
        if not role:
            return super().start_service(name, overrides)
        env = {"MESHLLM_GROUP": GROUPS[role], **(overrides or {})}
        if module == "scheduler":
            env["MESHLLM_ROLE"] = role
        self.spawn(name, module, env)


@pytest.fixture(scope="module")
def model_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama-pd")
    make_tiny_llama(
        out,
        seed=3,
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        max_position_embeddings=512,
    )
    copy_tokenizer(smollm2_dir, out)
    return out


@pytest.fixture(scope="module")
def pd_mesh(model_dir: Path) -> Iterator[PDMesh]:
    env = {
        **E2E_ENV,
        "MESHLLM_MODEL": str(model_dir),
        "MESHLLM_MAX_MODEL_LEN": "512",
        "MESHLLM_BLOCK_SIZE": str(BLOCK),
        "MESHLLM_PREFILL_LOOKAHEAD_TOKENS": str(LOOKAHEAD),
        "MESHLLM_HEARTBEAT_INTERVAL_S": "0.5",
        "MESHLLM_KV_OFFLOAD": "true",
    }
    with PDMesh(env) as mesh:
        yield mesh


def stored_hashes(mesh: Mesh) -> set[str]:
    """Block hashes (hex) of every KV payload key in Redis."""
    r = redis.Redis.from_url(mesh.redis.url, decode_responses=True)
    prefix = f"meshllm:{mesh.cluster}:kv:"
    keys = list(r.scan_iter(prefix + "*", count=1000))
    r.close()
    return {key.rsplit(":", 1)[1] for key in keys}


def block_hashes(tokens: list[int]) -> set[str]:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, BLOCK)
    return {h.hex() for h in hashes}


def test_greedy_output_under_pd_equals_the_reference_and_only_prefill_kv_is_stored(
    pd_mesh: PDMesh, model_dir: Path
) -> None:
    client = openai.OpenAI(base_url=pd_mesh.api, api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    reference = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # 67 tokens: the prefill side computes 64 = 4 full blocks, all loaded by the decode side;
    # 50 tokens: it computes 47, of which 2 full blocks (32 tokens) are shipped.
    prompts = [random_prompt(67, 1), random_prompt(50, 2)]
    expected_hashes: set[str] = set()
    loaded = 0
    for prompt in prompts:
        hits = pd_mesh.metric("scheduler-decode", "meshllm:external_prefix_cache_hits_total")
        resp = client.completions.create(
            model=model, prompt=prompt, max_tokens=8, temperature=0, extra_body={"min_tokens": 8}
        )
        assert resp.usage is not None and resp.usage.completion_tokens == 8
        expected = reference_greedy(reference, prompt, 8, min_tokens=8)
        assert resp.choices[0].text == tokenizer.decode(expected)
        shipped = (len(prompt) - LOOKAHEAD) // BLOCK * BLOCK
        got = pd_mesh.metric("scheduler-decode", "meshllm:external_prefix_cache_hits_total")
        assert got - hits == shipped  # the decode group loaded the whole stored prefix
        loaded += shipped
        expected_hashes |= block_hashes(prompt[: len(prompt) - LOOKAHEAD])
    # Exactly the full blocks of the first prompt_len - N tokens of each prompt, no more.
    assert stored_hashes(pd_mesh) == expected_hashes
    prefill = pd_mesh.admin_state("scheduler-prefill")
    assert prefill["role"] == "prefill" and prefill["prefill"]["handed_off"] == len(prompts)
    decode = pd_mesh.admin_state("scheduler-decode")
    assert decode["role"] == "decode" and decode["kv_offload"]["stats"]["external_hit_tokens"] == (
        loaded
    )
