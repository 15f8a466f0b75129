"""The progress checkpoints' Redis side: one pipelined HSET/HDEL round every
`progress_checkpoint_s` (what goes in it: progress_book.py), and the HGET of a taken-over
entry's checkpoint (whether it is resumed from: resume.py, Scheduler.add_request).

Checkpoints are a shortcut, never a dependency: a round that fails is logged and written
again next time, and a checkpoint that cannot be read or decoded means a start from the
prompt. Only schedulers that serve requests whole write or read them (a P/D request restarts
from its prompt, as before).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from typing import Any

from prometheus_client import Counter, Histogram

from services.scheduler.progress_book import Progress, ProgressBook
from services.scheduler.scheduler import Scheduler
from shared.bus import Delivery
from shared.codec import CodecError, decode, encode
from shared.config import SchedulerSettings
from shared.metrics import metric_name
from shared.protocol import ProgressCheckpoint, SubmitRequest
from shared.streams import Streams

log = logging.getLogger(__name__)

RECENT = 64  # resumed requests listed in the admin state

RESUMED = Counter(
    metric_name("scheduler_requests_resumed"),
    "Requests taken over after a fault (delivered before), by where they continued from: "
    "their progress checkpoint, or their prompt (no usable checkpoint)",
    ["from"],
)
SKIPPED_TOKENS = Histogram(
    metric_name("scheduler_resumed_skipped_tokens"),
    "Output tokens a request resumed from its checkpoint did not generate again",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
)


class ProgressEdge:
    def __init__(
        self, redis: Any, streams: Streams, settings: SchedulerSettings, incarnation: str
    ) -> None:
        self.redis = redis
        self.streams = streams
        self.interval_s = settings.progress_checkpoint_s
        self.enabled = self.interval_s > 0 and settings.role == "both"
        self.book = ProgressBook(settings.instance_id, incarnation)
        self.next_round_at = 0.0
        self.num_rounds = 0
        self.num_resumed = 0
        self.num_from_prompt = 0
        self.recent: deque[tuple[str, int]] = deque(maxlen=RECENT)  # (request id, tokens)

    def key_of(self, delivery: Delivery) -> str:
        return self.streams.progress(delivery.stream)

    async def read(self, delivery: Delivery) -> ProgressCheckpoint | None:
        """The checkpoint of `delivery`'s request, if one was written and decodes."""
        msg = delivery.message
        if not self.enabled or not isinstance(msg, SubmitRequest):
            return None
        try:
            data = await self.redis.hget(self.key_of(delivery), msg.request_id)
        except Exception as exc:  # a start from the prompt is always correct
            log.warning("progress checkpoint of %s unreadable: %s", msg.request_id, exc)
            return None
        if data is None:
            return None
        try:
            return decode(bytes(data), ProgressCheckpoint)
        except CodecError as exc:
            log.warning("progress checkpoint of %s ignored: %s", msg.request_id, exc)
            return None

    def note_added(
        self, core: Scheduler, delivery: Delivery, checkpoint: ProgressCheckpoint | None
    ) -> None:
        """A request taken over after a fault is in the core: count where it continues from;
        its checkpoint field (if any) is ours now, to overwrite as it grows and delete when
        it finishes."""
        msg = delivery.message
        assert isinstance(msg, SubmitRequest)
        request = core.get_request(msg.request_id)
        if request is None:
            return
        resumed = request.num_output_tokens
        if checkpoint is not None:
            # -1 when void: rewritten at its first token, deleted when it finishes.
            self.book.resumed(msg.request_id, self.key_of(delivery), resumed or -1)
        if resumed:
            self.num_resumed += 1
            self.recent.append((msg.request_id, resumed))
            RESUMED.labels("checkpoint").inc()
            SKIPPED_TOKENS.observe(resumed)
            log.info(
                "resumed %s after %d generated tokens (checkpoint of %s)",
                msg.request_id, resumed, checkpoint.scheduler_id if checkpoint else "?",
                extra={"request_id": msg.request_id, "resumed_tokens": resumed},
            )  # fmt: skip
        else:
            self.num_from_prompt += 1
            RESUMED.labels("prompt").inc()

    async def sync(
        self, core: Scheduler | None, held: Mapping[str, tuple[SubmitRequest, Delivery]], now: float
    ) -> None:
        """One round when due. Call it only right after the step's deltas went out: every
        output token in the core is then published (progress_book.py's invariant)."""
        if not self.enabled or core is None or now < self.next_round_at:
            return
        self.next_round_at = now + self.interval_s
        live = [
            Progress(rid, self.key_of(held[rid][1]), r.num_prompt_tokens, r.output_token_ids)
            for rid, r in core.requests.items()
            if rid in held and r.routed_experts is None
        ]
        written = self.book.round(live)
        if not written:
            return
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for key, checkpoint in written.writes:
                    pipe.hset(key, checkpoint.request_id, encode(checkpoint))
                for key, request_id in written.deletes:
                    pipe.hdel(key, request_id)
                await pipe.execute()
        except Exception as exc:
            self.book.failed(written)
            log.warning("progress checkpoints not written (retried next round): %s", exc)
            return
        self.num_rounds += 1

    def state(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "rounds": self.num_rounds,
            "resumed_from_checkpoint": self.num_resumed,
            "resumed_from_prompt": self.num_from_prompt,
            "recently_resumed": dict(self.recent),  # request id -> tokens it resumed after
        }
