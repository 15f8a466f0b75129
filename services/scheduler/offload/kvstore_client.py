"""The kvstore's HTTP client, for the scheduler's offload connector (and tests).

One client per model key space. `existing` has the `ProbeBackend` shape, so
`AsyncLookup(client.existing)` probes the kvstore in one request per batch. HTTP and server
errors raise `KVStoreError`; `AsyncLookup` turns a failed probe into misses.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from services.scheduler.offload.window_scan import Verdict
from shared.kv.offload_key import OffloadKey

READY_STATUSES = frozenset({"ready", "pinned"})


class KVStoreError(Exception):
    pass


@dataclass(frozen=True, slots=True)
class StoreReply:
    write: list[OffloadKey]  # inserted WRITING: write these payloads, then report `stored`
    present: list[OffloadKey]
    refused: list[OffloadKey]
    evicted: int


def _ref(key: OffloadKey) -> dict[str, Any]:
    return {"group": key.group, "hash": key.block_hash.hex()}


def _keys(refs: list[dict[str, Any]]) -> list[OffloadKey]:
    return [OffloadKey.from_hex(r["hash"], int(r["group"])) for r in refs]


def verdict_of_status(status: str) -> Verdict:
    """A kvstore status as a lookup verdict (RETRY is the caller's: no answer yet)."""
    if status in READY_STATUSES:
        return Verdict.HIT
    return Verdict.HIT_PENDING if status == "writing" else Verdict.MISS


class KVStoreClient:
    def __init__(
        self,
        base_url: str,
        model: str,
        layout_version: int = 1,
        *,
        timeout_s: float = 5.0,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        self.model = model
        self.layout_version = layout_version
        self._http = http or httpx.AsyncClient(base_url=base_url, timeout=timeout_s)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if path != "request_finished":
            body = {"model": self.model, "layout_version": self.layout_version, **body}
        try:
            resp = await self._http.post(f"/v1/kv/{path}", json=body)
        except httpx.HTTPError as exc:
            raise KVStoreError(f"kvstore {path}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code != 200:
            raise KVStoreError(f"kvstore {path}: HTTP {resp.status_code}: {resp.text[:500]}")
        return dict(resp.json())

    async def lookup(self, keys: Sequence[OffloadKey]) -> list[str]:
        """Each key's status: "ready", "pinned", "writing" or "missing"."""
        reply = await self._post("lookup", {"chunks": [_ref(k) for k in keys]})
        return list(reply["statuses"])

    async def existing(self, keys: list[OffloadKey]) -> Collection[OffloadKey]:
        """The keys that can be read now (a `ProbeBackend`)."""
        statuses = await self.lookup(keys)
        return {k for k, s in zip(keys, statuses, strict=True) if s in READY_STATUSES}

    async def store(
        self, request_id: str, offers: Sequence[tuple[OffloadKey, int, int]]
    ) -> StoreReply:
        """Offer (key, end position, nbytes) chunks for store."""
        chunks = [{**_ref(k), "end": end, "nbytes": n} for k, end, n in offers]
        reply = await self._post("store", {"request_id": request_id, "chunks": chunks})
        return StoreReply(
            _keys(reply["write"]),
            _keys(reply["present"]),
            _keys(reply["refused"]),
            int(reply["evicted"]),
        )

    async def writing(self, keys: Sequence[OffloadKey]) -> int:
        """The step computing these chunks ended: their write deadline restarts now."""
        reply = await self._post("writing", {"chunks": [_ref(k) for k in keys]})
        return int(reply["restarted"])

    async def stored(self, offers: Sequence[tuple[OffloadKey, int, int]], ok: bool) -> int:
        chunks = [{**_ref(k), "end": end, "nbytes": n} for k, end, n in offers]
        return int((await self._post("stored", {"chunks": chunks, "ok": ok}))["completed"])

    async def load(
        self, holder: str, reads: Sequence[tuple[OffloadKey, int]], *, internal: bool = False
    ) -> list[OffloadKey]:
        chunks = [{**_ref(k), "end": end} for k, end in reads]
        reply = await self._post("load", {"holder": holder, "internal": internal, "chunks": chunks})
        return _keys(reply["pinned"])

    async def loaded(self, holder: str, keys: Sequence[OffloadKey]) -> int:
        reply = await self._post("loaded", {"holder": holder, "chunks": [_ref(k) for k in keys]})
        return int(reply["released"])

    async def request_finished(self, request_id: str) -> dict[str, Any]:
        return await self._post("request_finished", {"request_id": request_id})
