"""A steady stream of real chat completions against the gateway while the stack changes shape.

`concurrency` client threads each send one request after another until stopped; every request
is recorded with its outcome, so a test can say how many failed during a scale or an update and
which ones. A request fails when it does not end in a 200 with a finished choice.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field

import httpx

REQUEST_TIMEOUT_S = 300  # a group restarting under the request recomputes it; that is slow here


@dataclass
class Outcome:
    started: float
    ended: float
    ok: bool
    detail: str = ""


@dataclass
class RequestLoad:
    api: str
    api_key: str
    model: str
    concurrency: int = 3
    max_tokens: int = 8
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _counter: itertools.count[int] = field(default_factory=itertools.count)

    def __enter__(self) -> RequestLoad:
        for i in range(self.concurrency):
            thread = threading.Thread(target=self._client, name=f"load-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop sending; wait for every request in flight to end (bounded by its timeout)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(REQUEST_TIMEOUT_S + 30)

    def wait_for(self, count: int, timeout: float) -> None:
        """Until `count` requests ended (the load is flowing), or fail."""
        deadline = time.monotonic() + timeout
        while len(self.outcomes) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"only {len(self.outcomes)} requests ended in {timeout} s")
            time.sleep(0.2)

    def failures(self) -> list[Outcome]:
        with self._lock:
            return [o for o in self.outcomes if not o.ok]

    def summary(self) -> str:
        with self._lock:
            done = list(self.outcomes)
        if not done:
            return "no requests"
        latencies = sorted(o.ended - o.started for o in done)
        return (
            f"{len(done)} requests, {sum(not o.ok for o in done)} failed, latency p50 "
            f"{latencies[len(latencies) // 2]:.1f} s max {latencies[-1]:.1f} s"
        )

    def _client(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"}
        with httpx.Client(base_url=self.api, headers=headers, timeout=REQUEST_TIMEOUT_S) as http:
            while not self._stop.is_set():
                n = next(self._counter)
                body = {
                    "model": self.model,
                    "messages": [{"role": "user", "content": f"Say the number {n}."}],
                    "max_tokens": self.max_tokens,
                    "temperature": 0,
                }
                started = time.monotonic()
                try:
                    response = http.post("/chat/completions", json=body)
                    finish = (
                        response.json()["choices"][0].get("finish_reason")
                        if response.status_code == 200
                        else None
                    )
                    ok = finish in ("stop", "length")
                    detail = "" if ok else f"{response.status_code} {response.text[:300]}"
                except httpx.HTTPError as exc:
                    ok, detail = False, f"{type(exc).__name__}: {exc}"
                with self._lock:
                    self.outcomes.append(Outcome(started, time.monotonic(), ok, detail))
