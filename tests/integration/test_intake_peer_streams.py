"""A scheduler reads the request stream of a peer group that is not serving (to run what was
routed to it before the gateways learnt it stopped), and only then: once the peer beats ready,
a request routed to it is left to it, even when it arrives while this scheduler is waiting on
its own streams. Real Redis; the intake's read loop as the scheduler runs it, with `accept`
recording instead of admitting (no core here)."""

from __future__ import annotations

import asyncio
import time

from services.scheduler.intake import Intake
from shared.bus import Bus, Delivery
from shared.config import SchedulerSettings
from shared.protocol import Heartbeat, SamplingParams, SubmitRequest
from shared.service import consumer_name
from shared.streams import Streams

CLUSTER = "peers"
STREAMS = Streams(CLUSTER)


class AliveEngine:
    """The engine side intake asks about: a live worker, nothing else used by the read loop."""

    core = None
    wakeup = asyncio.Event()
    outbox: list[object] = []

    def vocab_size(self) -> int:
        return 1000

    def worker_alive(self) -> bool:
        return True

    def requests_added(self) -> None:
        return None


class RecordingIntake(Intake):
    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.taken: list[Delivery] = []

    async def accept(self, deliveries: list[Delivery]) -> None:
        self.taken += deliveries


def beat(group: str, ready: bool) -> Heartbeat:
    return Heartbeat(
        service="scheduler",
        instance_id=f"s{group}",
        incarnation="a",
        group=group,
        ready=ready,
        time=time.time(),
        model="m",
        role="both",
        interval_s=1.0,  # silent after 3 s without a beat; beaten every 0.5 s here
    )


def request(rid: str) -> SubmitRequest:
    return SubmitRequest(
        request_id=rid,
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(max_tokens=4),
        reply_stream=STREAMS.replies("gw"),
    )


async def keep_beating(intake: RecordingIntake, stopping: asyncio.Event) -> None:
    """Group 1 beating ready every interval (a silent group counts as not serving)."""
    while not stopping.is_set():
        await asyncio.sleep(0.5)
        intake.peers.beat(beat("1", ready=True))


async def taken_from(intake: RecordingIntake, stream: str, within_s: float) -> list[str]:
    await asyncio.sleep(within_s)
    return [d.message.request_id for d in intake.taken if d.stream == stream]  # type: ignore[union-attr]


async def test_a_peer_takes_a_not_ready_groups_requests_and_not_a_ready_ones(
    redis_url: str,
) -> None:
    settings = SchedulerSettings(
        cluster=CLUSTER, group="0", instance_id="s0", role="both", heartbeat_interval_s=0.5
    )
    bus = Bus(redis_url, consumer_name("scheduler", "0", "s0"))
    await bus.connect()
    gateway = Bus(redis_url, "gateway:test")
    await gateway.connect()
    intake = RecordingIntake(bus, STREAMS, settings, AliveEngine(), None)
    await intake.start(None)  # type: ignore[arg-type]
    peer_stream = STREAMS.group_requests("1")
    stopping = asyncio.Event()
    intake.peers.beat(beat("1", ready=False))  # group 1's worker is still loading
    loop = asyncio.create_task(intake.read_requests(stopping))
    beating = asyncio.create_task(asyncio.sleep(0))
    try:
        await gateway.publish(peer_stream, request("routed-while-loading"))
        deadline = time.monotonic() + 10
        while not await taken_from(intake, peer_stream, 0.1) and time.monotonic() < deadline:
            pass
        assert await taken_from(intake, peer_stream, 0) == ["routed-while-loading"]

        await asyncio.sleep(0.3)  # the loop is waiting on its own streams again
        intake.peers.beat(beat("1", ready=True))  # what the heartbeat watch hands it
        beating = asyncio.create_task(keep_beating(intake, stopping))
        await gateway.publish(peer_stream, request("routed-once-ready"))
        assert await taken_from(intake, peer_stream, 2.5) == ["routed-while-loading"]
    finally:
        stopping.set()
        await loop
        await beating
        await bus.close()
        await gateway.close()
