"""P/D for a hybrid attention + Mamba2 model end to end: a tiny random-weight Bamba (layers
mamba / attention / mamba) with SmolLM2's tokenizer, served by a prefill group and a decode
group (tests.e2e.test_pd_disaggregation.PDMesh) on a real Redis, then by one plain group
(role "both") for comparison.

"Transferable is not storable": the prefill side stores the attention blocks of what it
computed and the state block at the (block-aligned) end of each offer; the decode side loads
the attention blocks of its hit and the one state block ending at it, then computes the rest.
Checked: greedy text equals transformers' fp32 generate and the plain group's text; the decode
scheduler's external hit metric counts the whole handed-over prefix; the state group's chunks
in Redis are block ends of what the prefill side computed.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import redis
import torch
from transformers import AutoTokenizer, BambaForCausalLM

from shared.kv.block_hash import extend_block_hashes
from tests.e2e.conftest import E2E_ENV
from tests.e2e.hybrid_bamba import make_bamba_model
from tests.e2e.test_pd_disaggregation import PDMesh
from tests.support.mesh import Mesh
from tests.support.tiny_llama import random_prompt, reference_greedy

BLOCK = 16
LOOKAHEAD = 3
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def model_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_bamba_model(tmp_path_factory, smollm2_dir, "tiny-bamba-pd")


def env_for(model_dir: Path) -> dict[str, str]:
    return {
        **E2E_ENV,
        "MESHLLM_MODEL": str(model_dir),
        "MESHLLM_MAX_MODEL_LEN": "512",
        "MESHLLM_BLOCK_SIZE": str(BLOCK),
        "MESHLLM_PREFILL_LOOKAHEAD_TOKENS": str(LOOKAHEAD),
        "MESHLLM_HEARTBEAT_INTERVAL_S": "0.5",
        "MESHLLM_KV_OFFLOAD": "true",
    }


def complete(mesh: Mesh, prompt: list[int]) -> str:
    client = openai.OpenAI(base_url=mesh.api, api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    resp = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"min_tokens": MAX_TOKENS},
    )
    assert resp.usage is not None and resp.usage.completion_tokens == MAX_TOKENS
    return resp.choices[0].text


def stored_keys(mesh: Mesh) -> dict[str, set[str]]:
    """group -> block hashes (hex) of the KV payload keys in Redis."""
    r = redis.Redis.from_url(mesh.redis.url, decode_responses=True)
    prefix = f"meshllm:{mesh.cluster}:kv:"
    keys = list(r.scan_iter(prefix + "*", count=1000))
    r.close()
    out: dict[str, set[str]] = {}
    for key in keys:
        out.setdefault(key.rsplit(":", 2)[-2], set()).add(key.rsplit(":", 1)[1])
    return out


def test_pd_on_a_hybrid_equals_transformers_and_a_plain_run(model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    reference = BambaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # 67 tokens: the prefill side computes 64 = 4 full blocks, the state after them included;
    # 50: it computes 47, so 2 full blocks (32 tokens) and the state at 32 are handed over.
    prompts = [random_prompt(67, 1), random_prompt(50, 2)]
    wanted = [
        tokenizer.decode(reference_greedy(reference, p, MAX_TOKENS, min_tokens=MAX_TOKENS))
        for p in prompts
    ]
    pd_texts = []
    with PDMesh(env_for(model_dir)) as mesh:
        loaded = 0
        for prompt in prompts:
            metric = "meshllm:external_prefix_cache_hits_total"
            hits = mesh.metric("scheduler-decode", metric)
            pd_texts.append(complete(mesh, prompt))
            shipped = (len(prompt) - LOOKAHEAD) // BLOCK * BLOCK
            assert mesh.metric("scheduler-decode", metric) - hits == shipped > 0
            loaded += shipped
        decode = mesh.admin_state("scheduler-decode")
        assert decode["kv_offload"]["stats"]["external_hit_tokens"] == loaded
        prefill = mesh.admin_state("scheduler-prefill")
        assert prefill["prefill"]["handed_off"] == len(prompts)
        stored = stored_keys(mesh)
    assert pd_texts == wanted
    attention: set[str] = set()
    ends: set[str] = set()
    for prompt in prompts:
        hashes: list[bytes] = []
        extend_block_hashes(hashes, prompt[: len(prompt) - LOOKAHEAD], BLOCK)
        attention |= {h.hex() for h in hashes}
        ends.add(hashes[-1].hex())
    assert stored["0"] == attention
    assert ends <= stored["1"] <= attention  # state chunks: block ends of the computed part
    plain_env = {**env_for(model_dir), "MESHLLM_PREFILL_LOOKAHEAD_TOKENS": "0"}
    with Mesh(services=("gateway", "scheduler", "worker", "kvstore"), env=plain_env) as plain:
        plain_texts = [complete(plain, p) for p in prompts]
    assert plain_texts == pd_texts
