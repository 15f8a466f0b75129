"""P/D together with n-gram speculative decoding on a sliding-window model.

A tiny random-weight Gemma-3-style model (layers sliding / full / sliding, window 16, block
16) served by a prefill group and a decode group (tests.e2e.test_pd_disaggregation.PDMesh),
both with n-gram drafts (K = 4). The one lookahead number is 0 for an n-gram drafter (it
reads no target features), so the prefill side computes prompt_len - 1 tokens and a sliding
group retains nothing extra. Checked: greedy output equals transformers' (what the engine
without P/D is held to); the KV keys in Redis are exactly the verified prompt blocks the
prefill side computed, all of them for the full-attention group and only the window's chunk
for the sliding group (nothing of a draft, nothing from the decode side).

Not covered yet: in this run the decode side verified no drafts
(meshllm:spec_decode_num_draft_tokens_total stayed 0 although the greedy output repeats one
token), so this checks P/D under the n-gram configuration, not draft verification under P/D.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import redis
import torch
from transformers import AutoTokenizer, Gemma3ForCausalLM

from shared.kv.block_hash import extend_block_hashes
from tests.e2e.swa_gemma3 import BLOCK, make_swa_model, swa_env
from tests.e2e.test_pd_disaggregation import PDMesh
from tests.support.tiny_llama import random_prompt, reference_greedy

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_swa_model(smollm2_dir, tmp_path_factory, "tiny-gemma3-pd-spec")


@pytest.fixture(scope="module")
def pd_mesh(model_dir: Path) -> Iterator[PDMesh]:
    env = swa_env(model_dir, MESHLLM_SPEC_METHOD="ngram", MESHLLM_SPEC_TOKENS="4")
    with PDMesh(env) as mesh:
        yield mesh


def stored_keys(mesh: PDMesh) -> set[tuple[str, str]]:
    """(group, block hash hex) of every KV payload key in Redis."""
    r = redis.Redis.from_url(mesh.redis.url, decode_responses=True)
    prefix = f"meshllm:{mesh.cluster}:kv:"
    keys = list(r.scan_iter(prefix + "*", count=1000))
    r.close()
    return {(k.rsplit(":", 2)[-2], k.rsplit(":", 1)[1]) for k in keys}


def test_pd_with_ngram_drafts_on_a_sliding_window_model(pd_mesh: PDMesh, model_dir: Path) -> None:
    client = openai.OpenAI(base_url=pd_mesh.api, api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    reference = Gemma3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # A repetitive prompt, so the n-gram drafter proposes drafts; 5 * 16 + 7 = 87 tokens: the
    # prefill side computes 86 = 5 full blocks.
    base = random_prompt(29, 4)
    prompt = (base * 3)[: 5 * BLOCK + 7]
    resp = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"min_tokens": MAX_TOKENS},
    )
    expected = reference_greedy(reference, prompt, MAX_TOKENS, min_tokens=MAX_TOKENS)
    assert resp.choices[0].text == tokenizer.decode(expected)
    decode = pd_mesh.admin_state("scheduler-decode")
    assert decode["kv_offload"]["stats"]["external_hit_tokens"] == 5 * BLOCK
    prefill = pd_mesh.admin_state("scheduler-prefill")
    assert prefill["prefill"]["lookahead"] == 0 and prefill["prefill"]["handed_off"] == 1
    hashes: list[bytes] = []
    extend_block_hashes(hashes, prompt[: len(prompt) - 1], BLOCK)
    assert len(hashes) == 5
    got = stored_keys(pd_mesh)
    by_group: dict[str, set[str]] = {}
    for group, h in got:
        by_group.setdefault(group, set()).add(h)
    full = {h.hex() for h in hashes}
    window = {hashes[-1].hex()}  # coverage max(cdiv(16, 16), cdiv(15, 16)) = 1 chunk
    assert sorted(by_group.values(), key=len) == [window, full]
