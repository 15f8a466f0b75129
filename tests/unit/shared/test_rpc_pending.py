"""Calls awaiting their reply: a reply resolves its own call, once; late and unknown replies
are dropped."""

from __future__ import annotations

import asyncio

from shared.protocol import Pong
from shared.rpc.errors import RpcUnavailable
from shared.rpc.pending import PendingCalls


def pong(correlation_id: str, instance: str = "i") -> Pong:
    return Pong(correlation_id=correlation_id, service="s", instance_id=instance)


async def test_each_reply_resolves_its_own_call() -> None:
    pending = PendingCalls()
    (a, fa), (b, fb) = pending.open(), pending.open()
    assert a != b and len(pending) == 2
    assert pending.resolve(pong(b, "for b"))
    assert fb.done() and not fa.done()
    assert (await fb).instance_id == "for b"
    assert pending.resolve(pong(a, "for a"))
    assert (await fa).instance_id == "for a"


async def test_unknown_late_and_duplicate_replies_are_dropped() -> None:
    pending = PendingCalls()
    cid, future = pending.open()
    assert not pending.resolve(pong("never-asked"))
    assert pending.resolve(pong(cid, "first"))
    assert not pending.resolve(pong(cid, "second"))  # a retried call answered twice
    assert (await future).instance_id == "first"
    pending.close(cid)  # the call returned
    assert not pending.resolve(pong(cid, "late"))
    assert len(pending) == 0
    expired, _ = pending.open()
    pending.close(expired)  # the call timed out before any answer
    assert not pending.resolve(pong(expired))


async def test_fail_all_wakes_every_waiting_call() -> None:
    pending = PendingCalls()
    futures = [pending.open()[1] for _ in range(3)]
    pending.fail_all(RpcUnavailable("stopping"))
    results = await asyncio.gather(*futures, return_exceptions=True)
    assert all(isinstance(r, RpcUnavailable) for r in results)
    assert len(pending) == 0
