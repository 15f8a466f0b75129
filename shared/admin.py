"""The admin HTTP app every service serves: health, readiness, metrics, state, actions.

Auth rules (one place for every service):
- `/health`, `/ready`, `/metrics` are always open (orchestrators and scrapers poll them).
- With an admin token configured, every `/admin/*` route needs `Authorization: Bearer <token>`:
  401 when the header is missing, 403 when the token is wrong.
- Without a token, `GET /admin/state` is open (read-only) and admin actions are refused with
  403: an unauthenticated action endpoint would let anyone on the network drain a service.
Errors use the OpenAI error body, `{"error": {"message", "type", "param", "code"}}`, like the
gateway's API, so one client-side error parser handles every meshllm endpoint.
"""

from __future__ import annotations

import hmac
from functools import cache
from importlib import metadata
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic_settings import BaseSettings
from starlette.responses import Response

from shared.metrics import metrics_response

if TYPE_CHECKING:
    from shared.service import Service


class AdminError(Exception):
    """An admin request refused with `status`; rendered as an OpenAI-style error body."""

    def __init__(self, status: int, message: str, type_: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code


def error_body(message: str, type_: str, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def _bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if header is None:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def check_admin(request: Request, token: str, *, action: bool) -> None:
    """Raise AdminError unless the request may use an admin route (see module docstring)."""
    if not token:
        if action:
            raise AdminError(
                403,
                "admin actions are disabled: set MESHLLM_ADMIN_TOKEN to enable them",
                "permission_error",
                "admin_disabled",
            )
        return
    given = _bearer_token(request)
    if given is None:
        raise AdminError(
            401,
            "missing admin token: send 'Authorization: Bearer <MESHLLM_ADMIN_TOKEN>'",
            "authentication_error",
            "missing_token",
        )
    if not hmac.compare_digest(given.encode(), token.encode()):
        raise AdminError(403, "invalid admin token", "permission_error", "invalid_token")


SECRET_FIELDS = frozenset({"admin_token", "api_keys", "redis_password"})


def redact_url(url: str) -> str:
    """`redis://user:secret@host` -> `redis://user:***@host`."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    userinfo = f"{parts.username or ''}:***"
    host = parts.hostname or ""
    netloc = f"{userinfo}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def describe_settings(settings: BaseSettings) -> dict[str, Any]:
    """The settings for /admin/state with secrets masked (the state route may be open)."""
    out: dict[str, Any] = {}
    for key, value in settings.model_dump().items():
        if key in SECRET_FIELDS:
            out[key] = "***" if value else ""
        elif key.endswith("_url") and isinstance(value, str):
            out[key] = redact_url(value)
        else:
            out[key] = value
    return out


@cache
def package_version() -> str:
    try:
        return metadata.version("meshllm")
    except metadata.PackageNotFoundError:
        return "unknown"


def build_admin_app(service: Service) -> FastAPI:
    """The service's HTTP app: admin routes plus `service.routes()`, then `configure_app`."""
    app = FastAPI(title=f"meshllm {service.name}", docs_url=None, redoc_url=None)
    token = service.settings.admin_token

    @app.exception_handler(AdminError)
    async def _admin_error(request: Request, exc: AdminError) -> JSONResponse:
        return JSONResponse(error_body(exc.message, exc.type, exc.code), status_code=exc.status)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "service": service.name}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ok, details = await service.check_ready()
        return JSONResponse(
            {"ready": ok, "service": service.name, **details}, status_code=200 if ok else 503
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return metrics_response()

    @app.get("/admin/state")
    async def admin_state(request: Request) -> dict[str, Any]:
        check_admin(request, token, action=False)
        return service.state()

    @app.post("/admin/actions/{name}")
    async def admin_action(name: str, request: Request) -> dict[str, Any]:
        check_admin(request, token, action=True)
        actions = service.admin_actions()
        if name not in actions:
            raise AdminError(
                404,
                f"unknown admin action {name!r}; available: {', '.join(sorted(actions))}",
                "invalid_request_error",
                "unknown_action",
            )
        return {"action": name, "result": await actions[name]()}

    for router in service.routes():
        app.include_router(router)
    service.configure_app(app)
    return app
