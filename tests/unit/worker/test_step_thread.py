"""StepThread: every call on one OS thread, in submission order (OpenMP keeps one thread team
per calling thread, so a forward on a new thread would start a second team)."""

from __future__ import annotations

import asyncio
import threading

import torch

from services.worker.runner.step_thread import StepThread


def test_calls_share_one_thread_and_keep_their_order() -> None:
    step = StepThread()
    seen: list[tuple[int, int]] = []

    def work(i: int) -> int:
        seen.append((i, threading.get_ident()))
        return i * i

    async def main() -> list[int]:
        return list(await asyncio.gather(*(step.run(work, i) for i in range(16))))

    try:
        assert asyncio.run(main()) == [i * i for i in range(16)]
    finally:
        step.close()
    assert [i for i, _ in seen] == list(range(16))
    assert len({ident for _, ident in seen}) == 1
    assert seen[0][1] != threading.get_ident()


def test_keyword_arguments_and_torch_work_pass_through() -> None:
    step = StepThread()
    try:
        out = asyncio.run(step.run(torch.full, (2, 3), fill_value=7.0))
    finally:
        step.close()
    assert out.shape == (2, 3) and float(out.sum()) == 42.0
