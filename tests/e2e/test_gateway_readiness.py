"""Ready means able to serve: a gateway started alone (Redis, no scheduler or worker) answers
/ready 503 naming its failing check and refuses completions with 503 + Retry-After, queueing
nothing; once a scheduler and its worker come up it is ready and serves, with real processes
and the real `openai` client."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest
import redis

from shared.streams import Streams
from tests.e2e.conftest import E2E_ENV
from tests.support.mesh import Mesh
from tests.support.stream_counts import entries_added

pytestmark = pytest.mark.e2e

CHAT = [{"role": "user", "content": "Say hi."}]


def loaded_gateway_ready_body(mesh: Mesh, timeout: float = 120.0) -> httpx.Response:
    """The gateway's /ready once its model is loaded (ready or not)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:  # polls a condition; no timing is asserted
        assert mesh.procs["gateway"].poll() is None, mesh.tail("gateway")
        try:
            resp = httpx.get(f"{mesh.url('gateway')}/ready", timeout=2.0)
            if resp.json().get("checks", {}).get("model") == "ok":
                return resp
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"the gateway did not load its model:\n{mesh.tail('gateway')}")


def test_the_gateway_serves_only_once_a_worker_group_is_ready(smollm2_dir: Path) -> None:
    mesh = Mesh(services=(), env={**E2E_ENV, "MESHLLM_HEARTBEAT_INTERVAL_S": "0.5"}).start()
    try:
        mesh.start_service("gateway")
        ready = loaded_gateway_ready_body(mesh)
        assert ready.status_code == 503
        checks = ready.json()["checks"]
        assert checks["workers"] == (
            "no ready worker group for model 'SmolLM2-135M-Instruct' (0 schedulers alive)"
        )
        assert {k for k, v in checks.items() if v != "ok"} == {"workers"}

        client = openai.OpenAI(base_url=mesh.api, api_key="x", max_retries=0, timeout=120)
        model = client.models.list().data[0].id  # needs no worker group
        with pytest.raises(openai.InternalServerError) as refused:
            client.chat.completions.create(model=model, messages=CHAT, max_tokens=4)
        assert refused.value.status_code == 503
        assert refused.value.response.headers["retry-after"] == "1"
        error = refused.value.response.json()["error"]
        assert error["type"] == "service_unavailable"
        assert "no ready worker group" in error["message"]
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model=model, prompt="Hello", max_tokens=4)
        bad = httpx.post(f"{mesh.api}/chat/completions", json={"model": model, "messages": []})
        assert bad.status_code == 400  # the client's own mistake first

        mesh.start_service("scheduler")
        mesh.start_service("worker")
        for name in ("worker", "scheduler", "gateway"):
            mesh.wait_ready(name)
        assert httpx.get(f"{mesh.url('gateway')}/ready").json()["checks"]["workers"] == "ok"
        reply = client.chat.completions.create(model=model, messages=CHAT, max_tokens=4)
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert reply.usage is not None and reply.usage.completion_tokens >= 1

        r = redis.Redis.from_url(mesh.redis.url)
        streams = Streams(mesh.cluster)
        routed = streams.group_requests("0")  # where the router puts a request for group 0
        queued = entries_added(r, streams.requests) + entries_added(r, routed)
        assert queued == 1  # the refused ones were never queued
        r.close()
    finally:
        mesh.stop()
