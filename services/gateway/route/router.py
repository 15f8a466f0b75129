"""The routing policy: which ready worker group takes a request, or none (shed). Pure: the
groups' loads come from their heartbeats (services/gateway/mesh), their cached prefixes from
the KV index, times are passed in.

Load of a group = what its last beat said (waiting + running), plus what this gateway routed to
it since that beat and is still in flight (the beat cannot know those yet), minus what this
gateway routed before the beat and has seen finish since (the beat still counts those): a
sequence of short requests does not see the group that just served one as busy until its next
beat, which would send a cached prefix to a cold group. Its queue = waiting + routed since and
in flight. Other gateways' routing since the beat is unknown here, which every gateway's next
beat corrects.

Policies (GatewaySettings.router_policy):
- `kv` (default): the lowest cost  w * (1 - overlap / prompt blocks) + load, load in requests,
  w = `kv_overlap_score_weight` (Dynamo's --kv-overlap-score-weight): a prompt fully cached on
  a group is worth w requests of load elsewhere. This is Dynamo's cost (w x blocks to prefill
  + active blocks) divided by the prompt's blocks, with each active request taken to hold as
  many blocks as this prompt: a prefix every prompt shares (a chat template) then cannot keep
  a new or idle group out of the traffic. w = 0 is least_load;
- `least_load`: the lowest load;
- `round_robin`: the groups in turn, ignoring caches.
Balance (kv): when the group the cost picks holds at least `kv_balance_ratio` x (1 + the least
load) requests, the least loaded groups compete instead (by the same cost among them), like
SGLang's cache-aware router switching to load balancing past its balance thresholds. Without
it a long system prompt that every request shares, cached on one group, kept every other group
idle: at w = 4 a cold group costs 4, more than the hot one with three requests running, and it
never got the one request that would have cached the prompt there too (bench/RESULTS.md,
multi-turn chat with a 1,500-token system prompt: all traffic on one of two groups).
Ties go to the lower load, then the larger cached prefix, then in turn (so equal groups share
the traffic). Lower load first: at w = 4 a short chat prompt whose first half is the template,
cached on the old group only, costs the same there with two requests running as on a new idle
group, and a scale-up under light load must still take its share (tests/swarm).

Shedding: a group whose queue reached `max_queued_per_group` takes nothing more (another group
takes the request: a full group never starves a request another could run); with every group
full, or `max_queued_total` queued over all groups, the request is refused (429).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from services.gateway.route.kv_index import KVIndex
from shared.config import GatewaySettings
from shared.kv.block_hash import BlockHash, extend_block_hashes
from shared.protocol.health import GroupLoad

Policy = Literal["kv", "least_load", "round_robin"]


@dataclass(frozen=True)
class Candidate:
    """A ready group that serves requests whole, as its last beat describes it."""

    group: str
    load: GroupLoad
    last_beat: float


@dataclass(frozen=True)
class Decision:
    """`group` None: refused (every group full, or the total bound reached): `reason` says."""

    group: str | None
    reason: str
    overlap_tokens: int = 0
    prompt_tokens: int = 0
    balanced: bool = False  # kv: the balance rule took it from a busier group the cost chose


@dataclass
class Routed:
    """One request this gateway routed: when, and when it finished (None: in flight)."""

    request_id: str  # "" when the caller does not report its end (`finished`)
    at: float
    finished_at: float | None = field(default=None)


class Router:
    def __init__(
        self,
        policy: Policy,
        *,
        overlap_weight: float,
        max_queued_per_group: int,
        max_queued_total: int,
        balance_ratio: float = 0.0,
    ) -> None:
        self.policy = policy
        self.overlap_weight = overlap_weight
        self.balance_ratio = balance_ratio
        self.max_queued_per_group = max_queued_per_group
        self.max_queued_total = max_queued_total
        self.index = KVIndex()
        self._routed: dict[str, list[Routed]] = {}  # group -> requests this gateway routed
        self._by_id: dict[str, Routed] = {}  # the ones in flight, by request id
        self._turn = 0

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> Router:
        return cls(
            settings.router_policy,
            overlap_weight=settings.kv_overlap_score_weight,
            max_queued_per_group=settings.max_queued_per_group,
            max_queued_total=settings.max_queued_total,
            balance_ratio=settings.kv_balance_ratio,
        )

    # --- load ----------------------------------------------------------------------------

    def since_beat(self, candidate: Candidate) -> tuple[int, int]:
        """(requests routed to the group after its last beat and still in flight, requests the
        beat counts that have finished since), in one pass that also drops what the beat
        describes rightly now (finished before it, or routed before it with no end reported)."""
        beat = candidate.last_beat
        kept: list[Routed] = []
        routed = finished = 0
        for r in self._routed.get(candidate.group, ()):
            if r.finished_at is None:
                if r.at > beat:
                    routed += 1
                elif not r.request_id:
                    continue  # an end never reported: trust the beat
            elif r.finished_at <= beat:
                continue
            elif r.at <= beat:
                finished += 1
            kept.append(r)
        self._routed[candidate.group] = kept
        return routed, finished

    def finished(self, request_id: str, now: float) -> None:
        """A request routed with this id ended (its last reply, an abort, a failure)."""
        routed = self._by_id.pop(request_id, None)
        if routed is not None:
            routed.finished_at = now

    # --- choosing ------------------------------------------------------------------------

    def choose(
        self,
        candidates: list[Candidate],
        prompt: list[int],
        cache_salt: str | None,
        now: float,
        request_id: str = "",
    ) -> Decision:
        """The group for one request (and, when one is chosen, the bookkeeping of having
        routed it there: its load, and its prompt's blocks predicted in that group's cache).
        A `request_id` given here must be reported `finished` when the request ends."""
        if not candidates:
            return Decision(None, "no ready group")
        # One pass over each group's routed requests serves every count below.
        since = {c.group: self.since_beat(c) for c in candidates}
        queued = {c.group: c.load.num_waiting + since[c.group][0] for c in candidates}
        total = sum(queued.values())
        if self.max_queued_total and total >= self.max_queued_total:
            return Decision(None, f"{total} requests queued (bound {self.max_queued_total})")
        bound = self.max_queued_per_group
        open_ = [c for c in candidates if not (bound > 0 and queued[c.group] >= bound)]
        if not open_:
            return Decision(None, f"every group has {self.max_queued_per_group} requests queued")
        hashes = self._hashes(open_, prompt, cache_salt)
        overlaps = {c.group: self.index.overlap(c.group, hashes.get(c.group, [])) for c in open_}
        chosen, balanced = self._pick(open_, overlaps, hashes, since)
        block_size = self.index.block_size(chosen.group) or 1
        routed = Routed(request_id, now)
        self._routed.setdefault(chosen.group, []).append(routed)
        if request_id:
            self._by_id[request_id] = routed
        self.index.predict(chosen.group, hashes.get(chosen.group, []))
        return Decision(
            chosen.group,
            self.policy,
            overlap_tokens=overlaps[chosen.group] * block_size,
            prompt_tokens=len(prompt),
            balanced=balanced,
        )

    def _pick(
        self,
        open_: list[Candidate],
        overlaps: dict[str, int],
        hashes: dict[str, list[BlockHash]],
        since: dict[str, tuple[int, int]],
    ) -> tuple[Candidate, bool]:
        """The chosen group, and whether the balance rule chose it."""
        ordered = sorted(open_, key=lambda c: c.group)
        self._turn += 1
        if self.policy == "round_robin":
            return ordered[self._turn % len(ordered)], False

        def cost(c: Candidate) -> tuple[float, int, int]:
            """(cost, load, -overlap)."""
            load = group_load(c, since[c.group])
            if self.policy == "least_load":
                return float(load), load, 0
            blocks = len(hashes.get(c.group, []))
            miss = 1.0 - overlaps[c.group] / blocks if blocks else 1.0
            return round(self.overlap_weight * miss + load, 9), load, -overlaps.get(c.group, 0)

        costs = {c.group: cost(c) for c in ordered}
        best = min(costs.values())
        balanced = False
        if self.policy == "kv" and self.balance_ratio:
            least = min(load for _, load, _ in costs.values())
            if best[1] >= self.balance_ratio * (least + 1):  # the pick is that much busier
                ordered = [c for c in ordered if costs[c.group][1] == least]
                best = min(costs[c.group] for c in ordered)
                balanced = True
        tied = [c for c in ordered if costs[c.group] == best]
        return tied[self._turn % len(tied)], balanced

    def _hashes(
        self, candidates: list[Candidate], prompt: list[int], cache_salt: str | None
    ) -> dict[str, list[BlockHash]]:
        """The prompt's block hashes at each group's block size (computed once per size)."""
        if self.policy != "kv":
            return {}
        by_size: dict[int, list[BlockHash]] = {}
        out: dict[str, list[BlockHash]] = {}
        for c in candidates:
            size = self.index.block_size(c.group)
            if size is None:
                continue  # no KVEvents from it yet: nothing cached that we know of
            if size not in by_size:
                by_size[size] = []
                extend_block_hashes(by_size[size], prompt, size, cache_salt)
            out[c.group] = by_size[size]
        return out

    def forget(self, groups: set[str]) -> None:
        """Drop what is known of groups that left the mesh."""
        for group in set(self.index.groups()) | set(self._routed):
            if group not in groups:
                self.index.drop(group)
                for routed in self._routed.pop(group, ()):
                    self._by_id.pop(routed.request_id, None)


def group_load(candidate: Candidate, since: tuple[int, int]) -> int:
    """A group's requests running or queued: its beat's, corrected by `since` (Router.since_beat:
    routed there after the beat, and finished since)."""
    routed, finished = since
    beat_load = candidate.load.num_running + candidate.load.num_waiting
    return max(0, beat_load + routed - finished)
