"""The admin app's routes and auth rules, in-process (no Redis: the service is not started)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
from fastapi import APIRouter

from shared.admin import build_admin_app, describe_settings, redact_url
from shared.config import GatewaySettings, GrammarSettings
from shared.service import Service


class ToyService(Service):
    """A minimal real subclass: an extra route and an extra action that records its calls."""

    name = "grammar"

    def __init__(self, settings: GrammarSettings) -> None:
        super().__init__(settings)
        self.pokes = 0

    async def run(self) -> None:
        await self.stopping.wait()

    def admin_actions(self) -> dict[str, Callable[[], Awaitable[dict[str, Any]]]]:
        async def poke() -> dict[str, Any]:
            self.pokes += 1
            return {"pokes": self.pokes}

        return {**super().admin_actions(), "poke": poke}

    def routes(self) -> list[APIRouter]:
        router = APIRouter()

        @router.get("/v1/echo")
        async def echo() -> dict[str, str]:
            return {"from": self.name}

        return [router]


async def _client(service: Service) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=build_admin_app(service))
    async with httpx.AsyncClient(transport=transport, base_url="http://admin") as client:
        yield client


@pytest.fixture
async def with_token() -> AsyncIterator[tuple[ToyService, httpx.AsyncClient]]:
    service = ToyService(GrammarSettings(admin_token="tok-123"))
    async for client in _client(service):
        yield service, client


@pytest.fixture
async def without_token() -> AsyncIterator[tuple[ToyService, httpx.AsyncClient]]:
    service = ToyService(GrammarSettings(admin_token=""))
    async for client in _client(service):
        yield service, client


def _assert_openai_error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    return dict(error)


async def test_open_routes_need_no_token(with_token: tuple[ToyService, httpx.AsyncClient]) -> None:
    _, client = with_token
    assert (await client.get("/health")).json() == {"status": "ok", "service": "grammar"}
    metrics = await client.get("/metrics")
    assert metrics.status_code == 200
    assert metrics.headers["content-type"].startswith("text/plain")
    assert 'meshllm:service_ready{service="grammar"}' in metrics.text


async def test_not_ready_before_start(with_token: tuple[ToyService, httpx.AsyncClient]) -> None:
    _, client = with_token
    resp = await client.get("/ready")
    assert resp.status_code == 503
    body = resp.json()
    assert body["ready"] is False
    assert body["checks"]["service"] == "starting"


async def test_admin_routes_with_token(with_token: tuple[ToyService, httpx.AsyncClient]) -> None:
    service, client = with_token
    missing = _assert_openai_error(await client.get("/admin/state"), 401)
    assert "MESHLLM_ADMIN_TOKEN" in missing["message"]
    wrong = {"Authorization": "Bearer nope"}
    _assert_openai_error(await client.get("/admin/state", headers=wrong), 403)
    _assert_openai_error(await client.post("/admin/actions/poke", headers=wrong), 403)
    _assert_openai_error(await client.post("/admin/actions/poke"), 401)
    basic = {"Authorization": "Basic tok-123"}
    _assert_openai_error(await client.get("/admin/state", headers=basic), 403)
    assert service.pokes == 0

    good = {"Authorization": "Bearer tok-123"}
    state = (await client.get("/admin/state", headers=good)).json()
    assert state["service"] == "grammar"
    assert state["incarnation"] == service.incarnation
    assert state["config"]["admin_token"] == "***"
    resp = await client.post("/admin/actions/poke", headers=good)
    assert resp.json() == {"action": "poke", "result": {"pokes": 1}}
    unknown = _assert_openai_error(await client.post("/admin/actions/nope", headers=good), 404)
    assert "drain" in unknown["message"] and "poke" in unknown["message"]


async def test_without_token_state_is_open_and_actions_disabled(
    without_token: tuple[ToyService, httpx.AsyncClient],
) -> None:
    service, client = without_token
    assert (await client.get("/admin/state")).status_code == 200
    error = _assert_openai_error(await client.post("/admin/actions/poke"), 403)
    assert "MESHLLM_ADMIN_TOKEN" in error["message"]
    error = _assert_openai_error(await client.post("/admin/actions/drain"), 403)
    assert service.pokes == 0
    assert not service.stopping.is_set()


async def test_drain_action_stops_taking_work(
    with_token: tuple[ToyService, httpx.AsyncClient],
) -> None:
    service, client = with_token
    resp = await client.post("/admin/actions/drain", headers={"Authorization": "Bearer tok-123"})
    assert resp.json()["result"] == {"drained": True, "stopping": True}
    assert service.stopping.is_set()


async def test_service_routes_are_served(
    without_token: tuple[ToyService, httpx.AsyncClient],
) -> None:
    _, client = without_token
    assert (await client.get("/v1/echo")).json() == {"from": "grammar"}


def test_state_config_masks_secrets() -> None:
    settings = GatewaySettings(
        admin_token="adm", api_keys="k1,k2", redis_url="redis://gateway:pw@redis:6379/0"
    )
    config = describe_settings(settings)
    assert config["admin_token"] == "***"
    assert config["api_keys"] == "***"
    assert config["redis_url"] == "redis://gateway:***@redis:6379/0"
    assert config["grammar_timeout_s"] == settings.grammar_timeout_s  # plain values as they are
    assert "pw" not in str(config) and "k1" not in str(config)


def test_redact_url_leaves_urls_without_password() -> None:
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert redact_url("redis://:pw@h:1/0") == "redis://:***@h:1/0"
