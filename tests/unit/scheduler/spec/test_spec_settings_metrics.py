"""MESHLLM_SPEC_* reach the scheduler core (K lookahead slots) and the worker's drafter;
the acceptance counters are exported under vLLM's names, by difference."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from services.scheduler.config import SchedulerConfig
from services.scheduler.spec.metrics import SPEC_METRICS
from services.scheduler.spec.stats import SpecDecodeStats
from shared.config import SchedulerSettings, WorkerSettings
from shared.protocol import WorkerReady

READY = WorkerReady(
    worker_id="w", incarnation="i", model="m", num_kv_blocks=64, block_size=16, vocab_size=100,
    max_model_len=256,
)  # fmt: skip


def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert SchedulerConfig.from_worker(SchedulerSettings(), READY).num_spec_tokens == 0
    monkeypatch.setenv("MESHLLM_SPEC_METHOD", "ngram")
    monkeypatch.setenv("MESHLLM_SPEC_TOKENS", "6")
    monkeypatch.setenv("MESHLLM_SPEC_MODEL", "/models/draft")
    assert SchedulerConfig.from_worker(SchedulerSettings(), READY).num_spec_tokens == 6
    worker = WorkerSettings()
    assert (worker.spec_method, worker.spec_tokens, worker.spec_model) == (
        "ngram",
        6,
        "/models/draft",
    )
    for method in ("eagle3", "mtp"):
        monkeypatch.setenv("MESHLLM_SPEC_METHOD", method)
        assert WorkerSettings().spec_method == method
    monkeypatch.setenv("MESHLLM_SPEC_METHOD", "medusa")
    with pytest.raises(ValueError):
        WorkerSettings()


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_metrics_follow_the_stats_by_difference() -> None:
    names = (
        "meshllm:spec_decode_num_drafts_total",
        "meshllm:spec_decode_num_draft_tokens_total",
        "meshllm:spec_decode_num_accepted_tokens_total",
    )
    before = [value(n) for n in names]
    pos1 = value("meshllm:spec_decode_num_accepted_tokens_per_pos_total", position="1")
    stats = SpecDecodeStats()
    stats.observe(3, 2)
    SPEC_METRICS.export(stats)
    stats.observe(3, 0)
    SPEC_METRICS.export(stats)
    SPEC_METRICS.export(stats)  # nothing new: nothing added
    assert [value(n) - b for n, b in zip(names, before, strict=True)] == [2, 6, 2]
    per_pos = value("meshllm:spec_decode_num_accepted_tokens_per_pos_total", position="1")
    assert per_pos - pos1 == 1
    fresh = SpecDecodeStats()  # a rebuilt core starts from zero; counters never go down
    fresh.observe(2, 1)
    SPEC_METRICS.export(fresh)
    assert value(names[0]) - before[0] == 3
