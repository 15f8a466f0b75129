"""How the bus rides out a Redis outage: retry with exponential backoff, bounded or not.

Delays start at 50 ms and double up to 2 s. Each delay is drawn from [d/2, d]: many consumers that
lost the same Redis at the same moment then spread their reconnects instead of arriving together,
while every delay still grows, so a long outage costs at most one attempt per 2 s per operation.
Only connection-level failures are retried; a Redis error reply (NOGROUP, WRONGTYPE, ...) or a
refused login is an answer, and goes straight back to the caller.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.exceptions import AuthenticationError, AuthorizationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger("shared.bus")

T = TypeVar("T")

BASE_S = 0.05
CAP_S = 2.0

# Builtin TimeoutError also covers asyncio's (the bus's own per-read deadline).
TRANSIENT = (RedisConnectionError, RedisTimeoutError, ConnectionError, TimeoutError)
# redis-py files these under ConnectionError, but waiting does not fix a wrong password or ACL.
PERMANENT = (AuthenticationError, AuthorizationError)


class BusUnavailable(ConnectionError):
    """Redis stayed unreachable past an operation's deadline (publish, ack, connect)."""


class Backoff:
    """The delays of one retried operation; make a fresh one per operation."""

    def __init__(self, base_s: float = BASE_S, cap_s: float = CAP_S) -> None:
        self.base_s = base_s
        self.cap_s = cap_s
        self.attempts = 0

    def next_delay(self) -> float:
        # The exponent is capped so an outage of any length never overflows the float.
        ceiling = min(self.cap_s, self.base_s * 2.0 ** min(self.attempts, 30))
        self.attempts += 1
        return random.uniform(ceiling / 2, ceiling)


async def retry(what: str, op: Callable[[], Awaitable[T]], limit_s: float | None) -> T:
    """Run `op` until it gets through; BusUnavailable once `limit_s` would be passed (None:
    never give up). `op` must be safe to repeat: a retried XADD may add its entry twice."""
    backoff: Backoff | None = None
    started = 0.0
    while True:
        try:
            result = await op()
        except TRANSIENT as exc:
            if isinstance(exc, PERMANENT):
                raise
            if backoff is None:
                backoff, started = Backoff(), time.monotonic()
                log.warning(
                    "redis unreachable during %s, retrying: %s",
                    what,
                    exc,
                    extra={"op": what, "error": str(exc)},
                )
            delay = backoff.next_delay()
            waited = time.monotonic() - started
            if limit_s is not None and waited + delay > limit_s:
                message = f"{what}: Redis unreachable for {waited:.1f} s: {exc}"
                raise BusUnavailable(message) from exc
            await asyncio.sleep(delay)
            continue
        if backoff is not None:
            log.info(
                "redis reachable again for %s after %d retries",
                what,
                backoff.attempts,
                extra={
                    "op": what,
                    "retries": backoff.attempts,
                    "outage_s": round(time.monotonic() - started, 3),
                },
            )
        return result
