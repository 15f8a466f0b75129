"""What the scheduler hands back after a step, and its admin snapshot."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.protocol import RequestDelta, TokenDelta


@dataclass
class SchedulerOutput:
    """Token deltas grouped by reply stream (one TokenDelta message per stream), and the
    requests that finished in this update (their bus entries can now be acknowledged)."""

    deltas: dict[str, list[RequestDelta]] = field(default_factory=dict)
    finished_request_ids: list[str] = field(default_factory=list)

    def add(self, reply_stream: str, delta: RequestDelta) -> None:
        self.deltas.setdefault(reply_stream, []).append(delta)

    def token_deltas(self, scheduler_id: str) -> list[tuple[str, TokenDelta]]:
        """(stream, message) pairs ready for `Bus.publish_many`."""
        return [
            (stream, TokenDelta(scheduler_id=scheduler_id, deltas=deltas))
            for stream, deltas in self.deltas.items()
        ]


@dataclass(frozen=True)
class SchedulerSnapshot:
    """Counters for /admin/state and metrics (plain values: `dataclasses.asdict` is JSON)."""

    step_id: int
    num_running: int
    num_waiting: int
    num_free_blocks: int  # the attention pool's
    num_usable_blocks: int
    kv_usage_percent: float  # the fuller pool's (KVCacheManager.usage)
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_finished: int
    num_aborted: int
    num_step_failures: int
    # A hybrid model's state pool (0 = none: no state group, or one pool for both kinds).
    num_free_state_blocks: int = 0
    num_usable_state_blocks: int = 0
