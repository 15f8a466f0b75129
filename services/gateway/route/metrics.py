"""Routing and per-group load metrics (`meshllm:` names; vLLM's where vLLM has the quantity).

Every gateway exports each ready group's load as its beats report it, labelled by group, so one
scrape of any gateway shows the whole mesh (the autoscaling signal: queue depth per group):
- group_num_requests_waiting / group_num_requests_running / group_kv_cache_usage_perc (vLLM's
  num_requests_waiting, num_requests_running, kv_cache_usage_perc, per group);
- group_cached_blocks: prefix blocks the group reported holding (the KV index);
and this gateway's decisions:
- router_decisions_total{policy, group}; router_balanced_total{group} (kv decisions the balance
  rule gave a less loaded group than the cost chose); requests_shed_total{reason} (429s past
  the queue bounds); router_prompt_tokens_total and router_overlap_tokens_total (prompt tokens
  routed, and of them those the chosen group held in cache when routed: the expected hit
  ratio).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from services.gateway.route.router import Candidate, Decision, Router
from shared.metrics import metric_name

GROUP_WAITING = Gauge(
    metric_name("group_num_requests_waiting"),
    "Requests queued in a group",
    ["group"],
    multiprocess_mode="mostrecent",
)
GROUP_RUNNING = Gauge(
    metric_name("group_num_requests_running"),
    "Requests in a group's running batch",
    ["group"],
    multiprocess_mode="mostrecent",
)
GROUP_KV_USAGE = Gauge(
    metric_name("group_kv_cache_usage_perc"),
    "A group's KV cache usage, 0 to 1",
    ["group"],
    multiprocess_mode="mostrecent",
)
GROUP_CACHED_BLOCKS = Gauge(
    metric_name("group_cached_blocks"),
    "Prefix blocks a group reports holding",
    ["group"],
    multiprocess_mode="mostrecent",
)
ROUTER_DECISIONS = Counter(
    metric_name("router_decisions"), "Requests routed, by policy and group", ["policy", "group"]
)
ROUTER_BALANCED = Counter(
    metric_name("router_balanced"),
    "kv decisions the balance rule gave a less loaded group than the cost chose",
    ["group"],
)
REQUESTS_SHED = Counter(
    metric_name("requests_shed"), "Requests refused with 429 past a queue bound", ["reason"]
)
ROUTER_PROMPT_TOKENS = Counter(metric_name("router_prompt_tokens"), "Prompt tokens routed")
ROUTER_OVERLAP_TOKENS = Counter(
    metric_name("router_overlap_tokens"), "Routed prompt tokens the chosen group had cached"
)

_exported: set[str] = set()


def export_groups(candidates: list[Candidate], router: Router) -> None:
    """Set the per-group gauges; groups no longer ready lose their series."""
    now = {c.group for c in candidates}
    for c in candidates:
        GROUP_WAITING.labels(c.group).set(c.load.num_waiting)
        GROUP_RUNNING.labels(c.group).set(c.load.num_running)
        GROUP_KV_USAGE.labels(c.group).set(c.load.kv_usage)
        GROUP_CACHED_BLOCKS.labels(c.group).set(router.index.num_blocks(c.group))
    for gone in _exported - now:
        for gauge in (GROUP_WAITING, GROUP_RUNNING, GROUP_KV_USAGE, GROUP_CACHED_BLOCKS):
            gauge.remove(gone)
    _exported.clear()
    _exported.update(now)


def count_decision(decision: Decision) -> None:
    if decision.group is None:
        REQUESTS_SHED.labels("queue_full").inc()
        return
    ROUTER_DECISIONS.labels(decision.reason, decision.group).inc()
    if decision.balanced:
        ROUTER_BALANCED.labels(decision.group).inc()
    ROUTER_PROMPT_TOKENS.inc(decision.prompt_tokens)
    ROUTER_OVERLAP_TOKENS.inc(decision.overlap_tokens)
