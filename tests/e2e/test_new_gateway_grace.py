"""A gateway that has just started may publish its first requests before the scheduler has read
its first heartbeat. The scheduler, up for longer than the gateway silence bound, must not take
it for dead: its silence counts from the first time the scheduler held a request of it, not
from the scheduler's start (services/scheduler/gateway_watch.py).

Before that rule a new reply stream was silent "since the scheduler started", so the first
orphan check after the request arrived aborted it: with an error delta when tokens had already
been written, or with nothing at all when the reply stream did not exist yet (a client waiting
for ever; seen in a GPU benchmark as "1 of 256 requests unfinished" and reproduced on the CPU
with a bench client that starts beating as it submits).

Real Redis, scheduler and worker processes (SmolLM2), the client on the bus as a gateway is.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from shared.bus import Bus
from shared.heartbeat import Heartbeater
from shared.protocol import SamplingParams, SubmitRequest, TokenDelta
from shared.streams import Streams
from tests.e2e.conftest import E2E_ENV
from tests.support.mesh import Mesh

pytestmark = pytest.mark.e2e

GATEWAY_TIMEOUT_S = 4.0
FIRST_BEAT_AFTER_S = 2.0  # under the bound, after the scheduler's first orphan checks
MAX_TOKENS = 64


async def _always_ready() -> bool:
    return True


async def serve_one(mesh: Mesh) -> tuple[list[int], str | None, str | None]:
    """Submit as gateway "gw-new" before its first beat; beat from FIRST_BEAT_AFTER_S on.
    Returns the tokens, the finish reason and the error the reply stream carried."""
    streams = Streams(mesh.cluster)
    bus = Bus(mesh.redis.url, "gw-new")
    await bus.connect()
    reply = streams.replies("gw-new")
    submit = SubmitRequest(
        request_id="new-gateway-0",
        prompt_token_ids=list(range(100, 140)),
        sampling=SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        reply_stream=reply,
        arrival_time=time.time(),
    )
    await bus.publish_many([(streams.requests, submit)])  # type: ignore[list-item]
    stop = asyncio.Event()
    beater = Heartbeater(
        bus, streams.heartbeats, service="gateway", instance_id="gw-new", group="0",
        interval_s=0.5, is_ready=_always_ready,
    )  # fmt: skip

    async def beat_late() -> None:
        await asyncio.sleep(FIRST_BEAT_AFTER_S)
        await beater.run(stop)

    beating = asyncio.create_task(beat_late())
    tokens: list[int] = []
    finish: str | None = None
    error: str | None = None
    last = {reply: "0"}
    deadline = time.monotonic() + 120
    try:
        while finish is None and error is None and time.monotonic() < deadline:
            for delivery in await bus.read(last, count=64, block_ms=500):
                if not isinstance(delivery.message, TokenDelta):
                    continue
                for delta in delivery.message.deltas:
                    tokens += delta.token_ids
                    error = error or delta.error
                    finish = finish or delta.finish_reason
    finally:
        stop.set()
        beating.cancel()
        await asyncio.gather(beating, return_exceptions=True)
        await bus.close()
    return tokens, finish, error


def test_a_new_gateways_first_request_is_served_though_its_first_beat_comes_late(
    smollm2_dir: Path,
) -> None:
    env = {**E2E_ENV, "MESHLLM_GATEWAY_TIMEOUT_S": str(GATEWAY_TIMEOUT_S)}
    with Mesh(services=("scheduler", "worker"), env=env) as mesh:
        time.sleep(GATEWAY_TIMEOUT_S + 1.0)  # the scheduler has watched longer than the bound
        tokens, finish, error = asyncio.run(serve_one(mesh))
        state = mesh.admin_state("scheduler")
    assert error is None, error
    assert finish == "length"
    assert len(tokens) == MAX_TOKENS
    assert state["orphans_aborted"] == 0
