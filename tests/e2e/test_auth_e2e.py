"""API keys and the admin token on a real mesh started with MESHLLM_API_KEYS and
MESHLLM_ADMIN_TOKEN (the other e2e modules run without keys: auth off).

/v1/*, /tokenize and /detokenize need one of the keys; /health, /ready and /metrics stay open
for orchestrators; /admin/* takes the admin token, never an API key. A refused request is
refused before its body is read, so it is never queued.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from shared.streams import Streams
from tests.e2e.conftest import E2E_ENV
from tests.support.mesh import Mesh
from tests.support.stream_counts import entries_added

pytestmark = pytest.mark.e2e

KEYS = ("e2e-key-one", "e2e-key-two")
ADMIN_TOKEN = "e2e-admin-token"
ROUTES = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("POST", "/tokenize", {"prompt": "Hi"}),
    ("POST", "/detokenize", {"tokens": [1]}),
]


@pytest.fixture(scope="module")
def mesh(smollm2_dir: Path) -> Iterator[Mesh]:
    env = {**E2E_ENV, "MESHLLM_API_KEYS": ",".join(KEYS), "MESHLLM_ADMIN_TOKEN": ADMIN_TOKEN}
    with Mesh(env=env) as m:
        yield m


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def queued(mesh: Mesh) -> int:
    client = redis.Redis.from_url(mesh.redis.url)
    try:
        streams = Streams(mesh.cluster)  # the shared stream, and group 0's (routed requests)
        names = (streams.requests, streams.group_requests("0"))
        return sum(entries_added(client, s) for s in names)
    finally:
        client.close()


@pytest.mark.parametrize(
    "headers",
    [
        {},
        bearer("wrong-key"),
        {"Authorization": KEYS[0]},
        {"Authorization": f"Basic {KEYS[0]}"},
        bearer(ADMIN_TOKEN),
        bearer(f"{KEYS[0]}x"),
    ],
    ids=["none", "wrong", "no-scheme", "basic", "admin-token", "key-prefix"],
)
@pytest.mark.parametrize(("method", "route", "body"), ROUTES, ids=[r[1] for r in ROUTES])
def test_api_without_a_valid_key_is_401(
    mesh: Mesh, headers: dict[str, str], method: str, route: str, body: dict[str, Any] | None
) -> None:
    before = queued(mesh)
    resp = httpx.request(
        method, f"{mesh.url('gateway')}{route}", json=body, headers=headers, timeout=30
    )
    assert resp.status_code == 401, resp.text
    assert resp.json()["error"]["code"] == "invalid_api_key"
    assert queued(mesh) == before


def test_a_bad_body_without_a_key_is_401_not_400(mesh: Mesh) -> None:
    resp = httpx.post(f"{mesh.api}/completions", content=b"{not json", timeout=30)
    assert resp.status_code == 401


@pytest.mark.parametrize("key", KEYS)
def test_each_key_gets_a_completion(mesh: Mesh, key: str) -> None:
    client = openai.OpenAI(base_url=mesh.api, api_key=key, max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    resp = client.completions.create(
        model=model, prompt="Hello", max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None and resp.usage.completion_tokens == 2
    tokens = httpx.post(
        f"{mesh.url('gateway')}/tokenize", json={"prompt": "Hello"}, headers=bearer(key)
    )
    assert tokens.status_code == 200 and tokens.json()["count"] > 0


def test_openai_client_with_a_wrong_key_gets_authentication_error(mesh: Mesh) -> None:
    client = openai.OpenAI(base_url=mesh.api, api_key="not-a-key", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


@pytest.mark.parametrize("name", ["gateway", "scheduler", "worker"])
def test_health_ready_metrics_are_open(mesh: Mesh, name: str) -> None:
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{mesh.url(name)}{path}").status_code == 200, (name, path)


@pytest.mark.parametrize("name", ["gateway", "scheduler"])
def test_admin_state_needs_the_admin_token(mesh: Mesh, name: str) -> None:
    url = f"{mesh.url(name)}/admin/state"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers=bearer("wrong-token")).status_code == 403
    assert httpx.get(url, headers=bearer(KEYS[0])).status_code == 403  # an API key is not admin
    state = httpx.get(url, headers=bearer(ADMIN_TOKEN))
    assert state.status_code == 200
    assert state.json()["service"] == name
    assert state.json()["config"]["admin_token"] == "***"


def test_gateway_state_reports_keys_without_revealing_them(mesh: Mesh) -> None:
    state = mesh.admin_state("gateway")
    assert state["gateway"]["api_keys"] is True
    assert all(key not in str(state) for key in KEYS)
