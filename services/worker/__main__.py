"""`python -m services.worker`: wiring only."""

from __future__ import annotations

from services.worker.kernel_cache import persist_triton_cache
from services.worker.onednn_caches import bound_onednn_caches
from shared.config import WorkerSettings
from shared.service import run_service


def main() -> None:
    settings = WorkerSettings()
    bound_onednn_caches(settings.onednn_cache_entries)  # before anything imports torch
    persist_triton_cache(settings.model_cache_dir)  # and Triton
    from services.worker.service import WorkerService

    run_service(WorkerService(settings))


if __name__ == "__main__":
    main()
