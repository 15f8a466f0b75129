"""unless_stopped: a call's result, or None with the call cancelled once the stop comes."""

from __future__ import annotations

import asyncio

import pytest

from shared.stopping import result_or_none, unless_stopped


async def _after(delay_s: float, value: object, seen: list[str]) -> object:
    try:
        await asyncio.sleep(delay_s)
    except asyncio.CancelledError:
        seen.append("cancelled")
        raise
    return value


def test_a_call_that_ends_first_gives_its_result() -> None:
    async def main() -> tuple[object, list[str]]:
        seen: list[str] = []
        got = await unless_stopped(_after(0.0, ["entry"], seen), asyncio.Event())
        return got, seen

    assert asyncio.run(main()) == (["entry"], [])


def test_a_stop_cancels_the_call_and_gives_none() -> None:
    async def main() -> tuple[object, list[str], bool]:
        seen: list[str] = []
        stopping = asyncio.Event()
        asyncio.get_running_loop().call_later(0.01, stopping.set)
        got = await unless_stopped(_after(60.0, "late", seen), stopping)
        return got, seen, stopping.is_set()

    assert asyncio.run(main()) == (None, ["cancelled"], True)


def test_a_stop_already_set_still_takes_a_ready_result() -> None:
    async def main() -> object:
        stopping = asyncio.Event()
        stopping.set()
        ready = asyncio.get_running_loop().create_future()
        ready.set_result("ready")
        return await unless_stopped(ready, stopping)

    assert asyncio.run(main()) == "ready"


def test_the_calls_failure_is_raised() -> None:
    async def fails() -> None:
        raise ConnectionError("redis gone")

    with pytest.raises(ConnectionError, match="redis gone"):
        asyncio.run(unless_stopped(fails(), asyncio.Event()))


def test_cancelling_the_waiter_cancels_the_call() -> None:
    async def main() -> list[str]:
        seen: list[str] = []
        waiter = asyncio.create_task(unless_stopped(_after(60.0, "x", seen), asyncio.Event()))
        await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        return seen

    assert asyncio.run(main()) == ["cancelled"]


def test_any_rival_ends_the_wait() -> None:
    """The gateway's use: a client's disconnect (any awaitable) in place of a stop."""

    async def main() -> tuple[object, object, list[str]]:
        seen: list[str] = []
        beaten = await result_or_none(_after(60.0, "slow", seen), asyncio.sleep(0.01))
        won = await result_or_none(_after(0.0, "fast", seen), asyncio.sleep(60.0))
        return beaten, won, seen

    assert asyncio.run(main()) == (None, "fast", ["cancelled"])
