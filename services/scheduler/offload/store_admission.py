"""Which offered chunks are written to the tier: the store admission policy (pure).

A store is not free: the worker copies the block, Redis holds the bytes and the kvstore keeps
the chunk's metadata, all on the machine that runs the model. On a workload that never reuses
a prompt every write is waste, and writing every prefill's KV cost a third of the throughput of
the 2-core CPU mesh (docs/kv-offload.md). So a chunk is written only when it is likely to be
read again (`SchedulerSettings.kv_store_policy`):

- "reuse" (the default): store on second sight, as vLLM's and LMCache's "store on reuse"
  admission does. The first request that offers a chunk is only remembered (a bounded LRU of
  keys); a later, different request offering the same key (a shared system prompt, a
  conversation's history, a prompt sent again) makes it worth storing. A burst of requests
  sharing a prefix stores it once, from the second request on; their distinct suffixes are never
  written.
- "always": every offered chunk (the tier as a write-through cache). A prefill-role scheduler
  (services/scheduler/pd) always uses it: its blocks are read exactly once, by the decode side.

Independently of the policy, a chunk this scheduler knows to be in the tier already (written or
being written by it, or loaded from it) is not written again; it is still reported to the
kvstore, whose per-request record commits its recency (CONTRACTS.md: recency is committed once
per request).
That knowledge is a bounded LRU too, and it is forgotten for a key the tier turned out not to
have (a failed write or load, or a kvstore that asks for a recorded key to be written).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Literal

StorePolicyName = Literal["reuse", "always"]
DEFAULT_MAX_KEYS = 1 << 16  # per LRU: ~1M tokens of prefix at 16-token blocks


class StoreDecision(Enum):
    WRITE = "write"  # the worker writes it and the kvstore records it
    RECORD = "record"  # in the tier already: only the kvstore's record (recency) gets it
    SKIP = "skip"  # first sight under "reuse": neither


@dataclass
class StoreAdmissionStats:
    write: int = 0
    record: int = 0
    skip: int = 0


class StoreAdmission:
    """Invariant: each LRU holds at most `max_keys` keys; a key is in `_stored` only while this
    scheduler believes the tier has it."""

    def __init__(self, policy: StorePolicyName = "reuse", max_keys: int = DEFAULT_MAX_KEYS):
        if policy not in ("reuse", "always"):
            raise ValueError(f"store policy must be 'reuse' or 'always', got {policy!r}")
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys}")
        self.policy: StorePolicyName = policy
        self.max_keys = max_keys
        self._seen: OrderedDict[Hashable, str] = OrderedDict()  # key -> first request offering it
        self._stored: OrderedDict[Hashable, None] = OrderedDict()
        self.stats = StoreAdmissionStats()

    def decide(self, key: Hashable, request_id: str) -> StoreDecision:
        """What to do with `key`, offered by `request_id` (each request offers a key once).
        A key decided WRITE counts as stored at once, so the other requests of a burst that
        offer it meanwhile only record it; `mark_missing` undoes that if the write fails."""
        if key in self._stored:
            self._stored.move_to_end(key)
            decision = StoreDecision.RECORD
        elif self.policy == "always" or self._seen_before(key, request_id):
            decision = StoreDecision.WRITE
            self.mark_stored([key])
        else:
            decision = StoreDecision.SKIP
        setattr(self.stats, decision.value, getattr(self.stats, decision.value) + 1)
        return decision

    def _seen_before(self, key: Hashable, request_id: str) -> bool:
        """Second sight: an earlier, different request offered `key`. Remembers the first."""
        first = self._seen.get(key)
        if first is None:
            self._seen[key] = request_id
            if len(self._seen) > self.max_keys:
                self._seen.popitem(last=False)
            return False
        self._seen.move_to_end(key)
        return first != request_id

    def mark_stored(self, keys: Iterable[Hashable]) -> None:
        """The tier holds `keys` (a write completed, or a lookup found them)."""
        for key in keys:
            self._stored[key] = None
            self._stored.move_to_end(key)
            self._seen.pop(key, None)  # decided by `_stored` from now on
        while len(self._stored) > self.max_keys:
            self._stored.popitem(last=False)

    def mark_missing(self, keys: Iterable[Hashable]) -> None:
        """The tier does not hold `keys` (evicted, lost, or its write failed): a later offer
        writes them again (they were seen: their reuse is established)."""
        for key in keys:
            if key in self._stored:
                del self._stored[key]
                self._seen[key] = ""  # no request id: any request's offer is a second sight
                if len(self._seen) > self.max_keys:
                    self._seen.popitem(last=False)

    def knows_stored(self, key: Hashable) -> bool:
        return key in self._stored
