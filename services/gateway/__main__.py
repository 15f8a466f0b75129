"""`python -m services.gateway`: wiring only."""

from __future__ import annotations

from services.gateway.service import GatewayService
from shared.config import GatewaySettings
from shared.service import run_service

if __name__ == "__main__":
    run_service(GatewayService(GatewaySettings()))
