"""Request planning off the event loop: large bodies are planned in worker processes.

Parsing a body, rendering the chat template and tokenizing are CPU work the gateway does per
request, and for a large body it is seconds of it. On the event loop every other request (and
`/health`) would wait that long. Threads are not enough, measured on a 10 MB body: the Rust
tokenizer releases the GIL, but `json.loads` does not, and it holds the GIL ~0.3 s for 10 MB
of token ids and 1-4 s for 10 MB of small arrays (`[[],[],...]`: millions of containers and
the collector passes they trigger). So bodies of `inline_below` bytes or more go to a small
process pool whose workers each hold a Planner of their own, and only the plan (bounded by the
context length) or the error comes back. Smaller bodies are planned inline, where planning
costs less than the hop to a process.

Worker processes are started with `spawn` (the gateway has threads), get the tokenizer, the model
facts and the settings once, and ignore SIGINT (a terminal's Ctrl-C is for the gateway, which shuts
them down) and die with the gateway (shared/child_process.py). They run at a lower CPU priority
(nice +10), so the event loop gets the CPU first when a large body is being tokenized: on the 2-core
dev machine under load, /health during a 10 MB prompt answered in a median 2.5 ms (p99 15-20 ms)
with it, against 9-10 ms (p99 25-34 ms) at equal priority.

The tokenizer goes to them as its directory, loaded again there after the niceness is set: as a
pickle (~1.5 MB for SmolLM2's) the pipe write starting each process blocked the event loop until
that process had done its imports and read it, ~0.8 s a process at every gateway start and every
fresh pool, and the load ran at full priority beside the mesh's other services.

A worker that dies (killed, out of memory on a hostile body) breaks the pool: that request gets a
500, and a fresh pool takes the next ones.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, Literal

from prometheus_client import Gauge

from services.gateway.api.errors import OpenAIError
from services.gateway.plan.model_info import ModelInfo
from services.gateway.plan.planner import Planner
from services.gateway.plan.tokenization import PromptTokenizer
from shared.child_process import die_with_parent
from shared.config import GatewaySettings
from shared.metrics import metric_name

log = logging.getLogger(__name__)

Task = Literal["completion", "chat", "responses", "tokenize", "detokenize"]

#: ~1 ms of tokenization on the dev machine (about a thousand tokens of text).
INLINE_BELOW_BYTES = 4096
#: Added to the worker processes' niceness (see above).
WORKER_NICENESS = 10

REQUESTS_PLANNING = Gauge(
    metric_name("gateway_requests_planning"),
    "Requests being parsed, templated and tokenized in the gateway's planning processes",
    multiprocess_mode="livesum",
)


class PlanningPool:
    def __init__(
        self, planner: Planner, *, processes: int = 2, inline_below: int = INLINE_BELOW_BYTES
    ) -> None:
        self.planner = planner
        self.processes = max(1, processes)
        self.inline_below = inline_below
        self._executor: ProcessPoolExecutor | None = None

    def warm_up(self) -> None:
        """Start the worker processes now (each imports transformers and unpickles the
        tokenizer: seconds) rather than on the first large request. Does not wait."""
        executor = self._pool()
        for _ in range(self.processes):
            executor.submit(_ready).add_done_callback(_log_failure)

    async def run(self, task: Task, raw: bytes) -> Any:
        """The planner's `task` on `raw`: inline for a small body, else in a worker process.
        A caller that is cancelled (its client went away) stops waiting; a worker already on
        it finishes a plan that nothing uses."""
        if len(raw) < self.inline_below:
            return getattr(self.planner, task)(raw)
        REQUESTS_PLANNING.inc()
        try:
            future = self._submit(task, raw)
            return await asyncio.wrap_future(future)
        except BrokenProcessPool:
            log.error("a planning process died while planning a request; starting a fresh pool")
            raise OpenAIError(
                500, "the request could not be planned", type_="internal_server_error"
            ) from None
        finally:
            REQUESTS_PLANNING.dec()

    def close(self, wait: bool = False) -> None:
        """Stop the processes; `wait`: until they have exited. A gateway's own exit needs the
        wait when it is a multiprocessing child (an API process): its exit closes the work
        queue's feeder before the pool's manager thread has sent the stop messages, and then
        joins the processes, which never get them."""
        if self._executor is not None:
            self._executor.shutdown(wait=wait, cancel_futures=True)
            self._executor = None

    def _pool(self) -> ProcessPoolExecutor:
        if self._executor is None:
            planner = self.planner
            tokenizer = tokenizer_payload(planner.tokenizer)
            self._executor = ProcessPoolExecutor(
                max_workers=self.processes,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_start_worker,
                initargs=(tokenizer, planner.model, planner.settings, os.getpid()),
            )
        return self._executor

    def _submit(self, task: Task, raw: bytes) -> Future[Any]:
        """Submit to the pool, replacing a pool a worker died in: one that died since the last
        request (killed while idle) costs this request nothing; one that dies on it (the
        future fails) costs it a 500, and the next request gets a fresh pool."""
        executor = self._pool()
        try:
            return executor.submit(_run_in_worker, task, raw)
        except BrokenProcessPool:
            pass
        log.warning("the planning pool lost a worker process; starting a fresh pool")
        self._executor = None
        executor.shutdown(wait=False, cancel_futures=True)
        return self._pool().submit(_run_in_worker, task, raw)


def tokenizer_payload(tokenizer: PromptTokenizer) -> Path | Any:
    """What a worker process gets to build its tokenizer from: the directory it was loaded
    from, else the transformers tokenizer itself."""
    return tokenizer.source_dir if tokenizer.source_dir is not None else tokenizer.hf


def _log_failure(future: Future[None]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("a planning process failed to start: %r", future.exception())


# --- inside a worker process --------------------------------------------------------------------

_planner: Planner | None = None


def _start_worker(
    tokenizer: Path | Any, model: ModelInfo, settings: GatewaySettings, gateway_pid: int
) -> None:
    global _planner
    die_with_parent(gateway_pid)  # a gateway killed with SIGKILL leaves no planner behind
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.nice(WORKER_NICENESS)
    loaded = (
        PromptTokenizer.from_dir(tokenizer)
        if isinstance(tokenizer, Path)
        else PromptTokenizer(tokenizer)
    )
    _planner = Planner(loaded, model, settings)


def _ready() -> None:
    return None


def _run_in_worker(task: Task, raw: bytes) -> Any:
    assert _planner is not None, "the worker's initializer did not run"
    return getattr(_planner, task)(raw)
