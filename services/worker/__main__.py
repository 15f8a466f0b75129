"""`python -m services.worker`: wiring only."""

from __future__ import annotations

from services.worker.service import WorkerService
from shared.config import WorkerSettings
from shared.service import run_service

if __name__ == "__main__":
    run_service(WorkerService(WorkerSettings()))
