"""The planning pool: small bodies planned inline, large ones in worker processes, with the
same plans and the same errors either way; a worker that dies costs its request a clean 500,
and the next request is planned by a fresh pool."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import pickle
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from services.gateway.api.errors import OpenAIError
from services.gateway.plan.model_info import ModelInfo
from services.gateway.plan.planner import Planner
from services.gateway.plan.planning_pool import INLINE_BELOW_BYTES, PlanningPool, tokenizer_payload
from services.gateway.plan.tokenization import PromptTokenizer
from shared.config import GatewaySettings

pytestmark = pytest.mark.timeout(300)
PLANNING = "meshllm:gateway_requests_planning"


@pytest.fixture(scope="module")
def pool(tokenizer: PromptTokenizer, smollm2_dir: Path) -> Iterator[PlanningPool]:
    settings = GatewaySettings(model=str(smollm2_dir), served_model_name="smol")
    model = ModelInfo.from_hf_dir("smol", smollm2_dir, 4096)
    planning = PlanningPool(Planner(tokenizer, model, settings), processes=1)
    yield planning
    planning.close()


def completion(prompt: str, **fields: object) -> bytes:
    return json.dumps({"prompt": prompt, "max_tokens": 4, **fields}).encode()


async def test_large_bodies_are_planned_in_a_process_like_small_ones_inline(
    pool: PlanningPool,
) -> None:
    small = completion("Once upon a time " * 10)
    large = completion("Once upon a time " * 10, pad="x" * INLINE_BELOW_BYTES)
    assert len(small) < INLINE_BELOW_BYTES <= len(large)
    inline = await pool.run("completion", small)
    remote = await pool.run("completion", large)
    assert remote.prompts == inline.prompts and remote.samplings == inline.samplings
    tokenized = json.loads(await pool.run("tokenize", large))
    assert tokenized["tokens"] == inline.prompts[0].token_ids


async def test_a_large_responses_body_is_planned_in_a_process(pool: PlanningPool) -> None:
    """The Responses API's body is parsed and translated where its chat plan is made: off the
    event loop when it is large, with a 400 naming the Responses field either way."""

    def body(**fields: object) -> bytes:
        return json.dumps(
            {"input": "Once upon a time", "instructions": "Be brief.", **fields}
        ).encode()

    small, large = (
        body(max_output_tokens=4),
        body(max_output_tokens=4, pad="x" * INLINE_BELOW_BYTES),
    )
    assert len(small) < INLINE_BELOW_BYTES <= len(large)
    inline_plan, inline_req = await pool.run("responses", small)
    remote_plan, remote_req = await pool.run("responses", large)
    assert remote_plan.prompts == inline_plan.prompts
    assert remote_req.instructions == inline_req.instructions == "Be brief."
    assert remote_plan.samplings[0].max_tokens == 4
    with pytest.raises(OpenAIError) as err:
        await pool.run("responses", body(max_output_tokens=10**6, pad="x" * INLINE_BELOW_BYTES))
    assert err.value.status == 400 and err.value.param == "max_output_tokens"


async def test_errors_cross_back_intact(pool: PlanningPool) -> None:
    large = completion("Hi", pad="x" * INLINE_BELOW_BYTES, n=0)
    with pytest.raises(OpenAIError) as err:
        await pool.run("completion", large)
    assert err.value.status == 400 and err.value.param == "n"
    assert err.value.body()["error"]["type"] == "invalid_request_error"


async def test_a_worker_dying_mid_plan_costs_that_request_a_500_only(pool: PlanningPool) -> None:
    await pool.run("completion", completion("warm", pad="x" * INLINE_BELOW_BYTES))
    workers = multiprocessing.active_children()
    assert workers
    huge = completion("The quick brown fox jumps over the lazy dog. " * 200_000)  # seconds
    planning = asyncio.create_task(pool.run("completion", huge))
    async with asyncio.timeout(60):
        while (REGISTRY.get_sample_value(PLANNING) or 0) < 1:  # submitted to the pool
            await asyncio.sleep(0.01)
    for worker in workers:
        os.kill(worker.pid or 0, signal.SIGKILL)
    with pytest.raises(OpenAIError) as err:
        await planning
    assert err.value.status == 500 and err.value.type == "internal_server_error"
    plan = await pool.run("completion", completion("again", pad="x" * INLINE_BELOW_BYTES))
    assert plan.prompts[0].text == "again"


def test_processes_are_sent_the_tokenizers_directory_not_its_pickle(
    tokenizer: PromptTokenizer, smollm2_dir: Path
) -> None:
    """What starts each process must fit a pipe's buffer (64 KiB): a larger write blocks the
    gateway's event loop until the new process has done its imports and read it."""
    settings = GatewaySettings(model=str(smollm2_dir), served_model_name="smol")
    model = ModelInfo.from_hf_dir("smol", smollm2_dir, 4096)
    assert tokenizer_payload(tokenizer) == smollm2_dir
    assert len(pickle.dumps((tokenizer_payload(tokenizer), model, settings, 1))) < 2**16
    assert len(pickle.dumps(tokenizer.hf)) > 2**16  # what was sent before


async def test_a_tokenizer_without_a_directory_is_sent_whole(
    tokenizer: PromptTokenizer, smollm2_dir: Path
) -> None:
    settings = GatewaySettings(model=str(smollm2_dir), served_model_name="smol")
    model = ModelInfo.from_hf_dir("smol", smollm2_dir, 4096)
    built = PromptTokenizer(tokenizer.hf)  # no source directory
    assert tokenizer_payload(built) is tokenizer.hf
    planning = PlanningPool(Planner(built, model, settings), processes=1)
    try:
        large = completion("Once upon a time", pad="x" * INLINE_BELOW_BYTES)
        remote = await planning.run("completion", large)
        assert remote.prompts[0].token_ids == tokenizer.encode("Once upon a time")
    finally:
        planning.close()
