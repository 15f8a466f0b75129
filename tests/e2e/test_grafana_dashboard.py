"""The Grafana dashboard (infra/grafana/meshllm.json) queries only metrics a running mesh
exports: every `meshllm:` series named in a panel or variable query is scraped from the live
/metrics of a real mesh (gateway, scheduler, worker, grammar, kvstore as processes) after it
served requests. Histogram `_bucket/_sum/_count` and counter `_total` series are matched against
the families the expositions declare, so a panel on a labelled metric that has not been
observed yet still counts as exported, and a misspelt or removed metric fails."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import E2E_ENV
from tests.support.mesh import Mesh
from tests.support.prometheus_names import exposition_names, query_names

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

DASHBOARD = Path(__file__).resolve().parents[2] / "infra" / "grafana" / "meshllm.json"
SERVICES = ("gateway", "scheduler", "worker", "grammar", "kvstore")
# What an operator looks for first: each must be on the dashboard.
REQUIRED = {
    "meshllm:request_success_total",  # requests
    "meshllm:time_to_first_token_seconds_bucket",  # TTFT
    "meshllm:inter_token_latency_seconds_bucket",  # TPOT
    "meshllm:request_generation_tokens_sum",  # tokens/s
    "meshllm:num_requests_waiting",  # queue depth
    "meshllm:kv_cache_usage_perc",  # KV usage
    "meshllm:prefix_cache_hit_rate",  # cache hit ratio
    "meshllm:kv_offload_stored_bytes_total",  # offload bytes
    "meshllm:worker_step_failures_total",  # errors
}


def dashboard_queries(dashboard: dict[str, Any]) -> list[str]:
    queries = []
    for panel in dashboard["panels"]:
        queries += [t["expr"] for t in panel.get("targets", [])]
        for inner in panel.get("panels", []):  # collapsed rows hold their panels
            queries += [t["expr"] for t in inner.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            queries.append(query["query"])
    return queries


@pytest.fixture(scope="module")
def mesh(smollm2_dir: Path) -> Iterator[Mesh]:
    mesh = Mesh(services=SERVICES, env=E2E_ENV)
    mesh.extra_env["MESHLLM_KV_OFFLOAD"] = "true"  # its offload panels need the tier on
    with mesh:
        yield mesh


def test_dashboard_names_only_metrics_the_mesh_exports(mesh: Mesh) -> None:
    client = openai.OpenAI(base_url=mesh.api, api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    for prompt in ("What is the capital of France?", "Name a colour."):
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=8
        )
        assert reply.choices[0].finish_reason in ("stop", "length")

    exported: set[str] = set()
    for name in SERVICES:
        response = httpx.get(f"{mesh.url(name)}/metrics", timeout=10)
        assert response.status_code == 200, name
        exported |= exposition_names(response.text)

    dashboard = json.loads(DASHBOARD.read_text())
    used: set[str] = set()
    for query in dashboard_queries(dashboard):
        names = query_names(query)
        assert names, f"a query names no meshllm metric: {query}"
        used |= names
    assert used - exported == set(), f"not exported by a running mesh: {sorted(used - exported)}"
    assert used >= REQUIRED, sorted(REQUIRED - used)


def test_exposition_parsing_bites() -> None:
    """The comparison is not vacuous: a histogram family yields its series, and a name the
    exposition lacks is missing from it."""
    text = (
        "# TYPE meshllm:x_seconds histogram\n"
        'meshllm:x_seconds_bucket{le="1.0"} 1.0\n'
        "# TYPE meshllm:y counter\n"
    )
    names = exposition_names(text)
    assert {"meshllm:x_seconds_bucket", "meshllm:x_seconds_count", "meshllm:y_total"} <= names
    # A labelled counter with no sample yet, as prometheus-client 0.26 declares it.
    assert "meshllm:w_total" in exposition_names("# TYPE meshllm:w_total counter\n")
    assert "meshllm:z" not in names
    query = 'histogram_quantile(0.9, sum by (le) (rate(meshllm:x_seconds_bucket{a="b"}[5m])))'
    assert query_names(query) == {"meshllm:x_seconds_bucket"}
