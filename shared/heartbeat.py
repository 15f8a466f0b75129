"""The liveness beat every service publishes on the cluster's heartbeat stream.

A beat carries the process incarnation (a uuid made once per process start), so a consumer can
tell a restarted service from a live one: a worker with a new incarnation lost its KV cache and
persistent batch. The beat also says whether the service is ready, as its own `/ready` would,
which model it serves and, for a scheduler, its role: the gateway learns from these beats which
worker groups can serve (services/gateway/mesh).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Protocol

from prometheus_client import Counter

from shared.metrics import metric_name
from shared.protocol import Heartbeat, Message
from shared.protocol.health import GroupLoad, GroupRole, ServiceName

INCARNATION = uuid.uuid4().hex
"""This process's incarnation: fixed at import, so every beat of one process carries it."""

log = logging.getLogger(__name__)

HEARTBEATS_SENT = Counter(
    metric_name("heartbeats_sent"), "Heartbeats published on the heartbeat stream", ["service"]
)
HEARTBEAT_FAILURES = Counter(
    metric_name("heartbeat_failures"), "Heartbeats that could not be published", ["service"]
)


class Publisher(Protocol):
    async def publish(self, stream: str, msg: Message) -> str: ...


class Heartbeater:
    """Publishes a Heartbeat every `interval_s` until stopped.

    A failed publish (Redis down) is logged and counted, never fatal: the beat resumes when
    Redis answers again, and the stream's consumers treat the gap as the outage it is.
    """

    def __init__(
        self,
        publisher: Publisher,
        stream: str,
        *,
        service: ServiceName,
        instance_id: str,
        group: str,
        interval_s: float,
        is_ready: Callable[[], Awaitable[bool]],
        model: str = "",
        role: GroupRole = "",
        load: Callable[[], GroupLoad | None] | None = None,
    ) -> None:
        self.publisher = publisher
        self.stream = stream
        self.service = service
        self.instance_id = instance_id
        self.group = group
        self.interval_s = interval_s
        self.is_ready = is_ready
        self.model = model
        self.role = role
        self.load = load
        self.sent = 0

    def beat_message(self, ready: bool) -> Heartbeat:
        return Heartbeat(
            service=self.service,
            instance_id=self.instance_id,
            incarnation=INCARNATION,
            group=self.group,
            ready=ready,
            time=time.time(),
            model=self.model,
            role=self.role,
            interval_s=self.interval_s,
            load=self.load() if self.load is not None else None,
        )

    async def beat(self) -> None:
        try:
            ready = await self.is_ready()
        except Exception:
            log.exception("readiness check failed during heartbeat")
            ready = False
        await self.publisher.publish(self.stream, self.beat_message(ready))
        self.sent += 1
        HEARTBEATS_SENT.labels(self.service).inc()

    async def run(self, stop: asyncio.Event) -> None:
        """Beat until `stop` is set; the first beat goes out immediately."""
        while not stop.is_set():
            try:
                await self.beat()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                HEARTBEAT_FAILURES.labels(self.service).inc()
                log.warning("heartbeat not published: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.interval_s)
