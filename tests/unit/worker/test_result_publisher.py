"""ResultPublisher: results leave in the order queued, one at a time, without the caller
waiting; a failed publish surfaces on the next put or flush."""

from __future__ import annotations

import asyncio

import pytest

from services.worker.result_publisher import ResultPublisher
from shared.protocol import StepResult


def result(step: int) -> StepResult:
    return StepResult(step_id=step, worker_id="w", worker_incarnation="i")


async def test_in_order_one_at_a_time_and_put_does_not_wait() -> None:
    sent: list[int] = []
    active = 0
    gate = asyncio.Event()

    async def publish(r: StepResult) -> None:
        nonlocal active
        active += 1
        assert active == 1  # never two publishes at once (Redis would not keep their order)
        await gate.wait()
        await asyncio.sleep(0.001 * (r.step_id % 3))  # uneven round trips
        sent.append(r.step_id)
        active -= 1

    publisher = ResultPublisher(publish)
    for step in range(10):
        publisher.put(result(step))  # returns at once: nothing was sent yet
    assert sent == []
    gate.set()
    await publisher.flush()
    assert sent == list(range(10))
    publisher.put(result(10))
    await publisher.close()
    assert sent == list(range(11))


async def test_a_failed_publish_surfaces_on_the_next_put_and_flush() -> None:
    async def publish(r: StepResult) -> None:
        raise ConnectionError("redis gone")

    publisher = ResultPublisher(publish)
    publisher.put(result(1))
    with pytest.raises(RuntimeError, match="publishing step results failed"):
        await publisher.flush()
    with pytest.raises(RuntimeError, match="publishing step results failed"):
        publisher.put(result(2))
    with pytest.raises(RuntimeError):
        await publisher.close()


async def test_flush_without_results_returns() -> None:
    publisher = ResultPublisher(lambda r: asyncio.sleep(0))
    await publisher.flush()
    await publisher.close()
