"""Poison on the requests stream never takes the scheduler down: entries that do not decode, that
name a reply stream outside the gateway namespace or token ids outside the vocabulary, that
their schedulers kept dying on, or a DEL of the stream itself. Each bad entry is dead-lettered
with its reason, its client (when its reply stream is usable) hears why, and the next good
request is served. A scheduler restarted under its instance id resumes its own pending entries
at once instead of waiting the claim idle time.

Bad entries are written straight to Redis, as a foreign or buggy producer would; good requests
go through the gateway with the `openai` client.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import openai
import pytest
import redis

from shared.codec import decode, encode
from shared.protocol import SamplingParams, SubmitRequest, TokenDelta
from shared.service import consumer_name
from shared.streams import SCHEDULER_GROUP, Streams
from tests.e2e.conftest import E2E_ENV
from tests.support.mesh import Mesh

pytestmark = pytest.mark.e2e

MAX_DELIVERIES = 3
ENV = {
    **E2E_ENV,
    "MESHLLM_MAX_DELIVERIES": str(MAX_DELIVERIES),
    "MESHLLM_CLAIM_IDLE_MS": "600000",  # nothing here may wait for a claim
    "MESHLLM_HEARTBEAT_INTERVAL_S": "0.5",
}
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def mesh(smollm2_dir: Path) -> Iterator[Mesh]:
    with Mesh(env=ENV) as m:
        yield m


@pytest.fixture
def db(mesh: Mesh) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(mesh.redis.url)
    yield client
    client.close()


def streams(mesh: Mesh) -> Streams:
    return Streams(mesh.cluster)


def api(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.api, api_key="x", max_retries=0, timeout=120)


def good_request_is_served(mesh: Mesh) -> None:
    client = api(mesh)
    model = client.models.list().data[0].id
    reply = client.completions.create(
        model=model,
        prompt="One, two,",
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True},  # OpenAI's default temperature 1 can sample EOS early
    )
    assert reply.choices[0].finish_reason == "length"
    code = mesh.procs["scheduler"].poll()
    assert code is None, f"scheduler exited with {code}:\n{mesh.tail('scheduler')}"


def submit_body(request_id: str, reply_stream: str, prompt: list[int]) -> dict[str, Any]:
    return {"request_id": request_id, "prompt_token_ids": prompt, "reply_stream": reply_stream}


def dead_letter(db: redis.Redis, mesh: Mesh, entry_id: str) -> dict[bytes, bytes]:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        for _, record in db.xrange(streams(mesh).deadletter):
            if record[b"id"] == entry_id.encode():
                return record
        assert time.monotonic() < deadline, f"entry {entry_id} was not dead-lettered"
        time.sleep(0.05)


def error_reply(db: redis.Redis, reply_stream: str, request_id: str) -> str:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        for _, fields in db.xrange(reply_stream):
            msg = decode(fields[b"m"], TokenDelta)
            for delta in msg.deltas:
                if delta.request_id == request_id:
                    assert delta.finish_reason == "error"
                    return delta.error or ""
        assert time.monotonic() < deadline, f"no reply for {request_id}"
        time.sleep(0.05)


def test_an_entry_with_a_token_id_past_int32_is_dead_lettered_and_answered(
    mesh: Mesh, db: redis.Redis
) -> None:
    reply = streams(mesh).replies("poison-client-1")
    body = submit_body("poison-int", reply, [1, 2**40])
    payload = msgpack.packb({"t": "submit", "v": 1, "b": body})
    entry_id = db.xadd(streams(mesh).requests, {"m": payload}).decode()
    record = dead_letter(db, mesh, entry_id)
    assert record[b"reason"] == b"invalid" and b"prompt_token_ids" in record[b"detail"]
    assert "int32" in error_reply(db, reply, "poison-int")
    good_request_is_served(mesh)


def test_a_reply_stream_outside_the_gateway_namespace_is_dead_lettered(
    mesh: Mesh, db: redis.Redis
) -> None:
    msg = SubmitRequest(request_id="poison-acl", prompt_token_ids=[1, 2], reply_stream="elsewhere")
    entry_id = db.xadd(streams(mesh).requests, {"m": encode(msg)}).decode()
    record = dead_letter(db, mesh, entry_id)
    assert record[b"reason"] == b"invalid_reply_stream"
    good_request_is_served(mesh)
    assert not db.exists("elsewhere")  # nothing was written there


def test_a_token_id_outside_the_vocabulary_is_dead_lettered_and_answered(
    mesh: Mesh, db: redis.Redis
) -> None:
    reply = streams(mesh).replies("poison-client-2")
    msg = SubmitRequest(
        request_id="poison-vocab",
        prompt_token_ids=[1, 49152],
        sampling=SamplingParams(max_tokens=2),
        reply_stream=reply,
    )
    entry_id = db.xadd(streams(mesh).requests, {"m": encode(msg)}).decode()
    record = dead_letter(db, mesh, entry_id)
    assert record[b"reason"] == b"invalid_request"
    assert "vocabulary" in error_reply(db, reply, "poison-vocab")
    good_request_is_served(mesh)


def test_an_entry_its_schedulers_kept_dying_on_is_dead_lettered_at_restart(
    mesh: Mesh, db: redis.Redis
) -> None:
    """What a crash loop leaves: the entry pending in the scheduler's own consumer with a
    delivery count past the bound (each start re-read it). The restarted scheduler refuses it
    instead of running it once more, and serves the rest."""
    s = streams(mesh)
    reply = s.replies("poison-client-3")
    msg = SubmitRequest(request_id="poison-loop", prompt_token_ids=[1, 2], reply_stream=reply)
    consumer = consumer_name("scheduler", "0", "scheduler-0")
    mesh.kill("scheduler")
    entry_id = db.xadd(s.requests, {"m": encode(msg)}).decode()
    db.xreadgroup(SCHEDULER_GROUP, consumer, {s.requests: ">"})  # delivered to it ...
    db.xclaim(s.requests, SCHEDULER_GROUP, consumer, 0, [entry_id], retrycount=MAX_DELIVERIES)
    mesh.restart("scheduler")  # ... and once more now: one past the bound
    record = dead_letter(db, mesh, entry_id)
    assert record[b"reason"] == b"max_deliveries"
    assert "delivered" in error_reply(db, reply, "poison-loop")
    assert db.xpending(s.requests, SCHEDULER_GROUP)["pending"] == 0
    good_request_is_served(mesh)


def test_a_del_of_the_requests_stream_does_not_kill_the_scheduler(
    mesh: Mesh, db: redis.Redis
) -> None:
    good_request_is_served(mesh)  # the scheduler is blocked reading the streams now
    s = streams(mesh)
    assert db.delete(s.requests, s.group_requests("0")) >= 1  # the routed request's stream
    good_request_is_served(mesh)


def test_a_restarted_scheduler_resumes_its_own_pending_request_at_once(mesh: Mesh) -> None:
    """Claim idle time is 10 minutes here: the request finishes only because the restarted
    scheduler (same instance id, so same consumer) re-reads its own pending entry."""
    client = api(mesh)
    model = client.models.list().data[0].id
    chunks: list[str] = []
    errors: list[BaseException] = []

    def stream() -> None:
        try:
            for chunk in client.completions.create(
                model=model,
                prompt="Once upon a time",
                max_tokens=40,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            ):
                if chunk.choices and chunk.choices[0].text:
                    chunks.append(chunk.choices[0].text)
        except BaseException as exc:
            errors.append(exc)

    runner = threading.Thread(target=stream)
    runner.start()
    deadline = time.monotonic() + DEADLINE_S
    while len(chunks) < 3:
        assert time.monotonic() < deadline, "no tokens"
        time.sleep(0.02)
    assert len(chunks) < 35, "finished before the kill: test too slow"
    mesh.kill("scheduler")
    restarted = time.monotonic()
    mesh.restart("scheduler")
    runner.join(DEADLINE_S)
    assert not runner.is_alive() and not errors, errors
    assert time.monotonic() - restarted < DEADLINE_S  # far below the claim idle time
    assert mesh.admin_state("scheduler")["inflight_entries"] == 0
