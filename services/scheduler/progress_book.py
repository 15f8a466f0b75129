"""Which progress checkpoints to write and delete (pure; services/scheduler/progress_edge.py
does the Redis side).

A checkpoint records a running request's output tokens in the progress hash of its entry's
stream (Streams.progress), so that a scheduler taking the entry over after a fault resumes
from them (resume.py). The book remembers how many tokens each request's field holds, so a
round writes only the requests whose output grew since their last checkpoint, and a request
that finishes or is aborted has its field deleted once (a request released to another group
keeps it: that group resumes from it).

Invariant the caller keeps: a round is taken right after the scheduler's deltas went out, so
every output token a checkpoint records was already published to the request's reply stream.
A resume from it therefore loses no token; tokens published after it are regenerated
identically (seeded) and dropped by the gateway's reply_dedup.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from shared.protocol import ProgressCheckpoint


@dataclass(frozen=True)
class Progress:
    """A live request as a round sees it: `key` is its entry's progress hash."""

    request_id: str
    key: str
    num_prompt_tokens: int
    output_token_ids: list[int]


@dataclass
class Round:
    """One pipelined write: HSETs of `writes`, HDELs of `deletes` ((key, request id))."""

    writes: list[tuple[str, ProgressCheckpoint]] = field(default_factory=list)
    deletes: list[tuple[str, str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.writes or self.deletes)


class ProgressBook:
    def __init__(self, scheduler_id: str, incarnation: str) -> None:
        self.scheduler_id = scheduler_id
        self.incarnation = incarnation
        self._written: dict[str, tuple[str, int]] = {}  # request id -> (key, tokens it holds)
        self._deletes: dict[str, str] = {}  # request id -> key, for the next round

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._written

    def resumed(self, request_id: str, key: str, num_tokens: int) -> None:
        """The request resumed from a checkpoint of `num_tokens` tokens already in `key`:
        no need to write it again until it grows, and its field is ours to delete."""
        self._written[request_id] = (key, num_tokens)
        self._deletes.pop(request_id, None)

    def round(self, live: Iterable[Progress]) -> Round:
        """What to write now: every live request whose output grew since its last checkpoint
        (none is written with no output: there is nothing to resume from), and the fields of
        requests finished since the last round."""
        out = Round(deletes=[(key, rid) for rid, key in self._deletes.items()])
        self._deletes.clear()
        for p in live:
            n = len(p.output_token_ids)
            held = self._written.get(p.request_id)
            if n == 0 or (held is not None and held == (p.key, n)):
                continue
            checkpoint = ProgressCheckpoint(
                request_id=p.request_id,
                num_prompt_tokens=p.num_prompt_tokens,
                output_token_ids=list(p.output_token_ids),
                scheduler_id=self.scheduler_id,
                incarnation=self.incarnation,
            )
            out.writes.append((p.key, checkpoint))
            self._written[p.request_id] = (p.key, n)
        return out

    def finished(self, request_id: str) -> None:
        """The request finished or was aborted (its entry is acked): delete its field."""
        held = self._written.pop(request_id, None)
        if held is not None:
            self._deletes[request_id] = held[0]

    def released(self, request_id: str) -> None:
        """The request went to another scheduler unfinished: its field stays for that one."""
        self._written.pop(request_id, None)

    def failed(self, written: Round) -> None:
        """A round that did not reach Redis: write its requests again next round and retry
        its deletes (a field left behind is harmless, but it is the finished request's)."""
        for _, checkpoint in written.writes:
            self._written.pop(checkpoint.request_id, None)
        for key, rid in written.deletes:
            if rid not in self._written:
                self._deletes[rid] = key
