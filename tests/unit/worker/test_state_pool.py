"""A hybrid model's state pool beside the attention pool on the worker: the sizing rule
(state_pool.py), KVCache tensors of the two sizes within the budget, the worker announcing both
counts, and block ids checked against their own group's pool (plans and KV transfers)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from services.worker.kv_offload.chunks import ChunkCheck
from services.worker.runner.bootstrap import build_runner, size_pools
from services.worker.runner.input_batch import InputBatch, PlanError
from services.worker.runner.kv_cache import (
    KVCache,
    KVCacheSizeError,
    bytes_per_block,
    state_block_bytes,
)
from services.worker.runner.state_cache import MambaState
from services.worker.runner.state_pool import StatePoolPolicy, state_pool_blocks
from shared.config import WorkerSettings
from shared.kv.offload_key import KeySpace, OffloadKey
from shared.model.config import ModelConfig
from shared.model.source import ModelSource
from shared.protocol import KVTransfer, NewRequestData, SamplingParams, StepPlan
from tests.support.tiny_models import make_tiny

BS = 4
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def bamba_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bamba")
    make_tiny(path, "bamba")
    return path


@pytest.fixture(scope="module")
def bamba(bamba_dir: Path) -> ModelConfig:
    return ModelConfig.from_hf_dir(bamba_dir)


# -------------------------------------------------------------------------------- the rule


def test_the_rule_takes_the_floor_or_the_share_and_an_override() -> None:
    state, attention = 1000, 10
    policy = StatePoolPolicy(max_num_seqs=8, max_num_batched_tokens=64)
    assert policy.floor(BS) == 2 * 8 + 64 // BS + 2 == 34
    # Share of 0.5 of 1 MB = 500 state blocks, above the floor.
    assert state_pool_blocks(policy, 1_000_000, BS, state, attention) == 500
    # A smaller budget: the floor wins over 0.5 * 50_000 / 1000 = 25.
    assert state_pool_blocks(policy, 50_000, BS, state, attention) == 34
    # A budget below the floor: cut to 0.9 of it, attention keeps the rest.
    assert state_pool_blocks(policy, 20_000, BS, state, attention) == 18
    # An explicit count is taken as is, or refused when no attention block fits beside it.
    assert state_pool_blocks(StatePoolPolicy(blocks=7), 1_000_000, BS, state, attention) == 7
    with pytest.raises(KVCacheSizeError, match="MESHLLM_KV_STATE_BLOCKS"):
        state_pool_blocks(StatePoolPolicy(blocks=20), 20_005, BS, state, attention)
    with pytest.raises(KVCacheSizeError, match="do not fit"):
        state_pool_blocks(policy, 1_500, BS, state, attention)  # not even 2 state blocks
    with pytest.raises(ValueError):
        StatePoolPolicy(blocks=1)
    with pytest.raises(ValueError):
        StatePoolPolicy(share=0.95)


def test_the_rule_is_set_through_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHLLM_KV_STATE_BLOCKS", "33")
    monkeypatch.setenv("MESHLLM_KV_STATE_MEMORY_SHARE", "0.25")
    monkeypatch.setenv("MESHLLM_MAX_NUM_SEQS", "5")
    monkeypatch.setenv("MESHLLM_MAX_NUM_BATCHED_TOKENS", "96")
    settings = WorkerSettings()
    assert (settings.kv_state_blocks, settings.kv_state_memory_share) == (33, 0.25)
    assert (settings.max_num_seqs, settings.max_num_batched_tokens) == (5, 96)


# ---------------------------------------------------------------------- the cache tensors


@pytest.mark.parametrize(
    ("budget", "overrides"),
    [
        (16 * 2**20, {}),  # the floor: 2 * 64 + 2048 / 4 + 2 = 642 state blocks
        (64 * 2**20, {}),  # the share: half the budget
        (2 * 2**20, {}),  # the floor cut to 0.9 of the budget
        (4 * 2**20, {"kv_state_blocks": 9}),
        (2**20, {"max_num_seqs": 2, "max_num_batched_tokens": 16}),
    ],
)
def test_hybrid_cache_holds_both_pools_within_the_budget(
    bamba: ModelConfig, budget: int, overrides: dict[str, int]
) -> None:
    settings = WorkerSettings(kv_cache_bytes=budget, block_size=BS, **overrides)  # type: ignore[arg-type]
    num_blocks, num_state_blocks = size_pools(bamba, settings, torch.float32, CPU)
    attention, state = (
        bytes_per_block(bamba, BS, torch.float32),
        state_block_bytes(bamba, torch.float32),
    )
    policy = StatePoolPolicy(
        settings.kv_state_blocks,
        settings.kv_state_memory_share,
        settings.max_num_seqs,
        settings.max_num_batched_tokens,
    )
    assert num_state_blocks == state_pool_blocks(policy, budget, BS, state, attention)
    cache = KVCache.allocate(bamba, num_blocks, BS, torch.float32, "cpu", num_state_blocks)
    assert (cache.num_blocks, cache.num_state_blocks) == (num_blocks, num_state_blocks)
    assert cache.nbytes == num_blocks * attention + num_state_blocks * state
    assert cache.nbytes <= budget < cache.nbytes + attention  # attention takes the rest
    for layer in cache.layers:
        if isinstance(layer, MambaState):
            assert layer.conv.shape[0] == layer.ssm.shape[0] == num_state_blocks
        else:
            assert layer.shape[1] == num_blocks
    # More tokens than one pool with a state of every state layer per block id would hold.
    assert num_blocks > budget // (attention + state)


def test_a_model_without_state_layers_has_no_state_pool(tmp_path: Path) -> None:
    make_tiny(tmp_path, "qwen3")
    config = ModelConfig.from_hf_dir(tmp_path)
    settings = WorkerSettings(kv_cache_bytes=2**20, block_size=BS)
    num_blocks, num_state_blocks = size_pools(config, settings, torch.float32, CPU)
    assert num_state_blocks == 0 and state_block_bytes(config, torch.float32) == 0
    assert num_blocks == 2**20 // bytes_per_block(config, BS, torch.float32)
    assert KVCache.allocate(config, num_blocks, BS, torch.float32, "cpu", 5).num_state_blocks == 0


def test_the_worker_announces_both_pools_and_serves_with_them(bamba_dir: Path) -> None:
    settings = WorkerSettings(
        kv_cache_bytes=16 * 2**20,
        block_size=BS,
        max_model_len=64,
        dtype="float32",
        device="cpu",
        max_num_seqs=4,
    )
    runner, ready = build_runner(ModelSource("bamba", bamba_dir, bamba_dir), settings, "i")
    cache = runner.kv_cache
    assert ready.num_state_blocks == cache.num_state_blocks >= 3 * 4 + 1
    assert ready.num_kv_blocks == cache.num_blocks > ready.num_state_blocks
    assert [g.kind for g in ready.kv_groups] == ["full", "state"]
    # A plan whose state ids are the state pool's top blocks: its states land there.
    top = cache.num_state_blocks - 1
    assert top >= 2
    request = NewRequestData(
        request_id="r",
        token_ids=[5, 6, 7, 8, 9],
        num_prompt_tokens=5,
        sampling=SamplingParams(temperature=0, max_tokens=2),
        block_ids=[[1, 2], [top - 1, top]],
        num_computed_tokens=0,
    )
    plan = StepPlan(
        step_id=1, scheduler_id="s", new_requests=[request], num_scheduled_tokens={"r": 5}
    )
    states = [layer for layer in cache.layers if isinstance(layer, MambaState)]
    for state in states:  # the warm-up wrote scratch states
        state.conv.zero_()
        state.ssm.zero_()
    result = runner.execute(plan)
    assert [s.request_id for s in result.sampled] == ["r"]
    # 5 tokens: the boundary state after 4 in entry 0, the final state in entry 1, both in the
    # state pool's top blocks; no other state block was written.
    written = [b for b in range(cache.num_state_blocks) if bool(states[0].ssm[b].any())]
    assert written == [top - 1, top]


# ------------------------------------------------------------ ids checked against their pool


def test_plans_are_checked_against_each_groups_pool() -> None:
    batch = InputBatch(
        max_num_reqs=2, max_model_len=32, block_size=BS, num_kv_groups=2, num_cache_blocks=[10, 30]
    )

    def new(rid: str, ids: list[list[int]]) -> StepPlan:
        data = NewRequestData(
            request_id=rid,
            token_ids=[1, 2, 3],
            num_prompt_tokens=3,
            sampling=SamplingParams(),
            block_ids=ids,
            num_computed_tokens=0,
        )
        return StepPlan(step_id=0, scheduler_id="s", new_requests=[data])

    batch.apply(new("a", [[9], [29]]))  # state id 29: past the attention pool, in the state pool
    assert batch.block_tables[1, 0, 0] == 29
    with pytest.raises(PlanError, match="group 0 outside"):
        batch.apply(new("b", [[10], [3]]))
    with pytest.raises(PlanError, match="group 1 outside"):
        batch.apply(new("c", [[3], [30]]))
    assert np.array_equal(batch.num_blocks[:, 0], [1, 1])


def test_transfers_are_checked_against_each_groups_pool() -> None:
    space = KeySpace("c", "m")
    check = ChunkCheck(space, 2, 10, frozenset({1}), 30)

    def key(group: int) -> str:
        return space.payload_key(OffloadKey(b"\x01" * 16, group))

    transfer = KVTransfer(
        transfer_id="t",
        request_id="r",
        keys=[key(0), key(1), key(0), key(1)],
        groups=[0, 1, 0, 1],
        block_ids=[9, 29, 12, 30],
    )
    valid, failed, reason = check.split(transfer)
    assert [(g, b) for _, g, b in valid] == [(0, 9), (1, 29)]
    assert failed == [key(0), key(1)] and reason is not None and "outside" in reason
