"""Prometheus helpers shared by every service.

Metric objects live beside the code that updates them (a counter in the bus, histograms in the
gateway); this module only fixes the naming convention and serves the default registry. Names
follow vLLM's (`vllm:num_requests_running` -> `meshllm:num_requests_running`) so existing
dashboards translate by prefix.
"""

from __future__ import annotations

import os

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from starlette.responses import Response

PREFIX = "meshllm:"


def metric_name(name: str) -> str:
    """`num_requests_running` -> `meshllm:num_requests_running`."""
    return name if name.startswith(PREFIX) else PREFIX + name


def metrics_response(registry: CollectorRegistry = REGISTRY) -> Response:
    """The Prometheus text exposition of `registry`, with its proper content type. Under
    prometheus-client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR: a gateway's API
    processes), the default registry's view is every process's values, merged."""
    if registry is REGISTRY and os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
