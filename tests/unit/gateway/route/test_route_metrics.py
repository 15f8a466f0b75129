"""The gateway's routing counters as a scrape reads them."""

from __future__ import annotations

from prometheus_client import REGISTRY

from services.gateway.route.metrics import count_decision
from services.gateway.route.router import Decision


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(f"meshllm:{name}", labels) or 0.0


def test_a_balanced_decision_is_counted_apart_and_with_the_others() -> None:
    before = (
        sample("router_decisions_total", policy="kv", group="7"),
        sample("router_balanced_total", group="7"),
    )
    count_decision(Decision("7", "kv", overlap_tokens=16, prompt_tokens=40, balanced=True))
    count_decision(Decision("7", "kv", overlap_tokens=32, prompt_tokens=40))
    assert sample("router_decisions_total", policy="kv", group="7") == before[0] + 2
    assert sample("router_balanced_total", group="7") == before[1] + 1


def test_a_refusal_is_shed_not_routed() -> None:
    before = sample("requests_shed_total", reason="queue_full")
    count_decision(Decision(None, "every group has 256 requests queued"))
    assert sample("requests_shed_total", reason="queue_full") == before + 1
