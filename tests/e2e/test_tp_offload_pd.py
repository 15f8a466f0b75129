"""KV offload and prefill/decode disaggregation with tensor-parallel worker groups, end to end:
a prefill group and a decode group (tests.e2e.test_pd_disaggregation.PDMesh), each worker
running two CPU ranks (MESHLLM_TP=2, gloo) of a tiny random-weight Llama whose 2 KV heads split
one per rank, with MESHLLM_KV_OFFLOAD on, on a real Redis with the kvstore.

The prefill group stores through its ranks' gathered heads, the decode group loads through
rank 0's reads scattered to both ranks. A first prompt, then a second sharing a long prefix
with it: each is answered with transformers' greedy tokens, and the decode group loaded every
block the prefill side shipped that it did not hold already (its external prefix hits: all of
the first prompt's, the second's past the shared blocks, which its own prefix cache holds).
Stored payloads have the one full-head layout (every KV head in the header), which any TP size
reads (tests/integration/worker/test_kv_offload_tp.py loads across TP sizes).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import redis
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from services.worker.kv_offload.payload import read_header
from tests.e2e.conftest import E2E_ENV
from tests.e2e.test_pd_disaggregation import PDMesh
from tests.support.tiny_llama import (
    copy_tokenizer,
    make_tiny_llama,
    random_prompt,
    reference_greedy,
)

LOOKAHEAD = 3
BLOCK = 16
KV_HEADS = 2
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama-tp-pd")
    make_tiny_llama(
        out,
        seed=11,
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=512,
    )
    copy_tokenizer(smollm2_dir, out)
    return out


@pytest.fixture(scope="module")
def tp_pd_mesh(model_dir: Path) -> Iterator[PDMesh]:
    env = {
        **E2E_ENV,
        "MESHLLM_MODEL": str(model_dir),
        "MESHLLM_DTYPE": "float32",
        "MESHLLM_MAX_MODEL_LEN": "512",
        "MESHLLM_BLOCK_SIZE": str(BLOCK),
        "MESHLLM_PREFILL_LOOKAHEAD_TOKENS": str(LOOKAHEAD),
        "MESHLLM_HEARTBEAT_INTERVAL_S": "0.5",
        "MESHLLM_KV_OFFLOAD": "true",
        "MESHLLM_TP": "2",
        "MESHLLM_TP_TIMEOUT_S": "60",
    }
    with PDMesh(env) as mesh:
        yield mesh


def test_tp2_prefill_and_decode_groups_move_kv_through_the_tier(
    tp_pd_mesh: PDMesh, model_dir: Path
) -> None:
    for role in ("prefill", "decode"):
        state = tp_pd_mesh.admin_state(f"worker-{role}")
        assert state["tp"] == 2 and len(state["rank_pids"]) == 1
    client = openai.OpenAI(base_url=tp_pd_mesh.api, api_key="x", max_retries=0, timeout=180)
    model = client.models.list().data[0].id
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    reference = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    first = random_prompt(70, 5)
    shared = 64  # 4 blocks: the decode group still caches them from the first request
    second = first[:shared] + random_prompt(20, 6)
    loaded = 0
    for prompt, cached in ((first, 0), (second, shared)):
        hits = tp_pd_mesh.metric("scheduler-decode", "meshllm:external_prefix_cache_hits_total")
        resp = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"min_tokens": MAX_TOKENS},
        )
        expected = reference_greedy(reference, prompt, MAX_TOKENS, min_tokens=MAX_TOKENS)
        assert resp.choices[0].text == tokenizer.decode(expected)
        shipped = (len(prompt) - LOOKAHEAD) // BLOCK * BLOCK
        got = tp_pd_mesh.metric("scheduler-decode", "meshllm:external_prefix_cache_hits_total")
        # The decode group loaded every shipped block it did not hold: nothing recomputed.
        assert got - hits == shipped - cached > 0
        loaded += shipped - cached
    decode = tp_pd_mesh.admin_state("scheduler-decode")
    assert decode["kv_offload"]["stats"]["external_hit_tokens"] == loaded > 0
    # The payloads hold every KV head (TP=1's layout), not one rank's.
    r = redis.Redis.from_url(tp_pd_mesh.redis.url)
    keys = list(r.scan_iter(f"meshllm:{tp_pd_mesh.cluster}:kv:*", count=1000))
    assert keys
    for key in keys:
        payload = r.get(key)
        assert payload is not None
        header, _ = read_header(payload)
        assert header.shape[3] == KV_HEADS
    r.close()
