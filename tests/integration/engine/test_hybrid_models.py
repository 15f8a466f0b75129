"""Hybrid attention + Mamba2 models (Bamba, GraniteMoeHybrid) served by the real scheduler core
and the real model runner (InProcessEngine): greedy tokens equal transformers' fp32 generate
while the scheduler keeps the state group by shared/kv/groups.py's entry rule — prompts
crossing several block boundaries, several requests of different lengths in one step,
chunked prefill with a tiny token budget, prefix-cache hits (the state read from the shared
cached block ending at the hit) and preemption under a small block pool. A worker with the
KV offload tier enabled starts and serves, and moves attention and state chunks when a plan
asks (the scheduler asks for state chunks under P/D only: "transferable is not storable")."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis
import torch

from services.scheduler.config import kv_cache_groups_from
from services.worker.kv_offload.payload import read_header
from services.worker.kv_offload.wiring import build_connector, key_space, layer_groups
from services.worker.loader import load_model
from shared.config import WorkerSettings
from shared.kv.offload_key import OffloadKey
from shared.protocol import KVTransfer, KVTransferDone, SamplingParams, StepPlan
from tests.support.engine import InProcessEngine
from tests.support.plans import new_request
from tests.support.tiny_llama import reference_greedy
from tests.support.tiny_models import make_tiny

BS = 4
MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
FAMILIES = ["bamba", "granitemoehybrid", "granitemoehybrid_dense"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(checkpoint dir, transformers model, our model and config) per family."""
    path = tmp_path_factory.mktemp(request.param)
    reference = make_tiny(path, request.param)
    return path, reference, load_model(path, torch.float32, "cpu")


def _engine(family: Any, **options: Any) -> InProcessEngine:
    path, _, (model, config) = family
    assert [g.kind for g in config.kv_groups] == ["full", "state"]
    return InProcessEngine(
        path,
        block_size=BS,
        model_and_config=(model, config),
        scheduler_options={"kv_cache_groups": kv_cache_groups_from(config.kv_groups, BS)},
        **options,
    )


def _prompts(seed: int, lengths: list[int], shared: int = 0) -> dict[str, list[int]]:
    generator = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 500, (shared,), generator=generator).tolist()
    return {
        f"r{i}": prefix + torch.randint(3, 500, (n,), generator=generator).tolist()
        for i, n in enumerate(lengths)
    }


def _check(family: Any, prompts: dict[str, list[int]], out: dict[str, Any]) -> None:
    reference = family[1]
    for rid, prompt in prompts.items():
        expected = reference_greedy(reference, prompt, MAX_TOKENS)
        assert out[rid].token_ids == expected, rid


def test_batched_requests_equal_transformers(family: Any) -> None:
    """Five requests of different lengths (1 token to 9 blocks) in the same steps."""
    engine = _engine(family)
    prompts = _prompts(0, [1, 5, 13, 24, 37])
    out = engine.generate(prompts, GREEDY)
    _check(family, prompts, out)
    assert engine.max_tokens_per_step > sum(map(len, prompts.values())) - 1  # one batch
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_usable_blocks


def test_chunked_prefill_with_a_tiny_budget(family: Any) -> None:
    """7 tokens a step: chunks end mid-block and span several blocks, beside decodes."""
    engine = _engine(family, max_num_batched_tokens=7)
    prompts = _prompts(1, [30, 19, 3])
    out = engine.generate(prompts, GREEDY)
    _check(family, prompts, out)
    assert engine.max_tokens_per_step == 7


def test_overlapped_steps_equal_transformers(family: Any) -> None:
    """Asynchronous scheduling: step N + 1 launched before step N is finished, its inputs fed
    from N's tokens on the device; the states follow the launch order."""
    engine = _engine(family, max_num_batched_tokens=9)
    prompts = _prompts(5, [3, 17, 26])
    _check(family, prompts, engine.generate(prompts, GREEDY, overlap=True))
    assert engine.launched_ahead > 0


def test_prefix_hit_reads_the_cached_state(family: Any) -> None:
    """A second request sharing a 26-token prefix hits the cached blocks (the state after 24
    tokens, in a block other requests may still hit) and generates what a cold run does; a
    third one with the same prefix hits again: the shared block was not modified."""
    engine = _engine(family)
    prompts = _prompts(2, [3, 9, 6], shared=26)
    for i, (rid, prompt) in enumerate(prompts.items()):
        out = engine.generate({rid: prompt}, GREEDY)
        _check(family, {rid: prompt}, out)
        if i:
            assert out[rid].num_cached_tokens == 24, rid
    assert engine.scheduler.kv.stats.hits > 0


def test_preemption_under_a_tiny_pool_gives_the_same_tokens(family: Any) -> None:
    engine = _engine(family, num_blocks=24, max_num_batched_tokens=16)
    prompts = _prompts(3, [21, 14, 30, 9], shared=8)
    out = engine.generate(prompts, GREEDY)
    _check(family, prompts, out)
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_usable_blocks


def test_a_long_prompt_with_a_partial_hit_is_scheduled_not_left_spinning(family: Any) -> None:
    """CONTRACTS "Admission estimates equal allocations" at engine level: a 100-token prompt
    whose first 40 tokens are cached needs 28 attention blocks (the pool's 29 usable hold it)
    but only a few state blocks, while its state group spans 28 logical blocks — more than the
    12-block state pool. An estimate of the logical span would never admit it (the engine
    raises when the scheduler has work and plans nothing); the physical bound admits it, with
    the partial hit, and its tokens equal transformers'."""
    engine = _engine(family, num_blocks=30, num_state_blocks=12, max_num_batched_tokens=16)
    prompts = _prompts(4, [0, 60], shared=40)
    first = engine.generate({"r0": prompts["r0"]}, GREEDY)
    long = engine.generate({"r1": prompts["r1"]}, GREEDY)
    _check(family, prompts, {**first, **long})
    assert long["r1"].num_cached_tokens == 40
    total = len(prompts["r1"]) + MAX_TOKENS
    assert -(-total // BS) > engine.kv_cache.num_state_blocks - 1  # logical span > state pool
    kv = engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_serves_with_the_offload_tier_which_stores_attention_blocks_only(
    family: Any, redis_url: str
) -> None:
    path, _, (_, config) = family
    assert layer_groups(config) == [[i for i, t in enumerate(config.layer_types) if t != "mamba"]]
    engine = _engine(family)
    settings = WorkerSettings(redis_url=redis_url, instance_id="w-hybrid", model=str(path))
    connector = build_connector(settings, engine.kv_cache, config, "tiny-hybrid", "inc-1")
    engine.runner.kv_connector = connector
    try:
        prompts = _prompts(4, [10, 17])
        _check(family, prompts, engine.generate(prompts, GREEDY))
        # a store of the attention group's blocks succeeds, and so does a state-group chunk
        # (P/D hands states over; role "both" never asks for one: the scheduler's connector),
        # in the state layout [state layers, 1, 1, 1, conv + SSM elements]
        prompt = prompts["r1"]
        space = key_space(settings, "tiny-hybrid")
        chunk_keys = [
            space.payload_key(OffloadKey(f"h{i}".encode().ljust(16, b"."), group))
            for i, group in enumerate([0, 0, 1])
        ]
        store = KVTransfer(
            transfer_id="s1", request_id="x", keys=chunk_keys, groups=[0, 0, 1], block_ids=[1, 2, 3]
        )
        blocks = [1, 2, 3, 4, 5]
        request = new_request("x", prompt, blocks).model_copy(update={"block_ids": [blocks] * 2})
        engine.runner.execute(
            StepPlan(
                step_id=10_000,
                scheduler_id="s",
                new_requests=[request],
                num_scheduled_tokens={"x": len(prompt)},
                kv_stores=[store],
            )
        )
        done: list[KVTransferDone] = []
        deadline = time.monotonic() + 30
        while not done and time.monotonic() < deadline:
            done += connector.drain_done()
            time.sleep(0.02)
        assert done and done[0].transfer_id == "s1", done
        assert done[0].failed_keys == [] and done[0].ok, done[0].error
        r = redis.Redis.from_url(redis_url)
        assert r.exists(*chunk_keys) == 3
        kv_header, _ = read_header(r.get(chunk_keys[0]))  # type: ignore[arg-type]
        state_header, _ = read_header(r.get(chunk_keys[2]))  # type: ignore[arg-type]
        assert kv_header.shape[1] == 2
        num_state_layers = sum(t == "mamba" for t in config.layer_types)
        assert state_header.shape[:4] == (num_state_layers, 1, 1, 1)
    finally:
        connector.close()
