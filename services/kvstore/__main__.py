"""`python -m services.kvstore`: wiring only."""

from __future__ import annotations

from services.kvstore.service import KVStoreService
from shared.config import KVStoreSettings
from shared.service import run_service

if __name__ == "__main__":
    run_service(KVStoreService(KVStoreSettings()))
