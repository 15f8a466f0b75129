"""Asynchronous existence probes against the slower offload tier, shared between requests.

The scheduler must never wait on Redis inside a step, so `lookup` answers from memory at once
with a `Verdict`: HIT (readable), HIT_PENDING (present, its write still in flight), MISS, or
RETRY ("ask again next step": no answer yet). Keys it could not answer are
probed in one batch per step by `flush()`, as an asyncio task that runs while the scheduler
keeps stepping (CONTRACTS.md: async lookups reuse the probe already in flight).

Per key there is one `KeyState`: a generation, a phase PENDING -> IN_FLIGHT -> RESOLVED, and a
verdict kept apart from the phase (a forced miss is a verdict without a probe). Requests attach
to the state by looking it up. The rules:
- a state is deleted only when no request holds it AND it is not in flight; so a request that
  looks a key up while an earlier request's probe is in flight attaches to that probe instead of
  starting a second one;
- a probe result for a key no request holds any more is dropped with the state (orphan
  reclaimed); a result whose generation is not the state's current one is ignored (the key was
  invalidated after the probe started, so its answer may be out of date);
- `mark_load_failed` forces a miss that sticks for as long as the state lives, so a chunk that
  cannot be read is not retried forever; a backend error counts as misses for the whole batch;
- a HIT_PENDING key is probed again at every flush until its write lands (HIT) or fails (MISS),
  and keeps answering HIT_PENDING meanwhile (a re-probe is not a new unknown). A key that has
  been pending for `max_pending_s` since it was first seen writing answers MISS from then on:
  the request recomputes rather than wait for a write that may never land.

Not thread-safe by design: lookups, flushes and results all run on the scheduler's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum

from services.scheduler.offload.verdict import Verdict

log = logging.getLogger(__name__)

ProbeKey = Hashable
ProbeBackend = Callable[[list[ProbeKey]], Awaitable[Mapping[ProbeKey, Verdict]]]
"""Takes keys, returns the verdict of those present (HIT or HIT_PENDING; a key left out is a
MISS). May raise: the batch then counts as misses."""


class Phase(Enum):
    PENDING = "pending"  # known to nobody yet; the next flush probes it
    IN_FLIGHT = "in_flight"
    RESOLVED = "resolved"


@dataclass
class KeyState:
    generation: int
    phase: Phase = Phase.PENDING
    verdict: Verdict | None = None
    forced_miss: bool = False
    pending_since: float | None = None  # first seen HIT_PENDING (clock time)
    requests: set[str] = field(default_factory=set)


class AsyncLookup:
    def __init__(
        self,
        backend: ProbeBackend,
        *,
        max_batch: int = 1024,
        max_pending_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.backend = backend
        self.max_batch = max_batch
        self.max_pending_s = max_pending_s
        self.clock = clock
        self.states: dict[ProbeKey, KeyState] = {}
        self._keys_of: dict[str, set[ProbeKey]] = {}
        self._generation = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self.probes_started = 0
        self.results_dropped = 0  # orphans and stale generations

    def _next_generation(self) -> int:
        self._generation += 1
        return self._generation

    def lookup(self, request_id: str, key: ProbeKey) -> Verdict:
        """The verdict for `key` (RETRY while unknown); attaches `request_id` to the key."""
        state = self.states.get(key)
        if state is None:
            state = self.states[key] = KeyState(self._next_generation())
        state.requests.add(request_id)
        self._keys_of.setdefault(request_id, set()).add(key)
        if state.forced_miss:
            return Verdict.MISS
        if state.verdict is Verdict.HIT_PENDING:  # answered, maybe being asked again
            if self._waited_too_long(state):
                state.verdict = Verdict.MISS
                return Verdict.MISS
            return Verdict.HIT_PENDING
        if state.phase is Phase.RESOLVED and state.verdict is not None:
            return state.verdict
        return Verdict.RETRY

    def _waited_too_long(self, state: KeyState) -> bool:
        since = state.pending_since
        return since is not None and self.clock() - since >= self.max_pending_s

    def request_finished(self, request_id: str) -> None:
        for key in self._keys_of.pop(request_id, ()):
            state = self.states[key]
            state.requests.discard(request_id)
            if not state.requests and state.phase is not Phase.IN_FLIGHT:
                del self.states[key]

    def invalidate(self, keys: Iterable[ProbeKey]) -> None:
        """The tier changed for `keys` (stored or evicted): their answers are out of date. A
        probe in flight for them will be ignored; the next flush probes them again."""
        for key in keys:
            state = self.states.get(key)
            if state is not None:
                state.generation = self._next_generation()
                state.phase = Phase.PENDING
                state.verdict = None

    def mark_load_failed(self, keys: Iterable[ProbeKey]) -> None:
        for key in keys:
            state = self.states.get(key)
            if state is not None:
                state.forced_miss = True
                state.verdict = Verdict.MISS
                if state.phase is Phase.PENDING:
                    state.phase = Phase.RESOLVED  # nothing to ask: the answer is fixed

    def flush(self) -> list[asyncio.Task[None]]:
        """Start one probe per batch of PENDING keys, and of resolved keys whose write was in
        flight (call once per step); returns the tasks."""
        pending = [
            k
            for k, s in self.states.items()
            if s.phase is Phase.PENDING
            or (s.phase is Phase.RESOLVED and s.verdict is Verdict.HIT_PENDING)
        ]
        tasks = []
        for begin in range(0, len(pending), self.max_batch):
            keys = pending[begin : begin + self.max_batch]
            batch = [(k, self.states[k].generation) for k in keys]
            for key, _ in batch:
                self.states[key].phase = Phase.IN_FLIGHT
            task = asyncio.create_task(self._probe(batch), name="kv-lookup-probe")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            tasks.append(task)
        self.probes_started += len(tasks)
        return tasks

    async def _probe(self, batch: list[tuple[ProbeKey, int]]) -> None:
        try:
            found = dict(await self.backend([k for k, _ in batch]))
        except asyncio.CancelledError:
            raise
        except Exception:
            log.warning(
                "offload lookup probe failed; %d keys count as misses", len(batch), exc_info=True
            )
            found = {}
        self._resolve(batch, found)

    def _resolve(
        self, batch: list[tuple[ProbeKey, int]], found: Mapping[ProbeKey, Verdict]
    ) -> None:
        for key, generation in batch:
            state = self.states.get(key)
            if state is None or state.generation != generation:
                self.results_dropped += 1  # stale: a newer probe (or none) owns the state
                continue
            if not state.requests:
                del self.states[key]  # orphan: everyone who asked has finished
                self.results_dropped += 1
                continue
            state.phase = Phase.RESOLVED
            verdict = Verdict.MISS if state.forced_miss else found.get(key, Verdict.MISS)
            if verdict is Verdict.HIT_PENDING:
                if state.pending_since is None:
                    state.pending_since = self.clock()
                elif self._waited_too_long(state):
                    verdict = Verdict.MISS  # a write that never lands is not waited for
            else:
                state.pending_since = None
            state.verdict = verdict

    async def close(self) -> None:
        """Cancel probes in flight (service shutdown)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def counts(self) -> dict[str, int]:
        by_phase = {p.value: 0 for p in Phase}
        for state in self.states.values():
            by_phase[state.phase.value] += 1
        return {
            "keys": len(self.states),
            "requests": len(self._keys_of),
            **by_phase,
            "probes_started": self.probes_started,
            "results_dropped": self.results_dropped,
        }
