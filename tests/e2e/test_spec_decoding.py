"""n-gram speculative decoding through the real mesh (MESHLLM_SPEC_METHOD=ngram): greedy chat
completions equal the in-process engine's greedy output without speculation, two requests in
flight together, and the scheduler's spec-decode metrics show drafts accepted."""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch

from services.worker.loader import load_model
from shared.protocol import SamplingParams
from tests.e2e.conftest import E2E_ENV
from tests.support.engine import InProcessEngine
from tests.support.mesh import Mesh

MAX_TOKENS = 24
QUESTIONS = [
    "Repeat this sentence exactly: the cat sat on the warm mat next to the door.",
    "What is the capital of France?",
]


@pytest.fixture(scope="module")
def spec_mesh(smollm2_dir: Path) -> Iterator[Mesh]:
    env = {**E2E_ENV, "MESHLLM_SPEC_METHOD": "ngram", "MESHLLM_SPEC_TOKENS": "4"}
    with Mesh(env=env) as m:
        yield m


@pytest.fixture(scope="module")
def expected(smollm2_dir: Path) -> list[str]:
    """Greedy text of each question from the engine without speculation."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    engine = InProcessEngine(smollm2_dir, model_and_config=load_model(smollm2_dir, torch.float32))
    prompts = {}
    for i, text in enumerate(QUESTIONS):
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        prompts[str(i)] = tokenizer(chat, add_special_tokens=False)["input_ids"]
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return [
        tokenizer.decode(out[str(i)].token_ids, skip_special_tokens=True)
        for i in range(len(QUESTIONS))
    ]


def test_greedy_through_the_mesh_equals_no_speculation(spec_mesh: Mesh, expected: list[str]):
    client = openai.OpenAI(base_url=spec_mesh.api, api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id

    def ask(question: str) -> str:
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": question}],
            temperature=0.0,
            max_tokens=MAX_TOKENS,
        )
        return reply.choices[0].message.content or ""

    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        answers = list(pool.map(ask, QUESTIONS))
    assert answers == expected

    metrics = httpx.get(f"{spec_mesh.url('scheduler')}/metrics", timeout=10).text
    found = re.search(r"^meshllm:spec_decode_num_accepted_tokens_total (\S+)$", metrics, re.M)
    assert found is not None and float(found.group(1)) > 0, "no draft was accepted"
