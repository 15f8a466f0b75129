"""KV offload under tensor parallelism (two real gloo ranks, a real Redis, a tiny Llama whose
3 KV heads split 1 + 2, so shards travel padded): a TP=2 store writes the payload a TP=1 worker
writes (the same header bytes; the body is both ranks' cache shards side by side, exactly, and
TP=1's body within fp32 reduction-order tolerance); loading TP=2's own payloads, TP=1's payloads
into TP=2, and TP=2's payloads into TP=1 each decode the tokens of a recompute and of
transformers."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from services.worker.kv_offload.payload import read_header
from tests.support.tiny_llama import make_tiny_llama, reference_greedy
from tests.support.tp_offload import MAX_TOKENS, PROMPT, OffloadRank, tp_scenario
from tests.support.tp_ranks import run_ranks, single


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, redis_server: Any) -> dict[str, Any]:
    """TP=1 stores and reloads, TP=2 (both ranks) stores, reloads its own and TP=1's
    payloads, then TP=1 loads TP=2's: one Redis, one process pair."""
    import redis

    redis.Redis.from_url(redis_server.url).flushall()
    path = tmp_path_factory.mktemp("tiny-uneven")
    reference = make_tiny_llama(
        path, seed=7, hidden_size=96, num_attention_heads=6, num_key_value_heads=3
    )
    torch.set_num_threads(1)
    tp1 = single(tp_scenario, str(path), redis_server.url, "")
    tp2 = run_ranks(tp_scenario, 2, str(path), redis_server.url, "tp1")
    rank = single(OffloadRank, str(path), redis_server.url)
    try:
        tp1_reads_tp2 = rank.load("tp2", "from-tp2")
        unloaded = rank.unloaded("blind")
    finally:
        rank.close()
    expected = reference_greedy(reference, PROMPT, MAX_TOKENS, min_tokens=MAX_TOKENS)
    return {
        "tp1": tp1,
        "tp2": tp2,
        "tp1_reads_tp2": tp1_reads_tp2,
        "unloaded": unloaded,
        "expected": expected,
    }


def _body(payload: bytes) -> tuple[Any, np.ndarray]:
    header, start = read_header(payload)
    body = np.frombuffer(payload, np.float32, offset=start).reshape(header.shape)
    return header, body


def test_tp2_payload_is_the_tp1_layout(runs: dict[str, Any]) -> None:
    rank0, rank1 = runs["tp2"]
    assert (rank0["kv_heads"], rank1["kv_heads"]) == (1, 2)  # the uneven split, padded
    assert runs["tp1"]["kv_heads"] == 3
    tp1_payloads, tp2_payloads = runs["tp1"]["payloads"], rank0["payloads"]
    assert len(tp2_payloads) == len(tp1_payloads) == 3
    for j, (ours, theirs) in enumerate(zip(tp2_payloads, tp1_payloads, strict=True)):
        assert ours is not None and theirs is not None
        assert len(ours) == len(theirs)
        header, body = _body(ours)
        _, tp1_body = _body(theirs)
        assert header.shape[3] == 3  # every KV head, not rank 0's one
        start = len(ours) - body.nbytes
        assert ours[:start] == theirs[:start]  # the same header bytes
        # Exactly the ranks' cache shards, heads in checkpoint order (rank 0's, then rank 1's).
        shards = np.concatenate([rank0["shard"][j], rank1["shard"][j]], axis=-2)
        assert np.array_equal(body, shards)
        # TP=1 computed the same KV (the all-reduce sums in another order: not bit-equal).
        np.testing.assert_allclose(body, tp1_body, rtol=1e-4, atol=1e-5)
        assert np.abs(body).max() > 0


def test_loads_across_tp_sizes_decode_the_recompute_tokens(runs: dict[str, Any]) -> None:
    expected = runs["expected"]
    rank0, rank1 = runs["tp2"]
    assert runs["tp1"]["recompute"] == expected
    assert runs["tp1"]["own"] == expected
    assert rank0["recompute"] == rank1["recompute"] == expected
    assert rank0["own"] == rank1["own"] == expected  # TP=2 reads its own payloads
    assert rank0["other"] == rank1["other"] == expected  # TP=2 reads TP=1's
    assert runs["tp1_reads_tp2"] == expected  # and TP=1 reads TP=2's


def test_a_wiped_cache_without_the_load_decodes_otherwise(runs: dict[str, Any]) -> None:
    """The load is what carries the prefix: decoding over the wiped blocks differs (so the
    equalities above can fail)."""
    assert runs["unloaded"] != runs["expected"]
