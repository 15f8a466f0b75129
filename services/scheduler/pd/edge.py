"""The prefill role's I/O edge: jobs in, handoffs out (services/scheduler/pd is the pure part).

Per request read from the `requests` stream, `intake` gives the core its prefill job (and keeps
the original message), or None when the request goes to the decode side uncomputed. After each
step, `on_step` books the requests whose job that step finished; `take_handoffs` (called by the
step loop every iteration, and woken by store answers) returns those whose stores are all
answered: the service publishes their original SubmitRequest on the `handoff` stream (same
request id and reply stream), releases them from the core without a delta, and only then acks
their `requests` entry (at-least-once: a crash in between hands the request off twice, and the
decode side drops a request id it already holds; the gateway drops repeated token indexes).
"""

from __future__ import annotations

import logging
import time

from services.scheduler.offload.edge import OffloadEdge
from services.scheduler.pd import HandoffBook, PrefillPolicy, prefilled_in_step
from services.scheduler.request import RequestStatus
from services.scheduler.scheduler import Scheduler
from services.scheduler.spec import lookahead_of
from shared.config import SchedulerSettings
from shared.protocol import StepPlan, SubmitRequest

log = logging.getLogger(__name__)

#: A prefilled request waits at most this long for its store answers (a dead worker never
#: answers; its writes expire in the kvstore), then is handed off anyway.
MAX_STORE_WAIT_S = 30.0


class PrefillEdge:
    def __init__(self, settings: SchedulerSettings, offload: OffloadEdge | None) -> None:
        # The deployment's block size (the worker's, which only decides whether a prompt
        # holds a full block worth prefilling).
        self.policy = PrefillPolicy(lookahead_of(settings), settings.block_size)
        self.offload = offload
        self.originals: dict[str, SubmitRequest] = {}  # request id -> the gateway's message
        self.book = HandoffBook(MAX_STORE_WAIT_S)
        self.num_handed_off = 0
        if offload is None:
            log.warning("prefill role without a kvstore: requests go to decode uncomputed")

    def intake(self, msg: SubmitRequest) -> SubmitRequest | None:
        """The job the core runs for `msg` (the original is kept for the handoff), or None to
        hand `msg` off at once."""
        job = self.policy.job_for(msg) if self.offload is not None else None
        if job is not None:
            self.originals[msg.request_id] = msg
        return job

    def attach(self, core: Scheduler) -> None:
        """A (new) core: its requests start over, so nothing is booked."""
        core.prefill_only = True
        self.book = HandoffBook(MAX_STORE_WAIT_S)

    def on_step(self, core: Scheduler, plan: StepPlan) -> None:
        """Book the requests whose prefill job `plan` (whose result was just applied) finished."""
        totals = {
            rid: request.num_tokens
            for rid in plan.num_scheduled_tokens
            if rid in self.originals
            and (request := core.get_request(rid)) is not None
            and request.status is RequestStatus.RUNNING
        }
        now = time.monotonic()
        for rid in prefilled_in_step(plan, totals):
            self.book.add(rid, now)

    def take_handoffs(self, core: Scheduler) -> list[SubmitRequest]:
        """Originals of the booked requests ready to hand off, released from the core. A booked
        request that stopped running (aborted, or reset to recompute) is dropped from the book:
        it is booked again when its job finishes again (this runs before every `schedule()`,
        so a request reset since its booking is never released half recomputed)."""
        if not self.book:
            return []
        for rid in self.book.request_ids():
            request = core.get_request(rid)
            if request is None or request.status is not RequestStatus.RUNNING:
                self.book.discard(rid)  # its blocks went: booked again once recomputed
        offload = self.offload
        ready = self.book.take_ready(
            offload.stores_pending if offload is not None else lambda _: False, time.monotonic()
        )
        out = []
        for rid in ready:
            original = self.originals.get(rid)
            if original is not None and core.release_prefilled(rid):
                out.append(original)
        self.num_handed_off += len(out)
        return out

    def forget(self, request_id: str) -> None:
        self.originals.pop(request_id, None)
        self.book.discard(request_id)

    def state(self) -> dict[str, object]:
        return {
            "lookahead": self.policy.lookahead,
            "prefilling": len(self.originals),
            "awaiting_stores": len(self.book),
            "handed_off": self.num_handed_off,
        }
