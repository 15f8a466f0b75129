"""API keys for the OpenAI routes (`MESHLLM_API_KEYS`, comma-separated).

With keys configured, /v1/*, /tokenize and /detokenize need `Authorization: Bearer <key>`;
without, they are open. /health, /ready and /metrics are never behind a key (orchestrators poll
them), and /admin/* uses the admin token instead (shared/admin.py). Keys are compared in
constant time.
"""

from __future__ import annotations

import hmac

from services.gateway.api.errors import OpenAIError


class ApiKeyAuth:
    def __init__(self, keys: list[str]) -> None:
        self._keys = [k.encode() for k in keys if k]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, authorization: str | None) -> None:
        """Raise a 401 (OpenAI's body) unless the header carries a configured key."""
        if not self._keys:
            return
        scheme, _, token = (authorization or "").partition(" ")
        given = token.strip().encode()
        # Compare with every key, so timing does not reveal which one nearly matched.
        ok = False
        for key in self._keys:
            ok |= hmac.compare_digest(given, key)
        if scheme.lower() != "bearer" or not ok:
            raise OpenAIError(
                401,
                "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
