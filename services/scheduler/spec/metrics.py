"""Prometheus export of the acceptance counters, with vLLM's spec-decode metric names."""

from __future__ import annotations

from prometheus_client import Counter

from services.scheduler.spec.stats import SpecDecodeStats
from shared.metrics import metric_name


class SpecDecodeMetrics:
    """Counters fed from a scheduler core's SpecDecodeStats by difference, so the core keeps
    plain integers (no prometheus in the core) and a rebuilt core (new stats) starts over
    without the counters ever going down."""

    def __init__(self) -> None:
        self.num_drafts = Counter(
            metric_name("spec_decode_num_drafts"), "Verifications of a request with drafts"
        )
        self.num_draft_tokens = Counter(
            metric_name("spec_decode_num_draft_tokens"), "Draft tokens verified"
        )
        self.num_accepted_tokens = Counter(
            metric_name("spec_decode_num_accepted_tokens"), "Draft tokens accepted"
        )
        self.accepted_per_pos = Counter(
            metric_name("spec_decode_num_accepted_tokens_per_pos"),
            "Draft tokens accepted, by draft position (0-based)",
            ["position"],
        )
        self._source: SpecDecodeStats | None = None
        self._seen = SpecDecodeStats()

    def export(self, stats: SpecDecodeStats) -> None:
        if stats is not self._source:
            self._source, self._seen = stats, SpecDecodeStats()
        seen = self._seen
        self.num_drafts.inc(stats.num_drafts - seen.num_drafts)
        self.num_draft_tokens.inc(stats.num_draft_tokens - seen.num_draft_tokens)
        self.num_accepted_tokens.inc(stats.num_accepted_tokens - seen.num_accepted_tokens)
        for pos, count in enumerate(stats.accepted_per_pos):
            before = seen.accepted_per_pos[pos] if pos < len(seen.accepted_per_pos) else 0
            if count > before:
                self.accepted_per_pos.labels(position=str(pos)).inc(count - before)
        self._seen = SpecDecodeStats(
            stats.num_drafts,
            stats.num_draft_tokens,
            stats.num_accepted_tokens,
            list(stats.accepted_per_pos),
        )


SPEC_METRICS = SpecDecodeMetrics()
