"""Speculative decoding through the real mesh, one mesh per method (MESHLLM_SPEC_METHOD=ngram,
draft, eagle, eagle3, mtp, dflash), SmolLM2 as the target and drafters saved as checkpoints in a
tmp dir in the formats their users have (tests/support/spec_heads.py): SmolLM2's first two
layers as a draft model, a near-identity EAGLE head, an EAGLE-3 head in speculators' format, an
MTP module appended to a copy of SmolLM2's checkpoint (the mesh then serves that copy), and a
random DFlash draft in z-lab's layout.

Per mesh: greedy chat completions, two in flight together, equal the in-process engine's
greedy output without speculation; a seeded sampled request gives the same text alone and
batched with another request; the scheduler's vLLM-named spec-decode metrics count verified
drafts (and, for the copying n-gram drafts, accepted ones per position).
"""

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
from tests.support.spec_heads import (
    write_dflash_draft,
    write_eagle3_head,
    write_eagle_head,
    write_mtp_target,
    write_truncated_model,
)

MAX_TOKENS = 16
QUESTIONS = [
    "Repeat this sentence exactly: the cat sat on the warm mat next to the door.",
    "What is the capital of France?",
]
METHODS = ["ngram", "ngram-chained", "draft", "eagle", "eagle3", "mtp", "dflash"]


@pytest.fixture(scope="module")
def drafter_env(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Per method: the environment its mesh adds to E2E_ENV."""
    root = tmp_path_factory.mktemp("e2e_drafters")
    draft = write_truncated_model(smollm2_dir, root / "draft", num_layers=2)
    eagle = write_eagle_head(smollm2_dir, root / "eagle", identity=True)
    eagle3 = write_eagle3_head(smollm2_dir, root / "eagle3", speculators=True, identity=True)
    mtp = write_mtp_target(smollm2_dir, root / "mtp", identity=True)
    dflash = write_dflash_draft(smollm2_dir, root / "dflash", block_size=5)
    return {
        "ngram": {},
        # verify steps chained on the device (services/worker/spec/chain.py), overlapped as on
        # a GPU: on the CPU both are off unless asked for
        "ngram-chained": {"MESHLLM_OVERLAP_STEPS": "on", "MESHLLM_SPEC_DEVICE_CHAIN": "on"},
        "draft": {"MESHLLM_SPEC_MODEL": str(draft)},
        "eagle": {"MESHLLM_SPEC_MODEL": str(eagle)},
        "eagle3": {"MESHLLM_SPEC_MODEL": str(eagle3)},
        "mtp": {"MESHLLM_MODEL": str(mtp)},  # the MTP module ships in the served checkpoint
        "dflash": {"MESHLLM_SPEC_MODEL": str(dflash)},
    }


@pytest.fixture(scope="module", params=METHODS)
def spec_mesh(request: pytest.FixtureRequest, drafter_env) -> Iterator[tuple[str, Mesh]]:
    method = request.param
    env = {
        **E2E_ENV,
        "MESHLLM_SPEC_METHOD": method.removesuffix("-chained"),
        "MESHLLM_SPEC_TOKENS": "4",
        **drafter_env[method],
    }
    with Mesh(env=env) as mesh:
        yield method, mesh


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


def metric(text: str, name: str, **labels: str) -> float:
    label = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = rf"^{re.escape(name)}{re.escape('{' + label + '}') if label else ''} (\S+)$"
    found = re.search(pattern, text, re.M)
    return float(found.group(1)) if found else 0.0


def test_each_method_through_the_mesh(spec_mesh: tuple[str, Mesh], expected: list[str]) -> None:
    method, mesh = spec_mesh
    client = openai.OpenAI(base_url=mesh.api, api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id

    def ask(question: str, **params: object) -> str:
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": question}],
            max_tokens=MAX_TOKENS,
            **params,  # type: ignore[arg-type]
        )
        return reply.choices[0].message.content or ""

    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        answers = list(pool.map(lambda q: ask(q, temperature=0.0), QUESTIONS))
    assert answers == expected, method

    seeded = {"temperature": 0.8, "seed": 11}
    alone = ask(QUESTIONS[1], **seeded)
    with ThreadPoolExecutor(2) as pool:
        batched = pool.submit(ask, QUESTIONS[1], **seeded)
        pool.submit(ask, QUESTIONS[0], temperature=1.0, seed=5).result()
        assert batched.result() == alone, method

    metrics = httpx.get(f"{mesh.url('scheduler')}/metrics", timeout=10).text
    assert metric(metrics, "meshllm:spec_decode_num_draft_tokens_total") > 0, method
    assert metric(metrics, "meshllm:spec_decode_num_drafts_total") > 0, method
    if method.startswith("ngram"):  # copying drafts: accepted, counted per position
        accepted = metric(metrics, "meshllm:spec_decode_num_accepted_tokens_total")
        first = metric(
            metrics, "meshllm:spec_decode_num_accepted_tokens_per_pos_total", position="0"
        )
        assert accepted > 0 and first > 0
    if method == "ngram-chained":
        worker = httpx.get(f"{mesh.url('worker')}/metrics", timeout=10).text
        assert metric(worker, "meshllm:worker_spec_chained_steps_total") > 0
