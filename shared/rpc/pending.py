"""Calls awaiting their reply, by correlation id (no I/O: the client's reader feeds it).

Invariant: an id is here exactly while its call waits. The call removes it when it returns,
whatever the outcome, so a reply that comes later (the call timed out) or twice (a retried
call answered by both attempts) finds no id and is dropped: a reply resolves at most one
call, once.
"""

from __future__ import annotations

import asyncio

from shared.protocol import RpcReply
from shared.rpc.envelope import CorrelationIds


class PendingCalls:
    def __init__(self) -> None:
        self._ids = CorrelationIds()
        self._waiting: dict[str, asyncio.Future[RpcReply]] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def open(self) -> tuple[str, asyncio.Future[RpcReply]]:
        """A fresh correlation id and the future its reply will resolve."""
        correlation_id = self._ids.next()
        future: asyncio.Future[RpcReply] = asyncio.get_running_loop().create_future()
        self._waiting[correlation_id] = future
        return correlation_id, future

    def resolve(self, reply: RpcReply) -> bool:
        """Hand `reply` to its call; False (the reply is dropped) when no call waits for it."""
        future = self._waiting.get(reply.correlation_id)
        if future is None or future.done():
            return False
        future.set_result(reply)
        return True

    def close(self, correlation_id: str) -> None:
        """The call returned: later replies for its id are dropped."""
        self._waiting.pop(correlation_id, None)

    def fail_all(self, exc: BaseException) -> None:
        """Wake every waiting call with `exc` (the client is stopping)."""
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(exc)
        self._waiting.clear()
