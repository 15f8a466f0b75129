"""The waiting queue of the scheduling policy (vLLM v1's request_queue.py, pure).

The scheduler uses a handful of deque operations on it: `append` (a new request), `appendleft`
/ `extendleft` (requests going back: preempted, requeued after a failed step or a worker
reset, after a KV load, held ones put back), `popleft` and `[0]` (admission takes the head),
`remove` (an abort), `len` and iteration.
- "fcfs": a plain deque. New requests queue at the back; requests going back go to the front
  in their order, since they arrived before anything still waiting.
- "priority": every insert is ordered by `priority_key` wherever the deque would have put it,
  so a request going back returns to its place by (priority, arrival): ahead of later arrivals
  of its priority, behind any more urgent request (vLLM's heap keyed the same way). A sorted
  list rather than a heap: aborts remove from the middle and snapshots list the queue in
  order, while the queue stays small (gateways bound what they route to a group).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Protocol

from services.scheduler.config import SchedulingPolicy
from services.scheduler.request import Request


def priority_key(request: Request) -> tuple[int, float, int]:
    """Lower is served sooner: vLLM's (priority, arrival_time), then the scheduler's intake
    order, so requests arriving at the same time (the n choices of one call) keep theirs."""
    return request.priority, request.arrival_time, request.arrival_seq


class WaitingQueue(Protocol):
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...
    def __getitem__(self, index: int, /) -> Request: ...
    def append(self, request: Request, /) -> None: ...
    def appendleft(self, request: Request, /) -> None: ...
    def extendleft(self, requests: Iterable[Request], /) -> None: ...
    def popleft(self) -> Request: ...
    def remove(self, request: Request, /) -> None: ...


class PriorityWaitingQueue:
    """Requests in `priority_key` order, whichever end the caller names."""

    __slots__ = ("_requests",)

    def __init__(self) -> None:
        self._requests: list[Request] = []

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)

    def __getitem__(self, index: int, /) -> Request:
        return self._requests[index]

    def append(self, request: Request, /) -> None:
        bisect.insort(self._requests, request, key=priority_key)

    appendleft = append  # a request going back keeps its arrival: its key says where

    def extendleft(self, requests: Iterable[Request], /) -> None:
        for request in requests:
            self.append(request)

    def popleft(self) -> Request:
        return self._requests.pop(0)

    def remove(self, request: Request, /) -> None:
        self._requests.remove(request)


def waiting_queue(policy: SchedulingPolicy) -> WaitingQueue:
    return deque() if policy == "fcfs" else PriorityWaitingQueue()
