"""The mesh rides out Redis outages: frozen (SIGSTOP) for longer than every timeout, or restarted
empty (no persistence). Every service stays alive, goes not-ready while Redis is away and ready
again after; in-flight requests finish; new requests, constrained ones included, complete.

The timeouts are made short (settings) so an outage of 10 s outlasts all of them: the publish
timeout (3 s), a Redis command (1 s), the worker silence bound (5 s: the scheduler's floor,
max(5, 5 heartbeat intervals)), the step timeout (6 s), the gateway silence bound (4 s) and the
claim idle time (3 s).
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.conftest import E2E_ENV
from tests.support.mesh import Mesh

pytestmark = pytest.mark.e2e

SERVICES = ("gateway", "scheduler", "worker", "grammar")
OUTAGE_S = 10.0  # past the longest timeout below (the step timeout, 6 s) by 4 s
MAX_TOKENS = 48
ENV = {
    **E2E_ENV,
    "MESHLLM_HEARTBEAT_INTERVAL_S": "0.5",
    "MESHLLM_REDIS_TIMEOUT_S": "1",
    "MESHLLM_PUBLISH_TIMEOUT_S": "3",
    "MESHLLM_GATEWAY_TIMEOUT_S": "4",
    "MESHLLM_CLAIM_IDLE_MS": "3000",
    "MESHLLM_STEP_TIMEOUT_S": "6",
}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.fixture(scope="module")
def mesh(smollm2_dir: Path) -> Iterator[Mesh]:
    with Mesh(services=SERVICES, env=ENV) as m:
        yield m


def client(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.api, api_key="x", max_retries=0, timeout=180)


def ready(mesh: Mesh, name: str) -> bool:
    try:
        return httpx.get(f"{mesh.url(name)}/ready", timeout=3).status_code == 200
    except httpx.HTTPError:
        return False


def assert_all_alive(mesh: Mesh) -> None:
    for name in SERVICES:
        code = mesh.procs[name].poll()
        assert code is None, f"{name} exited with {code}:\n{mesh.tail(name)}"


def wait_all_ready(mesh: Mesh, limit_s: float = 60) -> None:
    deadline = time.monotonic() + limit_s
    while not all(ready(mesh, name) for name in SERVICES):
        assert_all_alive(mesh)
        assert time.monotonic() < deadline, {n: ready(mesh, n) for n in SERVICES}
        time.sleep(0.2)


class Streams:
    """`n` streaming requests in threads; progress[i] counts the chunks of request i."""

    def __init__(self, mesh: Mesh, n: int) -> None:
        self.api = client(mesh)
        self.model = self.api.models.list().data[0].id
        self.progress = [0] * n
        self.finish: list[str | None] = [None] * n
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._one, args=(i,)) for i in range(n)]
        for t in self.threads:
            t.start()

    def _one(self, i: int) -> None:
        try:
            stream = self.api.chat.completions.create(
                model=self.model,
                messages=[{"role": "user", "content": f"Count to a hundred, take {i}."}],
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    self.progress[i] += 1
                if chunk.choices and chunk.choices[0].finish_reason:
                    self.finish[i] = chunk.choices[0].finish_reason
        except BaseException as exc:
            self.errors.append(exc)

    def wait_started(self) -> None:
        deadline = time.monotonic() + 120
        while min(self.progress) < 2:
            assert time.monotonic() < deadline, f"no progress: {self.progress}"
            time.sleep(0.02)

    def join(self, limit_s: float) -> None:
        for t in self.threads:
            t.join(limit_s)
        assert not any(t.is_alive() for t in self.threads), "a request hangs"


def complete_one(mesh: Mesh) -> str | None:
    api = client(mesh)
    model = api.models.list().data[0].id
    reply = api.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hi."}],
        max_tokens=8,
        temperature=0,
    )
    return reply.choices[0].finish_reason


def test_a_frozen_redis_outlasting_every_timeout_kills_nothing(mesh: Mesh) -> None:
    requests = Streams(mesh, 4)
    requests.wait_started()
    assert max(requests.progress) < MAX_TOKENS - 5, "requests finished before the outage"
    assert mesh.redis.proc is not None
    mesh.redis.proc.send_signal(signal.SIGSTOP)
    try:
        frozen_at = time.monotonic()
        # Not ready while Redis is away (the readiness ping has a 2 s bound of its own).
        deadline = frozen_at + 10
        while ready(mesh, "gateway") or ready(mesh, "scheduler"):
            assert time.monotonic() < deadline, "still ready with Redis frozen"
            time.sleep(0.2)
        while time.monotonic() - frozen_at < OUTAGE_S:
            assert_all_alive(mesh)
            time.sleep(0.5)
    finally:
        mesh.redis.proc.send_signal(signal.SIGCONT)
    wait_all_ready(mesh)
    requests.join(120)
    assert not requests.errors, requests.errors
    assert requests.finish == ["length"] * 4
    assert complete_one(mesh) == "length"
    assert_all_alive(mesh)


def test_a_restarted_empty_redis_heals_plain_and_constrained_requests(mesh: Mesh) -> None:
    api = client(mesh)
    model = api.models.list().data[0].id
    constrained = {
        "model": model,
        "messages": [{"role": "user", "content": "Is the sky blue? Answer in JSON."}],
        "max_tokens": 20,
        "temperature": 0,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": SCHEMA},
        },
    }
    before = api.chat.completions.create(**constrained)  # type: ignore[call-overload]
    assert json.loads(before.choices[0].message.content or "")

    requests = Streams(mesh, 2)
    requests.wait_started()
    mesh.redis.restart()  # same port; streams, groups, grammar entries and tokenizer info gone
    wait_all_ready(mesh)
    requests.join(120)
    assert not requests.errors, requests.errors
    assert requests.finish == ["length"] * 2
    assert complete_one(mesh) == "length"

    # Constrained requests work again within seconds, the grammar service untouched: the
    # same schema (its key cached in the grammar service's memory) and a new one.
    healed_by = time.monotonic() + 20
    new_schema = {"type": "object", "properties": {"yes": {"type": "boolean"}}, "required": ["yes"]}
    for schema, field in ((SCHEMA, "ok"), (new_schema, "yes")):
        format_ = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
        while True:
            try:
                reply = api.chat.completions.create(**{**constrained, "response_format": format_})
                break
            except openai.APIError as exc:
                assert time.monotonic() < healed_by, f"constrained requests still fail: {exc}"
                time.sleep(0.5)
        assert json.loads(reply.choices[0].message.content or "")[field] in (True, False)
    assert_all_alive(mesh)
