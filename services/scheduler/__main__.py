"""`python -m services.scheduler`: wiring only."""

from __future__ import annotations

from services.scheduler.service import SchedulerService
from shared.config import SchedulerSettings
from shared.service import run_service

if __name__ == "__main__":
    run_service(SchedulerService(SchedulerSettings()))
