"""A mesh started on a non-Llama model with one setting (MESHLLM_MODEL=<dir>): a tiny
random-weight Qwen2-MoE with interleaved sliding-window / full-attention layers, so one mesh
covers MoE routing, two KV cache groups (one sliding window) and routed experts end to end.

Checked through the real `openai` client against transformers' implementation of the same
weights: greedy text for a prompt longer than the window; routed experts (extra_body) equal to
the router's top-k of a reference forward at every MoE layer and returned position; the offset
boundary (-1 and prompt_len + 1 -> 400, prompt_len -> zero prompt rows); the mesh serving on.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from transformers import AutoTokenizer, Qwen2MoeConfig, Qwen2MoeForCausalLM

from tests.e2e.conftest import E2E_ENV
from tests.support.mesh import Mesh
from tests.support.tiny_llama import copy_tokenizer, random_prompt, reference_greedy

WINDOW = 16
TOP_K = 2
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


@pytest.fixture(scope="module")
def model_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Saved with save_pretrained; SmolLM2's tokenizer (vocab 49152 = the model's vocab)."""
    out = tmp_path_factory.mktemp("tiny-qwen2-moe")
    torch.manual_seed(0)
    config = Qwen2MoeConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=False,
        use_sliding_window=True,
        sliding_window=WINDOW,
        layer_types=LAYER_TYPES,
        max_position_embeddings=512,
        initializer_range=0.15,  # peaked logits and router scores: no near-ties
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    Qwen2MoeForCausalLM(config).eval().save_pretrained(out)
    copy_tokenizer(smollm2_dir, out)
    return out


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Qwen2MoeForCausalLM:
    return Qwen2MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def mesh(model_dir: Path) -> Iterator[Mesh]:
    env = {**E2E_ENV, "MESHLLM_MODEL": str(model_dir), "MESHLLM_MAX_MODEL_LEN": "512"}
    with Mesh(env=env) as m:
        yield m


def greedy(model: Qwen2MoeForCausalLM, prompt: list[int], max_tokens: int) -> list[int]:
    """Exactly `max_tokens` greedy tokens of the reference (the requests set min_tokens)."""
    return reference_greedy(model, prompt, max_tokens, min_tokens=max_tokens)


def router_top_k(model: Qwen2MoeForCausalLM, tokens: list[int]) -> list[list[list[int]]]:
    """[position][moe layer] -> the router's top-k expert ids, from one full forward."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens]), output_router_logits=True).router_logits
    top = [layer.topk(TOP_K, dim=-1).indices for layer in logits]  # each [positions, top_k]
    return [[layer[p].tolist() for layer in top] for p in range(len(tokens))]


def complete(client: openai.OpenAI, model: str, prompt: list[int], **extra: Any) -> Any:
    return client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=6,
        temperature=0,
        extra_body={"min_tokens": 6, **extra},
    )


def test_greedy_text_beyond_the_window_equals_transformers(
    client: openai.OpenAI, model_name: str, model_dir: Path, reference: Qwen2MoeForCausalLM
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = random_prompt(3 * WINDOW + 5, 1)  # the sliding layers see only the last 16
    resp = client.completions.create(
        model=model_name, prompt=prompt, max_tokens=16, temperature=0, extra_body={"min_tokens": 16}
    )
    assert resp.usage is not None and resp.usage.completion_tokens == 16
    assert resp.choices[0].text == tokenizer.decode(greedy(reference, prompt, 16))


@pytest.mark.parametrize("start", [0, 7])
def test_routed_experts_equal_the_reference_router(
    client: openai.OpenAI, model_name: str, reference: Qwen2MoeForCausalLM, start: int
) -> None:
    prompt = random_prompt(WINDOW + 9, 3)
    resp = complete(
        client, model_name, prompt, return_routed_experts=True, routed_experts_prompt_start=start
    )
    rows = resp.choices[0].model_extra["routed_experts"]
    output = greedy(reference, prompt, 6)
    top = router_top_k(reference, prompt + output)
    # Prompt positions from `start`, then output token i's row: the forward that sampled it,
    # at position prompt_len - 1 + i.
    positions = [*range(start, len(prompt)), *(len(prompt) - 1 + i for i in range(6))]
    assert len(rows) == len(positions)
    assert rows == [top[p] for p in positions]


def test_offset_boundaries_then_the_mesh_keeps_serving(
    client: openai.OpenAI, model_name: str, reference: Qwen2MoeForCausalLM
) -> None:
    prompt = random_prompt(11, 4)
    for bad in (-1, len(prompt) + 1):
        with pytest.raises(openai.BadRequestError) as err:
            complete(
                client,
                model_name,
                prompt,
                return_routed_experts=True,
                routed_experts_prompt_start=bad,
            )
        assert "routed_experts_prompt_start" in str(err.value)
    resp = complete(
        client,
        model_name,
        prompt,
        return_routed_experts=True,
        routed_experts_prompt_start=len(prompt),
    )
    rows = resp.choices[0].model_extra["routed_experts"]
    top = router_top_k(reference, prompt + greedy(reference, prompt, 6))
    assert rows == [top[len(prompt) - 1 + i] for i in range(6)]  # zero prompt rows
    plain = complete(client, model_name, prompt)
    assert plain.usage is not None and plain.usage.completion_tokens == 6
    assert "routed_experts" not in (plain.choices[0].model_extra or {})
