"""A group consumer that reads one entry and never acknowledges it: a service about to crash.

    python -m tests.support.stalled_consumer REDIS_URL STREAM GROUP CONSUMER

Prints the id of the entry it read, then waits until it is killed, so the entry stays pending
under CONSUMER for a live consumer to claim.
"""

from __future__ import annotations

import asyncio
import sys

from shared.bus import Bus, Delivery


async def main(redis_url: str, stream: str, group: str, consumer: str) -> None:
    bus = Bus(redis_url, consumer)
    await bus.connect()
    await bus.ensure_group(stream, group)
    deliveries: list[Delivery] = []
    while not deliveries:
        deliveries = await bus.read_group(group, [stream], count=1, block_ms=1000)
    print(deliveries[0].entry_id, flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
