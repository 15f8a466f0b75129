"""`python -m services.gateway`: wiring only.

The imports are in main(): the planning pool's processes are started with `spawn`, which imports
this module in each of them (as `__mp_main__`), and they need none of the service.
"""

from __future__ import annotations


def main() -> None:
    from shared.config import GatewaySettings

    settings = GatewaySettings()
    if settings.api_processes > 1:
        import sys

        from services.gateway.api_processes import serve_api_processes

        sys.exit(serve_api_processes(settings))
    from services.gateway.service import GatewayService
    from shared.service import run_service

    run_service(GatewayService(settings))


if __name__ == "__main__":
    main()
