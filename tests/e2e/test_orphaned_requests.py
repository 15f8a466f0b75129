"""A gateway that dies (SIGKILL) leaves no work behind: the scheduler aborts its requests once
its heartbeats have been missing for the bound, freeing their KV, and its reply stream expires.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
import redis

from shared.streams import Streams
from tests.e2e.conftest import E2E_ENV
from tests.support.mesh import Mesh

pytestmark = pytest.mark.e2e

# Long enough that a live gateway's beats do not fall silent this long on a loaded 2-core
# machine (at 3 s, one full-suite run saw the orphans aborted 0.07 s after the kill: the
# scheduler had heard nothing for 3 s from a gateway that was still up).
GATEWAY_TIMEOUT_S = 6.0
REPLY_TTL_S = 3
ENV = {
    **E2E_ENV,
    "MESHLLM_HEARTBEAT_INTERVAL_S": "0.5",
    "MESHLLM_GATEWAY_TIMEOUT_S": str(GATEWAY_TIMEOUT_S),
    "MESHLLM_REPLY_STREAM_TTL_S": str(REPLY_TTL_S),
}
N = 3


@pytest.fixture(scope="module")
def mesh(smollm2_dir: Path) -> Iterator[Mesh]:
    with Mesh(env=ENV) as m:
        yield m


def wait_until(predicate: Callable[[], bool], what: str, limit_s: float = 60.0) -> float:
    """Seconds it took."""
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < limit_s, f"timed out waiting until {what}"
        time.sleep(0.05)
    return time.monotonic() - started


def test_a_killed_gateways_requests_are_aborted_and_its_reply_stream_expires(
    mesh: Mesh,
) -> None:
    client = openai.OpenAI(base_url=mesh.api, api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id

    def long_request(i: int) -> None:
        try:
            for _ in client.completions.create(
                model=model,
                prompt=f"List every number from {i} on:",
                max_tokens=2000,
                stream=True,
                extra_body={"ignore_eos": True},
            ):
                pass
        except openai.APIError:
            pass  # the gateway is killed under it

    threads = [threading.Thread(target=long_request, args=(i,), daemon=True) for i in range(N)]
    for t in threads:
        t.start()

    def running() -> list[str]:
        return list(mesh.admin_state("scheduler")["running_request_ids"])

    wait_until(lambda: len(running()) == N, f"{N} requests running")
    free_before = mesh.admin_state("scheduler")["scheduler"]["num_free_blocks"]
    reply_stream = Streams(mesh.cluster).replies("gateway-0")
    db = redis.Redis.from_url(mesh.redis.url)
    try:
        assert db.ttl(reply_stream) > 0  # a live gateway's stream carries a TTL
        mesh.kill("gateway")
        took = wait_until(lambda: not running(), "the orphans are aborted")
        # Not before the bound (its last beat came at most one interval before the kill).
        assert took > GATEWAY_TIMEOUT_S - 1.0
        assert took < GATEWAY_TIMEOUT_S + 10.0
        state = mesh.admin_state("scheduler")
        assert state["orphans_aborted"] == N
        assert state["inflight_entries"] == 0
        assert state["scheduler"]["num_free_blocks"] > free_before  # their KV is back
        wait_until(
            lambda: not db.exists(reply_stream), "the reply stream expires", REPLY_TTL_S + 10
        )
    finally:
        db.close()
    for t in threads:
        t.join(30)

    mesh.restart("gateway")  # the mesh serves again with a new gateway
    reply = client.completions.create(model=model, prompt="Hi", max_tokens=3)
    assert reply.choices[0].finish_reason == "length"
