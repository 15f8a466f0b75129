"""The kvstore's HTTP API (`/v1/kv/*`): bodies and routes, nothing else.

Every body names the key space (model, layout version) its chunks belong to; a chunk is
(group, block hash in hex). Malformed bodies are refused with 422 and pydantic's message;
calls before the service has started get 503. The work is done by `KVStoreService`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from shared.kv.block_hash import HASH_BYTES
from shared.kv.offload_key import KeySpace, OffloadKey

if TYPE_CHECKING:
    from services.kvstore.service import KVStoreService

HEX_HASH = f"^[0-9a-fA-F]{{{2 * HASH_BYTES}}}$"
MAX_CHUNKS = 65_536


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ChunkRef(Body):
    group: int = Field(ge=0)
    hash: str = Field(pattern=HEX_HASH)

    def key(self) -> OffloadKey:
        return OffloadKey.from_hex(self.hash, self.group)


class ChunkAt(ChunkRef):
    end: int = Field(gt=0, description="tokens covered by the prefix this chunk ends")


class ChunkOfferBody(ChunkAt):
    nbytes: int = Field(ge=0)


class Scoped(Body):
    model: str = Field(min_length=1, max_length=512)
    layout_version: int = Field(default=1, ge=0)

    def space(self, cluster: str) -> KeySpace:
        return KeySpace(cluster, self.model, self.layout_version)


class LookupBody(Scoped):
    chunks: list[ChunkRef] = Field(max_length=MAX_CHUNKS)


class StoreBody(Scoped):
    request_id: str = Field(min_length=1)
    chunks: list[ChunkOfferBody] = Field(max_length=MAX_CHUNKS)


class StoredBody(Scoped):
    chunks: list[ChunkOfferBody] = Field(max_length=MAX_CHUNKS)
    ok: bool = True


class WritingBody(Scoped):
    """Chunks whose write begins now (their step's forward ended): their deadline restarts."""

    chunks: list[ChunkRef] = Field(max_length=MAX_CHUNKS)


class LoadBody(Scoped):
    holder: str = Field(min_length=1, description="request id, or a job id when internal")
    internal: bool = False  # a tier-to-tier move: pins, but is not an access
    chunks: list[ChunkAt] = Field(max_length=MAX_CHUNKS)


class LoadedBody(Scoped):
    holder: str = Field(min_length=1)
    chunks: list[ChunkRef] = Field(max_length=MAX_CHUNKS)


class FinishedBody(Body):
    request_id: str = Field(min_length=1)


def kv_router(get_service: Callable[[], KVStoreService | None]) -> APIRouter:
    router = APIRouter(prefix="/v1/kv")

    def ready() -> KVStoreService | JSONResponse:
        service = get_service()
        if service is None:
            body = {
                "error": {
                    "message": "kvstore is starting",
                    "type": "unavailable",
                    "param": None,
                    "code": "starting",
                }
            }
            return JSONResponse(body, status_code=503)
        return service

    @router.post("/lookup", response_model=None)
    async def lookup(body: LookupBody) -> Any:
        service = ready()
        return service if isinstance(service, JSONResponse) else service.lookup(body)

    @router.post("/store", response_model=None)
    async def store(body: StoreBody) -> Any:
        service = ready()
        return service if isinstance(service, JSONResponse) else await service.store(body)

    @router.post("/stored", response_model=None)
    async def stored(body: StoredBody) -> Any:
        service = ready()
        return service if isinstance(service, JSONResponse) else await service.stored(body)

    @router.post("/writing", response_model=None)
    async def writing(body: WritingBody) -> Any:
        service = ready()
        return service if isinstance(service, JSONResponse) else service.writing(body)

    @router.post("/load", response_model=None)
    async def load(body: LoadBody) -> Any:
        service = ready()
        return service if isinstance(service, JSONResponse) else service.load(body)

    @router.post("/loaded", response_model=None)
    async def loaded(body: LoadedBody) -> Any:
        service = ready()
        return service if isinstance(service, JSONResponse) else service.loaded(body)

    @router.post("/request_finished", response_model=None)
    async def request_finished(body: FinishedBody) -> Any:
        service = ready()
        return service if isinstance(service, JSONResponse) else service.request_finished(body)

    return router
