"""Schema-driven fuzzing of the gateway's OpenAPI document against the real mesh.

schemathesis reads the gateway's own /openapi.json (request bodies are documented there from
the gateway's pydantic models) and generates bodies for each POST route:
- positive: valid under the schema, though often not under the API's rules (token ids past the
  vocabulary, a user message without content), so most stop at validation;
- negative: violating the schema, or not JSON at all;
- sampling: a positive body's fields laid over a valid request (its prompt or messages kept),
  so that most cases get past validation and run in the scheduler and worker with fuzzed
  sampling parameters, penalties, logprobs, stop lists and output options.
Whatever arrives, the answer must not be a 5xx, an error must come in OpenAI's shape, a 200
stream must end cleanly, and afterwards every service is still healthy, no worker step failed,
and a normal request is served.

Generation is bounded so it stays quick on a CPU: a fixed number of examples per route and
mode, `max_tokens` (and `min_tokens`) capped at 4 and `n` at 2 wherever the generated value is
a number above them (a value the schema rejects is left alone: it must be refused).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.generation.case import Case

from tests.e2e.conftest import E2E_ENV
from tests.support.mesh import Mesh

pytestmark = pytest.mark.e2e

MAX_TOKENS = 4
MAX_N = 2
MAX_PROMPTS = 3

MODES = {
    "positive": GenerationMode.POSITIVE,
    "negative": GenerationMode.NEGATIVE,
    "sampling": GenerationMode.POSITIVE,
}
#: (route, mode, examples): 140 requests in all.
PLAN = [
    ("/v1/completions", "positive", 15),
    ("/v1/completions", "negative", 15),
    ("/v1/completions", "sampling", 15),
    ("/v1/chat/completions", "positive", 15),
    ("/v1/chat/completions", "negative", 15),
    ("/v1/chat/completions", "sampling", 15),
    ("/v1/responses", "positive", 10),
    ("/v1/responses", "negative", 10),
    ("/v1/responses", "sampling", 10),
    ("/tokenize", "positive", 10),
    ("/detokenize", "positive", 10),
]
#: The valid requests that "sampling" cases are laid over.
BASES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": "The capital of France is", "max_tokens": MAX_TOKENS},
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": MAX_TOKENS,
    },
    "/v1/responses": {"input": "What is the capital of France?", "max_output_tokens": MAX_TOKENS},
}
#: Each route's prompt fields: the "sampling" cases keep the base's.
PROMPT_FIELDS = {"prompt", "messages", "input", "instructions"}


@pytest.fixture(scope="module")
def mesh(smollm2_dir: Path) -> Iterator[Mesh]:
    """The whole generation path, grammar service included: fuzzed structured-output specs are
    compiled for real and constrain real decoding."""
    with Mesh(services=("gateway", "scheduler", "worker", "grammar"), env=E2E_ENV) as m:
        yield m


@pytest.fixture(scope="module")
def spec(mesh: Mesh) -> dict[str, Any]:
    out: dict[str, Any] = httpx.get(f"{mesh.url('gateway')}/openapi.json", timeout=10).json()
    for route in {route for route, _, _ in PLAN}:
        body = out["paths"][route]["post"].get("requestBody")
        assert body is not None, f"{route} documents no request body"
    return out


@pytest.fixture(scope="module")
def api_schema(spec: dict[str, Any]) -> Any:
    return schemathesis.openapi.from_dict(spec)


@pytest.fixture(scope="module")
def outcomes() -> Counter[tuple[str, str, int]]:
    """(route, mode, status) -> count, over the module."""
    return Counter()


@pytest.mark.parametrize(
    ("route", "mode", "examples"),
    PLAN,
    ids=[f"{route.strip('/').replace('/', '-')}-{mode}" for route, mode, _ in PLAN],
)
def test_fuzzed_bodies_never_get_a_5xx(
    mesh: Mesh,
    spec: dict[str, Any],
    api_schema: Any,
    outcomes: Counter[tuple[str, str, int]],
    route: str,
    mode: str,
    examples: int,
) -> None:
    operation = api_schema[route]["POST"]
    url = f"{mesh.url('gateway')}{route}"
    http = httpx.Client(timeout=120)
    schema = spec["paths"][route]["post"]["requestBody"]["content"]["application/json"]["schema"]
    fields = set(schema["properties"]) - PROMPT_FIELDS

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],  # no shrinking: each step is a real request to the mesh
        suppress_health_check=list(HealthCheck),
    )
    @given(operation.as_strategy(generation_mode=MODES[mode]))
    def check(case: Case) -> None:
        body = case.body
        if mode == "sampling":
            generated = body if isinstance(body, dict) else {}
            body = {**BASES[route], **{k: v for k, v in generated.items() if k in fields}}
        body = bounded(body)
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"content-type": "application/json"}
        with http.stream("POST", url, content=content, headers=headers) as resp:
            resp.read()
        outcomes[(route, mode, resp.status_code)] += 1
        context = f"{route} {content[:2000]!r} -> {resp.status_code} {resp.text[:500]}"
        assert resp.status_code < 500, context
        if resp.status_code >= 400:
            error = resp.json()["error"]
            assert error["message"] and error["type"], context
        elif resp.headers["content-type"].startswith("text/event-stream"):
            if route == "/v1/responses":
                check_response_events(resp.text, context)
            else:
                check_stream(resp.text, context)
        else:
            assert isinstance(resp.json(), dict), context

    try:
        check()
    finally:
        http.close()
    if mode == "sampling":
        # these cases must reach generation, not only validation
        assert outcomes[(route, mode, 200)] > 0, dict(outcomes)


def test_the_mesh_is_healthy_after_fuzzing(mesh: Mesh, model_name: str) -> None:
    for name in mesh.services:
        assert httpx.get(f"{mesh.url(name)}/health").status_code == 200, name
        assert httpx.get(f"{mesh.url(name)}/ready").status_code == 200, name
    body = {"model": model_name, "prompt": "Hello", "max_tokens": 3, "ignore_eos": True}
    resp = httpx.post(f"{mesh.api}/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 3
    state = mesh.admin_state("scheduler")
    assert state["scheduler"]["num_step_failures"] == 0
    assert state["running_request_ids"] == [] and state["waiting_request_ids"] == []
    assert mesh.admin_state("gateway")["gateway"]["in_flight"] == 0


def bounded(body: Any) -> Any:
    """Keep generation short: cap numeric max_tokens/min_tokens/n and the number of prompts."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens", "min_tokens"):
        if _number(body.get(key)) and body[key] > MAX_TOKENS:
            body[key] = MAX_TOKENS
    if body.get("max_tokens") is None:  # absent or null: the rest of the context
        body["max_tokens"] = MAX_TOKENS
    if body.get("max_output_tokens") is None:  # the Responses API's name for it
        body["max_output_tokens"] = MAX_TOKENS
    if _number(body.get("n")) and body["n"] > MAX_N:
        body["n"] = MAX_N
    if isinstance(body.get("prompt"), list) and len(body["prompt"]) > MAX_PROMPTS:
        body["prompt"] = body["prompt"][:MAX_PROMPTS]
    return body


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_stream(text: str, context: str) -> None:
    """A 200 stream: JSON events, no error event (a failure mid-stream), then [DONE]."""
    events = [e for e in text.split("\n\n") if e]
    assert events and events[-1] == "data: [DONE]", context
    for event in events[:-1]:
        assert event.startswith("data: "), context
        payload = json.loads(event.removeprefix("data: "))
        assert "error" not in payload, context


def check_response_events(text: str, context: str) -> None:
    """A 200 Responses stream: typed JSON events numbered in order, ending in the response's
    completion (no failure event)."""
    events = [e for e in text.split("\n\n") if e]
    types = []
    for i, event in enumerate(events):
        head, data = event.split("\n", 1)
        payload = json.loads(data.removeprefix("data: "))
        assert head == f"event: {payload['type']}", context
        assert payload["sequence_number"] == i, context
        types.append(payload["type"])
    assert types[0] == "response.created", context
    assert types[-1] in ("response.completed", "response.incomplete"), context
    assert "error" not in types and "response.failed" not in types, context
