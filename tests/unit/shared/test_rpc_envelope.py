"""The pure rules of a call: correlation ids, reply-stream namespace, deadlines."""

from __future__ import annotations

import pytest

from shared.protocol import AbortRequest, Ping
from shared.rpc.envelope import (
    CorrelationIds,
    envelope_problem,
    expired,
    reply_stream_problem,
)
from shared.streams import Streams

PREFIX = Streams("c1").rpc_reply_prefix  # meshllm:c1:rpc:


def test_correlation_ids_are_unique_within_and_across_clients() -> None:
    a, b = CorrelationIds(), CorrelationIds()
    ids = [a.next() for _ in range(1000)]
    assert len(set(ids)) == 1000
    assert not set(ids) & {b.next() for _ in range(1000)}  # a restarted instance never matches
    assert all(len(i) <= 64 for i in ids)  # fits RpcRequest.correlation_id


@pytest.mark.parametrize(
    "name",
    [
        "meshllm:c1:rpc:gateway:gw-1",
        "meshllm:c1:rpc:scheduler:host.example-1234",
        "meshllm:c1:rpc:scheduler:a_b",
    ],
)
def test_reply_streams_in_the_namespace_are_accepted(name: str) -> None:
    assert reply_stream_problem(name, PREFIX) is None
    assert Streams("c1").rpc_replies("gateway", "gw-1") == "meshllm:c1:rpc:gateway:gw-1"


@pytest.mark.parametrize(
    "name",
    [
        "meshllm:c1:requests",  # another service's stream
        "meshllm:c1:kv:model:1:0:abcd",  # a KV payload key
        "meshllm:c2:rpc:gateway:gw-1",  # another cluster's
        "meshllm:c1:rpc:gateway",  # no instance
        "meshllm:c1:rpc:gateway:gw:1",  # one segment too many
        "meshllm:c1:rpc:gateway:{g0}",  # hash tags and other characters
        "meshllm:c1:rpc:gateway: gw",
        "meshllm:c1:rpc::gw-1",
        "",
    ],
)
def test_reply_streams_outside_the_namespace_are_refused(name: str) -> None:
    problem = reply_stream_problem(name, PREFIX)
    assert problem is not None and "meshllm:c1:rpc:<service>:<instance>" in problem


def test_envelope_problems() -> None:
    ok = Ping(correlation_id="c", reply_stream=f"{PREFIX}gateway:gw-1", deadline=10.0)
    assert envelope_problem(ok, PREFIX) is None
    assert envelope_problem(AbortRequest(request_id="r"), PREFIX) == "abort is not a call"
    no_id = ok.model_copy(update={"correlation_id": ""})
    assert envelope_problem(no_id, PREFIX) == "rpc_ping has no correlation id"
    no_deadline = ok.model_copy(update={"deadline": 0.0})
    assert envelope_problem(no_deadline, PREFIX) == "rpc_ping has no deadline"
    elsewhere = ok.model_copy(update={"reply_stream": "meshllm:c1:aborts"})
    assert "meshllm:c1:aborts" in (envelope_problem(elsewhere, PREFIX) or "")


def test_a_request_expires_after_its_deadline_not_at_it() -> None:
    assert not expired(100.0, 99.9)
    assert not expired(100.0, 100.0)
    assert expired(100.0, 100.001)
