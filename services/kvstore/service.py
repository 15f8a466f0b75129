"""The kvstore service: the offload tier's policy state, answering calls over the bus (calls.py).

It owns which chunks exist, their recency and their pins (`OffloadTier` around the configured
policy); workers own the payload bytes in Redis. Its own Redis work is small: metadata hashes
for ready chunks, deleting payload + metadata together on eviction, and rebuilding the table
from the metadata on start (so the tier survives a kvstore restart; recovered chunks are ready
and ordered by their store sequence). Its calls stream is opened only once the table is
rebuilt, so no call sees a half-built tier.

One kvstore per cluster, one consumer, serving calls one at a time in stream order: its state
is in memory, and a scheduler, which waits for each answer before its next call, then sees its
calls applied in the order it made them (its `store` before its `request_finished`).

`run()` also retries evicted chunks' deletes that failed (Redis unreachable) until they
succeed, and fails writes that were never reported (deleting their payloads): within
`write_timeout_s` of `writing` (the scheduler's word that the step computing the chunks ended:
the deadline covers the writes, not the prefill before them), or `write_start_timeout_s` of
`store` without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from services.kvstore.calls import OffloadCalls
from services.kvstore.offload_tier import OffloadTier
from services.kvstore.policy import load_policy
from services.kvstore.redis_index import RedisOffloadIndex
from shared.bus_retry import retry
from shared.config import KVStoreSettings
from shared.rpc import RpcServer
from shared.service import Service

log = logging.getLogger(__name__)

RETRY_DELETES_S = 1.0  # also how often expired writes are looked for


class KVStoreService(Service):
    name = "kvstore"

    def __init__(self, settings: KVStoreSettings) -> None:
        super().__init__(settings)
        self.settings: KVStoreSettings = settings
        self.calls: OffloadCalls | None = None  # set once start() has rebuilt the tier
        self.rpc: RpcServer | None = None

    async def start(self) -> None:
        await super().start()
        s = self.settings
        policy = load_policy(s.policy, s.capacity_bytes)
        index = RedisOffloadIndex(self.bus.redis, s.cluster)
        recovered, dropped = 0, []
        # However long Redis takes: a kvstore that exits for an outage helps nobody.
        for chunk in await retry("kvstore recovery", index.scan_meta, None):
            if policy.restore(chunk.payload_key, chunk.nbytes):
                recovered += 1
            else:
                dropped.append(chunk.payload_key)  # over the (possibly smaller) capacity now
        await retry("kvstore recovery", lambda: index.delete(dropped), None)
        calls = OffloadCalls(OffloadTier(policy), index, s.cluster, recovered)
        rpc = RpcServer(
            self.bus,
            self.streams.calls(self.name),
            calls.handlers(),
            service=self.name,
            instance_id=s.instance_id,
            reply_prefix=self.streams.rpc_reply_prefix,
            concurrency=1,
            claim_idle_ms=s.claim_idle_ms,
        )
        await rpc.start()
        self.calls, self.rpc = calls, rpc  # calls are accepted from now on: ready
        log.info("kvstore ready: %d chunks recovered, %d dropped", recovered, len(dropped))

    async def run(self) -> None:
        """Serve calls and keep house until stopped; if either fails, so does the service."""
        assert self.rpc is not None and self.calls is not None, "start() sets them"
        tasks = [
            asyncio.create_task(self.rpc.run(self.stopping), name="kvstore-calls"),
            asyncio.create_task(self._housekeeping(self.calls), name="kvstore-housekeeping"),
        ]
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in pending:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for task in done:
            task.result()  # re-raises a failure

    async def _housekeeping(self, calls: OffloadCalls) -> None:
        while not self.stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), RETRY_DELETES_S)
            if calls.undeleted:
                await calls.delete(list(calls.undeleted))
            expired = [
                str(k)
                for k in calls.tier.expire_writes(
                    time.monotonic(),
                    self.settings.write_timeout_s,
                    self.settings.write_start_timeout_s,
                )
            ]
            if expired:
                log.warning("%d chunk writes never completed; dropped", len(expired))
                with contextlib.suppress(Exception):  # a leftover partial payload is harmless
                    await calls.index.delete_payloads(expired)

    async def check_ready(self) -> tuple[bool, dict[str, Any]]:
        ready, details = await super().check_ready()
        details["checks"]["tier"] = "ok" if self.rpc is not None else "rebuilding"
        return ready and self.rpc is not None, details

    def state(self) -> dict[str, Any]:
        out = {**super().state(), "role": "kvstore"}
        if self.calls is not None:
            out["kvstore"] = {
                **self.calls.tier.state(),
                "recovered": self.calls.recovered,
                "undeleted": len(self.calls.undeleted),
                "calls": self.rpc.state() if self.rpc else None,
            }
        return out
