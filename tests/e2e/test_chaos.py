"""Chaos: one fault at a time under concurrent load, on the whole mesh (gateway, scheduler,
worker, grammar, kvstore with KV offload on) running with the Redis ACLs, as `make up` does.

For each fault (kill -9 of every service and of redis-server, a 40 s Redis freeze, a Redis
restart, a frozen worker) six greedy requests run through the `openai` client, three streamed,
three not. Each must either complete with exactly the text of an undisturbed run, or fail with a
clear error (an HTTP error with an OpenAI error body, or an error event in the stream; a cut
connection only where the gateway itself died); none may hang past its deadline; and a fresh
request must be served again within RECOVERY_BOUND_S of the fault's end (a killed process is
restarted at once, as the launcher's supervisor and compose's `restart:` do). Completed, failed
and hung counts and the recovery time are printed per fault (`pytest -s`).

Faults this module does not repeat: a worker or scheduler killed mid-decode with sampled
requests (test_crash_recovery.py), a gateway whose requests are orphaned (test_orphaned_requests),
the launcher restarting what dies (test_launcher_supervision.py), poison entries
(test_poison_requests.py). The 40 s freeze here outlasts the shortened timeouts below, as
test_redis_outage.py's 15 s one does, and also the default gateway heartbeat bound (30 s).
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.conftest import E2E_ENV
from tests.support.mesh import Mesh

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

SERVICES = ("gateway", "scheduler", "worker", "grammar", "kvstore")
MAX_TOKENS = 32
PROGRESS_TIMEOUT_S = 60.0  # outlasts the 40 s freeze and a worker restart (model load)
FROZEN_WORKER_PROGRESS_S = 4.0  # the gateway's bound in the frozen-worker case
REDIS_FREEZE_S = 40.0
RECOVERY_BOUND_S = 90.0
ENV = {
    **E2E_ENV,
    "MESHLLM_OVERLAP_STEPS": "auto",  # the default CPU step loop
    "MESHLLM_KV_OFFLOAD": "true",  # the kvstore is on the request path
    "MESHLLM_KVSTORE_RETRY_S": "1.0",
    "MESHLLM_HEARTBEAT_INTERVAL_S": "0.5",
    "MESHLLM_REDIS_TIMEOUT_S": "1",
    "MESHLLM_PUBLISH_TIMEOUT_S": "3",
    "MESHLLM_GATEWAY_TIMEOUT_S": "4",
    "MESHLLM_CLAIM_IDLE_MS": "3000",
    "MESHLLM_STEP_TIMEOUT_S": "10",
    "MESHLLM_PROGRESS_TIMEOUT_S": str(PROGRESS_TIMEOUT_S),
}
PROMPTS = [
    "Count from one to twenty in words.",
    "Describe a lighthouse at night.",
    "List some colours of the rainbow.",
    "Write about a cat on a windowsill.",
    "Explain what a compiler does.",
    "Tell me about the moon.",
]
STREAMED = (0, 2, 4)


@pytest.fixture(scope="module")
def mesh(smollm2_dir: Path) -> Iterator[Mesh]:
    with Mesh(services=SERVICES, env=ENV, acl=True) as m:
        yield m


def api(mesh: Mesh, timeout: float = 300) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.api, api_key="x", max_retries=0, timeout=timeout)


def generate(client: openai.OpenAI, model: str, i: int) -> str:
    """Request i to the end: its text; raises whatever the client raised."""
    params = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPTS[i]}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},  # runs its full length: in flight at the fault
    }
    if i not in STREAMED:
        reply = client.chat.completions.create(**params)  # type: ignore[call-overload]
        return reply.choices[0].message.content or ""
    text = ""
    for chunk in client.chat.completions.create(stream=True, **params):  # type: ignore[call-overload]
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    return text


def is_clear_error(exc: BaseException, connection_ok: bool) -> bool:
    """An OpenAI-style error (status error with a body, or a stream's error event); a cut
    connection only when `connection_ok` (the gateway died)."""
    if isinstance(exc, openai.APIConnectionError | httpx.TransportError):
        return connection_ok
    if not isinstance(exc, openai.APIError) or not isinstance(exc.body, dict):
        return False
    error = exc.body.get("error", exc.body)  # a status error's body; an error event's object
    return isinstance(error, dict) and bool(error.get("message"))


@dataclass
class Load:
    """The six requests, each in a thread: outcome i is its text or the exception it raised."""

    mesh: Mesh
    model: str
    outcomes: dict[int, str | BaseException] = field(default_factory=dict)
    streamed_tokens: list[int] = field(default_factory=lambda: [0] * len(PROMPTS))

    def start(self) -> Load:
        self.threads = [threading.Thread(target=self._one, args=(i,)) for i in range(len(PROMPTS))]
        for thread in self.threads:
            thread.start()
        return self

    def _one(self, i: int) -> None:
        try:
            self.outcomes[i] = generate(api(self.mesh), self.model, i)
        except BaseException as exc:
            self.outcomes[i] = exc

    def wait_started(self) -> None:
        """Until every request is in flight on the engine (its prompt prefilled)."""
        deadline = time.monotonic() + 120
        while self.mesh.metric("scheduler", "meshllm:num_requests_running") < len(PROMPTS):
            assert time.monotonic() < deadline, "the load never started"
            assert not self.outcomes, self.outcomes
            time.sleep(0.05)

    def join(self, bound_s: float) -> int:
        """How many are still running `bound_s` from now (hung)."""
        deadline = time.monotonic() + bound_s
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return sum(thread.is_alive() for thread in self.threads)


@pytest.fixture(scope="module")
def baseline(mesh: Mesh) -> dict[int, str]:
    """The undisturbed run: the same six requests, concurrently."""
    model = api(mesh).models.list().data[0].id
    load = Load(mesh, model).start()
    assert load.join(300) == 0
    assert all(isinstance(text, str) and text for text in load.outcomes.values()), load.outcomes
    return load.outcomes  # type: ignore[return-value]


def serve_fresh(mesh: Mesh, since: float, probe: Callable[[openai.OpenAI], object]) -> float:
    """Seconds from `since` until `probe` succeeds (retried on any error)."""
    while True:
        try:
            probe(api(mesh, timeout=30))
            return time.monotonic() - since
        except (openai.APIError, httpx.HTTPError) as exc:
            elapsed = time.monotonic() - since
            assert elapsed < RECOVERY_BOUND_S, f"not serving {elapsed:.0f} s after: {exc}"
            time.sleep(0.25)


def plain_probe(client: openai.OpenAI) -> object:
    model = client.models.list().data[0].id
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )


def constrained_probe(tag: str) -> Callable[[openai.OpenAI], object]:
    """A structured-output request with a schema of its own: its grammar must be compiled by
    the grammar service that is running now."""
    schema = {"type": "object", "properties": {tag: {"type": "boolean"}}, "required": [tag]}

    def probe(client: openai.OpenAI) -> object:
        model = client.models.list().data[0].id
        return client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Answer in JSON."}],
            max_tokens=16,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": tag, "schema": schema}},
        )

    return probe


def kill_and_restart(name: str) -> Callable[[Mesh], None]:
    def fault(mesh: Mesh) -> None:
        mesh.kill(name)
        mesh.start_service(name)  # at once, as a supervisor would; not waited for

    return fault


def kill_redis(mesh: Mesh) -> None:
    assert mesh.redis.proc is not None
    mesh.redis.proc.kill()
    mesh.redis.proc.wait()
    mesh.redis.proc = None
    mesh.redis.start()  # same port, same ACL file, empty


def freeze_redis(mesh: Mesh) -> None:
    assert mesh.redis.proc is not None
    mesh.redis.proc.send_signal(signal.SIGSTOP)
    try:
        time.sleep(REDIS_FREEZE_S)
    finally:
        mesh.redis.proc.send_signal(signal.SIGCONT)


FAULTS: dict[str, Callable[[Mesh], None]] = {
    "gateway": kill_and_restart("gateway"),
    "scheduler": kill_and_restart("scheduler"),
    "worker": kill_and_restart("worker"),
    "grammar": kill_and_restart("grammar"),
    "kvstore": kill_and_restart("kvstore"),
    "redis-kill": kill_redis,
    "redis-freeze-40s": freeze_redis,
    "redis-restart": lambda mesh: mesh.redis.restart(),
}


def report(fault: str, load: Load, hung: int, recovery_s: float) -> tuple[int, int]:
    completed = sum(isinstance(o, str) for o in load.outcomes.values())
    failed = len(load.outcomes) - completed
    print(
        f"\nchaos {fault}: completed={completed} failed={failed} hung={hung} "
        f"recovery={recovery_s:.1f}s",
        flush=True,
    )
    return completed, failed


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_fault_under_load_loses_nothing_silently(
    mesh: Mesh, baseline: dict[int, str], fault: str
) -> None:
    model = api(mesh).models.list().data[0].id
    load = Load(mesh, model).start()
    load.wait_started()
    FAULTS[fault](mesh)
    over = time.monotonic()
    # Past the progress bound nothing may still be waiting: it completed or failed clearly.
    hung = load.join(PROGRESS_TIMEOUT_S + 30)
    ended_s = time.monotonic() - over
    probe = constrained_probe(f"after_{fault}".replace("-", "_"))
    recovery_s = serve_fresh(mesh, over, probe if fault == "grammar" else plain_probe)
    report(fault, load, hung, recovery_s)
    assert hung == 0
    for i, outcome in load.outcomes.items():
        if isinstance(outcome, str):
            assert outcome == baseline[i], (fault, i)
        else:
            assert is_clear_error(outcome, connection_ok=fault == "gateway"), (i, repr(outcome))
    if fault == "gateway":  # its clients' connections die with it, at once
        assert ended_s < 10
    for name in SERVICES:
        assert mesh.procs[name].poll() is None, f"{name} died:\n{mesh.tail(name)}"


WORDS_REGEX = r"[a-z]{3,8}( [a-z]{3,8}){11}"
WORDS_SCHEMA = {
    "type": "array",
    "items": {"type": "string", "pattern": "^[a-z]{1,8}$"},
    "minItems": 8,
    "maxItems": 8,
}


def constrained(client: openai.OpenAI, model: str, i: int) -> str:
    """Structured-output request i, seeded sampling (even: a JSON array of eight words; odd:
    twelve words by regex), long enough to be decoding when the worker freezes; streamed when
    i % 3 == 0."""
    params: dict[str, object] = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPTS[i]}],
        "max_tokens": 200,
        "temperature": 0.8,  # seeded sampling under the mask: the same tokens after a recompute
        "seed": 100 + i,
    }
    if i % 2 == 0:
        schema = {"name": "words", "schema": WORDS_SCHEMA}
        params["response_format"] = {"type": "json_schema", "json_schema": schema}
    else:
        params["extra_body"] = {"structured_outputs": {"regex": WORDS_REGEX}}
    if i % 3:
        reply = client.chat.completions.create(**params)  # type: ignore[call-overload]
        assert reply.choices[0].finish_reason == "stop", reply
        return reply.choices[0].message.content or ""
    text = ""
    for chunk in client.chat.completions.create(stream=True, **params):  # type: ignore[call-overload]
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    return text


def run_mixed(mesh: Mesh, model: str, during: Callable[[], None] | None = None) -> list:
    """The six constrained requests and the six free ones (Load) concurrently; `during` runs
    once all twelve are decoding. Outcomes: the constrained ones', then the free ones'."""
    outcomes: dict[int, str | BaseException] = {}

    def one(i: int) -> None:
        try:
            outcomes[i] = constrained(api(mesh), model, i)
        except BaseException as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    free = Load(mesh, model).start()
    if during is not None:
        deadline = time.monotonic() + 120
        while mesh.metric("scheduler", "meshllm:num_requests_running") < 2 * len(PROMPTS):
            assert time.monotonic() < deadline and not outcomes, outcomes
            time.sleep(0.02)
        during()
    for thread in threads:
        thread.join(PROGRESS_TIMEOUT_S + 30)
    assert not any(thread.is_alive() for thread in threads), "a constrained request hung"
    assert free.join(PROGRESS_TIMEOUT_S + 30) == 0, "a free request hung"
    return [outcomes[i] for i in range(len(PROMPTS))] + [
        free.outcomes[i] for i in range(len(PROMPTS))
    ]


def test_a_silent_worker_recomputes_constrained_requests_exactly(mesh: Mesh) -> None:
    """SIGSTOP the worker past its heartbeat bound while structured-output requests (seeded
    sampling) decode beside free ones: the scheduler declares it silent and recomputes every
    request (its grammar state kept), the thawed worker drops its old batch. Each request
    completes as in an undisturbed run, the constrained outputs within their grammar. (A soak
    once saw a 500 "the model produced token N, which the grammar does not allow" after a
    worker was declared silent; its cause was a constrained request planned ahead of its first
    token, tests/unit/scheduler/structured_output/test_scheduler_hooks.py.)"""
    model = api(mesh).models.list().data[0].id
    undisturbed = run_mixed(mesh, model)
    silent_s = max(5.0, 5 * float(ENV["MESHLLM_HEARTBEAT_INTERVAL_S"]))  # the scheduler's bound
    resets = mesh.metric("scheduler", "meshllm:worker_resets_total")

    def freeze() -> None:
        mesh.signal("worker", signal.SIGSTOP)
        try:
            time.sleep(silent_s + 2)
        finally:
            mesh.signal("worker", signal.SIGCONT)

    outcomes = run_mixed(mesh, model, freeze)
    assert mesh.metric("scheduler", "meshllm:worker_resets_total") > resets
    for i, (text, expected) in enumerate(zip(outcomes, undisturbed, strict=True)):
        assert isinstance(expected, str), (i, repr(expected))
        assert text == expected, (i, repr(text))
        if i >= len(PROMPTS):
            continue  # a free request
        if i % 2 == 0:
            words = json.loads(text)
            assert isinstance(words, list) and len(words) == 8
        else:
            assert re.fullmatch(WORDS_REGEX, text), text


def test_a_frozen_worker_ends_requests_at_the_progress_deadline(
    mesh: Mesh, baseline: dict[int, str]
) -> None:
    """SIGSTOP the worker: no token comes, so each request ends with a clear 504 (or error
    event) once FROZEN_WORKER_PROGRESS_S pass without one, the gateway stays healthy, and
    after SIGCONT the mesh serves again."""
    mesh.kill("gateway", signal.SIGTERM)
    mesh.restart("gateway", {"MESHLLM_PROGRESS_TIMEOUT_S": str(FROZEN_WORKER_PROGRESS_S)})
    model = api(mesh).models.list().data[0].id
    load = Load(mesh, model).start()
    load.wait_started()
    mesh.signal("worker", signal.SIGSTOP)
    frozen = time.monotonic()
    try:
        hung = load.join(FROZEN_WORKER_PROGRESS_S + 10)
        ended_s = time.monotonic() - frozen
        assert httpx.get(f"{mesh.url('gateway')}/health", timeout=5).status_code == 200
    finally:
        mesh.signal("worker", signal.SIGCONT)
    thawed = time.monotonic()
    recovery_s = serve_fresh(mesh, thawed, plain_probe)
    _, failed = report("worker-freeze", load, hung, recovery_s)
    print(f"chaos worker-freeze: every request ended {ended_s:.1f}s after the freeze")
    assert hung == 0 and failed > 0
    for i, outcome in load.outcomes.items():
        if isinstance(outcome, str):  # finished before the freeze took hold
            assert outcome == baseline[i]
        else:
            assert is_clear_error(outcome, connection_ok=False), repr(outcome)
            status = getattr(outcome, "status_code", None) or outcome.body.get("code")  # type: ignore[union-attr]
            assert status == 504, repr(outcome)
            assert "no progress for 4 s" in str(outcome), repr(outcome)
    assert mesh.procs["gateway"].poll() is None
