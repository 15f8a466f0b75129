"""vLLM's `priority` through the real mesh, with the scheduler's `priority` policy and room for
one running request: requests queued behind a running one start in priority order, whatever
order they arrived in; the default `fcfs` policy refuses a priority other than 0 with a 400."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.e2e.conftest import E2E_ENV
from tests.support.mesh import Mesh

pytestmark = pytest.mark.e2e

ENV = {**E2E_ENV, "MESHLLM_SCHEDULING_POLICY": "priority", "MESHLLM_MAX_NUM_SEQS": "1"}


@pytest.fixture(scope="module")
def mesh(smollm2_dir: Path) -> Iterator[Mesh]:
    with Mesh(env=ENV) as m:
        yield m


async def _first_token_at(client: openai.AsyncOpenAI, model: str, priority: int) -> float:
    stream = await client.completions.create(
        model=model, prompt=f"Count to ten, take {priority}:", max_tokens=4, stream=True,
        extra_body={"priority": priority, "ignore_eos": True},
    )  # fmt: skip
    first = 0.0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text and not first:
            first = time.monotonic()
    return first


def test_queued_requests_start_by_priority(mesh: Mesh) -> None:
    async def run() -> dict[int, float]:
        client = openai.AsyncOpenAI(base_url=mesh.api, api_key="unused", max_retries=0)
        model = (await client.models.list()).data[0].id
        running = await client.completions.create(
            model=model, prompt="Once upon a time", max_tokens=200, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        await anext(aiter(running))  # it holds the only running slot from here on
        queued = {}
        for priority in (5, 0, -3, 9, 1):  # arrival order
            queued[priority] = asyncio.create_task(_first_token_at(client, model, priority))
            await asyncio.sleep(0.05)
        async for _ in running:
            pass
        return {p: await task for p, task in queued.items()}

    started = asyncio.run(run())
    assert sorted(started, key=started.__getitem__) == sorted(started)


def test_fcfs_refuses_a_priority(smollm2_dir: Path) -> None:
    with Mesh(env=E2E_ENV) as fcfs:
        client = openai.OpenAI(base_url=fcfs.api, api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        for stream in (False, True):  # a stream too: a 400, not a 200 with an error event
            with pytest.raises(openai.BadRequestError, match="priority scheduling is not enabled"):
                client.completions.create(
                    model=model, prompt="Hi", max_tokens=2, stream=stream,
                    extra_body={"priority": 1},
                )  # fmt: skip
        ok = client.completions.create(
            model=model, prompt="Hi", max_tokens=2, extra_body={"priority": 0}
        )
        assert ok.choices[0].finish_reason == "length"
