"""The routing policy: cache overlap against load, least load, round robin, shedding, and the
KV index it reads (fed by KVEvents as the groups' schedulers send them)."""

from __future__ import annotations

import pytest

from services.gateway.route.kv_index import KVIndex
from services.gateway.route.router import Candidate, Router, group_load
from shared.config import GatewaySettings
from shared.kv.block_hash import extend_block_hashes
from shared.protocol import KVEvents
from shared.protocol.health import GroupLoad
from shared.protocol.kv_events import pack_hashes

BS = 4
PREFIX_A = list(range(100, 132))  # 8 blocks
PREFIX_B = list(range(200, 232))


def hashes(tokens: list[int]) -> list[bytes]:
    out: list[bytes] = []
    extend_block_hashes(out, tokens, BS)
    return out


def event(group: str, *, stored=(), removed=(), snapshot=False, incarnation="i1") -> KVEvents:
    return KVEvents(
        group=group,
        scheduler_id=f"scheduler-{group}",
        incarnation=incarnation,
        block_size=BS,
        snapshot=snapshot,
        stored=pack_hashes(list(stored)),
        removed=pack_hashes(list(removed)),
    )


def cand(group: str, waiting=0, running=0, beat=0.0, max_num_seqs=8) -> Candidate:
    load = GroupLoad(num_waiting=waiting, num_running=running, max_num_seqs=max_num_seqs)
    return Candidate(group, load, beat)


def load(r: Router, c: Candidate) -> int:
    """The group's load as the router counts it when it decides."""
    return group_load(c, r.since_beat(c))


def router(policy="kv", weight=1.0, per_group=0, total=0) -> Router:
    r = Router(
        policy, overlap_weight=weight, max_queued_per_group=per_group, max_queued_total=total
    )
    for g in ("0", "1"):
        r.index.apply(event(g, snapshot=True))
    return r


def test_index_overlap_counts_leading_blocks_only() -> None:
    index = KVIndex()
    h = hashes(PREFIX_A)
    index.apply(event("0", stored=h[:3] + h[5:]))
    assert index.overlap("0", h) == 3
    index.apply(event("0", removed=h[1:2]))
    assert index.overlap("0", h) == 1
    assert index.overlap("1", h) == 0  # never heard of


def test_index_snapshot_and_new_incarnation_replace_what_was_known() -> None:
    index = KVIndex()
    a, b = hashes(PREFIX_A), hashes(PREFIX_B)
    index.apply(event("0", stored=a))
    index.apply(event("0", stored=b[:2], snapshot=True))
    assert index.overlap("0", a) == 0 and index.overlap("0", b) == 2
    index.apply(event("0", stored=a[:1], incarnation="i2"))  # a restarted scheduler
    assert index.overlap("0", b) == 0 and index.overlap("0", a) == 1
    index.drop("0")
    assert index.groups() == []


def test_index_refuses_a_torn_hash_blob() -> None:
    index = KVIndex()
    bad = event("0").model_copy(update={"stored": b"x" * 17})
    with pytest.raises(ValueError):
        index.apply(bad)
    assert index.groups() == []


def test_kv_policy_follows_the_cached_prefix() -> None:
    r = router()
    r.index.apply(event("1", stored=hashes(PREFIX_A)))
    for t in range(3):
        fresh = [cand("0", beat=t + 0.9), cand("1", beat=t + 0.9)]  # earlier ones finished
        d = r.choose(fresh, [*PREFIX_A, t], None, now=1.0 + t)
        assert d.group == "1"
        assert d.overlap_tokens == len(PREFIX_A)


def test_kv_policy_predicts_the_blocks_it_routed() -> None:
    """A burst sharing a new prefix follows the first request before any event says so (at
    the default weight: at w = 1 a full hit against one request routed there is a tie, which
    goes to the lower load)."""
    r = router(weight=GatewaySettings().kv_overlap_score_weight)
    first = r.choose([cand("0"), cand("1")], [*PREFIX_B, 1], None, now=1.0)
    assert first.overlap_tokens == 0
    second = r.choose([cand("0"), cand("1")], [*PREFIX_B, 2], None, now=1.1)
    assert second.group == first.group and second.overlap_tokens == len(PREFIX_B)


def test_kv_policy_gives_way_to_load_past_the_weight() -> None:
    """w = 2: a full hit is worth two requests of load; a group busier than that loses."""
    r = router(weight=2.0)
    r.index.apply(event("1", stored=hashes(PREFIX_A)))
    busy = cand("1", running=2, waiting=1)
    assert r.choose([cand("0"), busy], PREFIX_A, None, now=1.0).group == "0"
    r = router(weight=2.0)  # the first choice predicted PREFIX_A in group 0: start again
    r.index.apply(event("1", stored=hashes(PREFIX_A)))
    slightly = cand("1", running=1)  # the hit still wins
    assert r.choose([cand("0"), slightly], PREFIX_A, None, now=2.0).group == "1"


def test_a_prefix_every_prompt_shares_does_not_starve_an_idle_group() -> None:
    """Short chat prompts all start with the template: cached on the old group, not on a new
    one. Load still spreads them (a scale-up takes its share)."""
    r = router()
    template = hashes(PREFIX_A[:8])
    r.index.apply(event("0", stored=template))
    busy_old = cand("0", running=2)
    assert r.choose([busy_old, cand("1")], PREFIX_A[:8], None, now=1.0).group == "1"


def test_a_new_group_takes_light_chat_traffic_at_the_default_weight() -> None:
    """The swarm scale-up: three clients send short chat prompts whose first half is the
    template, cached on the old group; the new group has sent no KV events yet. With two
    requests running on the old group, the new idle one takes the next."""
    prompt = [*PREFIX_A[:4], 7, 8, 9, 10]

    def route(running_on_old: int) -> str | None:
        r = Router(
            "kv",
            overlap_weight=GatewaySettings().kv_overlap_score_weight,
            max_queued_per_group=0,
            max_queued_total=0,
        )
        r.index.apply(event("0", stored=hashes(PREFIX_A[:4]), snapshot=True))
        return r.choose([cand("0", running=running_on_old), cand("1")], prompt, None, 1.0).group

    assert route(running_on_old=1) == "0"
    assert route(running_on_old=2) == "1"


def test_a_long_shared_prompt_cached_on_one_group_does_not_keep_the_other_idle() -> None:
    """A 1,500-token system prompt every request shares, cached on group 0 only: at w = 4 an
    empty group 1 costs 4 against 0.4 + load on group 0. Past the balance ratio (group 0 runs
    2 >= 2 x (1 + 0)), the least loaded group takes the request; below it, the cache wins."""
    prompt = [*PREFIX_A, 1, 2, 3, 4]  # 8 cached blocks + one of its own

    def route(running_on_hot: int, ratio: float, idle_running: int = 0) -> str | None:
        r = Router(
            "kv", overlap_weight=4.0, max_queued_per_group=0, max_queued_total=0,
            balance_ratio=ratio,
        )  # fmt: skip
        r.index.apply(event("0", stored=hashes(PREFIX_A), snapshot=True))
        hot, other = cand("0", running=running_on_hot), cand("1", running=idle_running)
        decision = r.choose([hot, other], prompt, None, 1.0)
        assert decision.balanced == (decision.group == "1")  # only the rule moves it here
        return decision.group

    assert route(running_on_hot=1, ratio=2.0) == "0"
    assert route(running_on_hot=2, ratio=2.0) == "1"
    assert route(running_on_hot=3, ratio=0.0) == "0"  # 0: off, the old rule
    # the other group busy too: the ratio is to 1 + its load
    assert route(running_on_hot=3, ratio=2.0, idle_running=1) == "0"
    assert route(running_on_hot=4, ratio=2.0, idle_running=1) == "1"


def test_balance_picks_by_cost_among_the_least_loaded() -> None:
    """The cost picks the busy group holding the whole prefix (0.44 + 2 against 4 x 7/9 on
    group 2, which holds two of its nine blocks, and 4 on the empty group 1); past the ratio the
    two idle groups compete, and the one with part of the prefix wins."""

    def route(ratio: float) -> str | None:
        r = Router(
            "kv", overlap_weight=4.0, max_queued_per_group=0, max_queued_total=0,
            balance_ratio=ratio,
        )  # fmt: skip
        for g in ("0", "1", "2"):
            r.index.apply(event(g, snapshot=True))
        r.index.apply(event("0", stored=hashes(PREFIX_A)))
        r.index.apply(event("2", stored=hashes(PREFIX_A[:8])))
        groups = [cand("0", running=2), cand("1"), cand("2")]
        return r.choose(groups, [*PREFIX_A, 9], None, 1.0).group

    assert route(ratio=0.0) == "0"
    assert route(ratio=2.0) == "2"


def test_zero_weight_is_least_load() -> None:
    r = router(weight=0.0)
    r.index.apply(event("1", stored=hashes(PREFIX_A)))
    assert r.choose([cand("0"), cand("1", running=1)], PREFIX_A, None, now=1.0).group == "0"


def test_least_load_counts_requests_routed_since_the_last_beat() -> None:
    r = router("least_load")
    groups = [cand("0", beat=0.5), cand("1", beat=0.5)]
    got = [r.choose(groups, [1, 2, 3], None, now=1.0 + i / 10).group for i in range(6)]
    assert sorted(got) == ["0", "0", "0", "1", "1", "1"]
    # A newer beat of group 0 that counts its three as running: they are not counted twice.
    assert load(r, cand("0", running=3, beat=2.0)) == 3


def test_a_finished_request_stops_counting_before_the_next_beat() -> None:
    """One short request after another: the beat taken while the first ran still says
    `running=1` when the second arrives, but the gateway has seen the first end. The group
    holding the prefix is idle, so the prefix goes back to it (w = 1: one request of load
    would have sent it to the cold group)."""
    r = router(weight=1.0)
    r.index.apply(event("1", stored=hashes(PREFIX_A)))
    assert r.choose([cand("0"), cand("1")], PREFIX_A, None, now=1.0, request_id="a").group == "1"
    r.finished("a", now=1.3)
    stale_beat = [cand("0", beat=1.2), cand("1", running=1, beat=1.2)]  # taken while "a" ran
    assert load(r, stale_beat[1]) == 0
    d = r.choose(stale_beat, [*PREFIX_A, 1], None, now=1.4, request_id="b")
    assert d.group == "1"
    # Still in flight, "b" counts until a beat does; then the beat alone counts.
    assert load(r, stale_beat[1]) == 1
    assert load(r, cand("1", running=1, beat=1.5)) == 1
    r.finished("b", now=1.6)
    assert load(r, cand("1", running=1, beat=1.5)) == 0
    assert load(r, cand("1", running=0, beat=1.7)) == 0  # the next beat agrees
    # A request routed and finished between two beats never counted in either.
    r.choose([cand("0", beat=1.7), cand("1", beat=1.7)], PREFIX_A, None, 1.8, request_id="c")
    r.finished("c", now=1.9)
    assert load(r, cand("1", beat=1.7)) == 0 and load(r, cand("1", beat=2.0)) == 0


def test_round_robin_ignores_the_cache() -> None:
    r = router("round_robin")
    r.index.apply(event("1", stored=hashes(PREFIX_A)))
    got = [r.choose([cand("0"), cand("1")], PREFIX_A, None, now=1.0 + i).group for i in range(4)]
    assert got.count("0") == 2 and got.count("1") == 2


def test_a_full_group_lets_another_take_the_request() -> None:
    r = router(per_group=2)
    r.index.apply(event("1", stored=hashes(PREFIX_A)))
    full = cand("1", waiting=2)
    d = r.choose([cand("0"), full], PREFIX_A, None, now=1.0)
    assert d.group == "0"


def test_every_group_full_or_the_total_bound_refuses() -> None:
    r = router(per_group=2)
    d = r.choose([cand("0", waiting=2), cand("1", waiting=5)], [1, 2], None, now=1.0)
    assert d.group is None and "queued" in d.reason
    r = router(total=3)
    d = r.choose([cand("0", waiting=1), cand("1", waiting=2)], [1, 2], None, now=1.0)
    assert d.group is None
    # Routed requests count until a beat reports them: the bound holds within a burst.
    r = router(per_group=1)
    assert r.choose([cand("0"), cand("1")], [1], None, now=1.0).group is not None
    assert r.choose([cand("0"), cand("1")], [1], None, now=1.1).group is not None
    assert r.choose([cand("0"), cand("1")], [1], None, now=1.2).group is None


def test_forget_drops_groups_that_left() -> None:
    r = router()
    r.forget({"1"})
    assert r.index.groups() == ["1"]


def test_cache_salt_separates_tenants() -> None:
    r = router()
    salted: list[bytes] = []
    extend_block_hashes(salted, PREFIX_A, BS, "tenant-x")
    r.index.apply(event("1", stored=salted))
    assert r.choose([cand("0"), cand("1")], PREFIX_A, "tenant-x", 1.0).overlap_tokens == 32
    assert r.index.overlap("1", hashes(PREFIX_A)) == 0
