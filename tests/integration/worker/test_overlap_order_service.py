"""The worker service with overlapped steps, in-process against a real Redis: a plan that
arrives after the step in flight has finished on the device answers that step before it
launches (its result reaches the scheduler a launch sooner), and results stay in step order.
The order is read from the worker's step timeline (MESHLLM_STEP_TIMELINE)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from services.worker.service import WorkerService
from shared.bus import Bus
from shared.protocol import (
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    StepPlan,
    StepResult,
    WorkerReady,
)
from shared.service import bind_socket, serve
from shared.streams import Streams
from tests.integration.worker.service_support import (
    PROMPT,
    next_message,
    tiny_worker_settings,
)
from tests.support.tiny_llama import make_tiny_llama

STREAMS = Streams("ovsvc")


def plans(incarnation: str) -> list[StepPlan]:
    """A prefill of request a, then two decodes (their input tokens fed forward)."""
    first = StepPlan(
        step_id=0,
        scheduler_id="s",
        worker_incarnation=incarnation,
        new_requests=[
            NewRequestData(
                request_id="a",
                token_ids=PROMPT,
                num_prompt_tokens=len(PROMPT),
                block_ids=[[1, 2, 3, 4, 5]],
                num_computed_tokens=0,
                sampling=SamplingParams(temperature=0.0, max_tokens=8),
            )
        ],
        num_scheduled_tokens={"a": len(PROMPT)},
    )
    decodes = [
        StepPlan(
            step_id=i,
            scheduler_id="s",
            worker_incarnation=incarnation,
            cached_requests=[
                CachedRequestData(
                    request_id="a", new_block_ids=[[]], num_computed_tokens=len(PROMPT) + i - 1
                )
            ],
            num_scheduled_tokens={"a": 1},
        )
        for i in (1, 2)
    ]
    return [first, *decodes]


async def test_landed_step_is_answered_before_the_next_launch(
    tmp_path: Path, redis_url: str
) -> None:
    make_tiny_llama(tmp_path / "tiny", seed=5)
    timeline = tmp_path / "timeline.jsonl"
    settings = tiny_worker_settings(
        tmp_path / "tiny", redis_url, "ovsvc", "w-ov",
        overlap_steps="on",  # on CPU a launched step has landed by the time launch returns
        step_timeline=str(timeline), kv_offload=False,
    )  # fmt: skip
    service = WorkerService(settings)
    shutdown = asyncio.Event()
    task = asyncio.create_task(serve(service, sock=bind_socket("127.0.0.1", 0), shutdown=shutdown))
    bus = Bus(redis_url, "test")
    await bus.connect()
    try:
        ready = await next_message(bus, {STREAMS.control("0"): "0"}, WorkerReady)
        assert isinstance(ready, WorkerReady)
        await bus.publish_many([(STREAMS.steps("0"), p) for p in plans(ready.incarnation)])
        results = {STREAMS.results("0"): "0"}
        got = [await next_message(bus, results, StepResult) for _ in range(3)]
        assert [r.step_id for r in got] == [0, 1, 2]  # type: ignore[attr-defined]
        assert all(r.error is None and len(r.sampled) == 1 for r in got)  # type: ignore[attr-defined]
    finally:
        shutdown.set()
        assert await asyncio.wait_for(task, 60) == 0
        await bus.close()
    rows = {r["step"]: r for r in map(json.loads, timeline.read_text().splitlines())}
    # Step N was answered (its result built) before step N+1 was launched.
    assert rows[0]["finished"] <= rows[1]["launch"]
    assert rows[1]["finished"] <= rows[2]["launch"]
