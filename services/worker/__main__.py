"""`python -m services.worker`: wiring only."""

from __future__ import annotations

from services.worker.onednn_caches import bound_onednn_caches
from shared.config import WorkerSettings
from shared.service import run_service


def main() -> None:
    settings = WorkerSettings()
    bound_onednn_caches(settings.onednn_cache_entries)  # before anything imports torch
    from services.worker.service import WorkerService

    run_service(WorkerService(settings))


if __name__ == "__main__":
    main()
