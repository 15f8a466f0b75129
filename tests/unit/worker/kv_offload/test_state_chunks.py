"""State-group chunks through the worker's offload data path (P/D for hybrid models): a tiny
random-weight Bamba's KV cache (one attention layer, three Mamba2 state layers), the real
connector and transfer threads, a real redis-server.

A state chunk's payload is one block id's conv + SSM state of every state layer,
`[layers, 1, 1, 1, state_elems]` in the pool's dtype; stored from one block id and loaded into
another (after the cache was wiped) it gives back exactly the same tensors, next to an
attention chunk moved in the same transfers.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import redis
import torch

from services.worker.kv_offload.connector import KVConnector
from services.worker.kv_offload.group_blocks import put_states, state_elems, take_states
from services.worker.kv_offload.host_tier import HostTier
from services.worker.kv_offload.payload import LAYOUT_VERSION, read_header
from services.worker.kv_offload.transfer_engine import TransferEngine
from services.worker.kv_offload.wiring import layer_groups, transfer_groups
from services.worker.loader import load_model
from services.worker.runner.kv_cache import KVCache
from services.worker.runner.state_cache import MambaState
from shared.kv.offload_key import KeySpace, OffloadKey
from shared.protocol import KVTransfer, KVTransferDone, StepPlan
from tests.support.tiny_models import make_tiny

SPACE = KeySpace("test", "tiny-bamba", LAYOUT_VERSION)
BS = 4


@pytest.fixture(scope="module")
def bamba(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bamba-state-chunks")
    make_tiny(path, "bamba")
    return path


def key(tag: str, group: int) -> str:
    return SPACE.payload_key(OffloadKey(tag.encode().ljust(16, b"."), group))


def transfer(tid: str, chunks: list[tuple[str, int, int]]) -> KVTransfer:
    return KVTransfer(
        transfer_id=tid,
        request_id="r",
        keys=[k for k, _, _ in chunks],
        groups=[g for _, g, _ in chunks],
        block_ids=[b for _, _, b in chunks],
    )


def wait_done(connector: KVConnector, wake: threading.Event, tid: str) -> KVTransferDone:
    for _ in range(300):
        for done in connector.drain_done():
            if done.transfer_id == tid:
                return done
        if connector.has_ready_loads():
            connector.apply_ready_loads()
            continue
        wake.wait(0.1)
        wake.clear()
    raise AssertionError(f"no answer for {tid}")


def test_state_layout_round_trips_in_memory(bamba: Path) -> None:
    _, config = load_model(bamba, torch.float32, "cpu")
    kv = KVCache.allocate(config, 8, BS, torch.float32, "cpu")
    states = [layer for layer in kv.layers if isinstance(layer, MambaState)]
    assert len(states) == 3
    for state in states:
        state.conv.normal_()
        state.ssm.normal_()
    chunks = take_states(states, [2, 5])
    assert chunks.shape == (2, 3, 1, 1, 1, state_elems(states[0]))
    # The documented layout: per layer its conv state then its SSM state, flattened.
    first = chunks[1, 2].reshape(-1)
    conv = states[2].conv[5].reshape(-1)
    torch.testing.assert_close(first[: conv.numel()], conv, rtol=0, atol=0)
    torch.testing.assert_close(first[conv.numel() :], states[2].ssm[5].reshape(-1), rtol=0, atol=0)
    put_states(states, [6, 7], chunks)
    for state in states:
        torch.testing.assert_close(state.conv[6:8], state.conv[[2, 5]], rtol=0, atol=0)
        torch.testing.assert_close(state.ssm[6:8], state.ssm[[2, 5]], rtol=0, atol=0)


def test_a_state_chunk_stored_then_loaded_into_another_block_is_the_same_state(
    bamba: Path, redis_url: str
) -> None:
    _, config = load_model(bamba, torch.float32, "cpu")
    kv = KVCache.allocate(config, 16, BS, torch.float32, "cpu")
    groups = transfer_groups(config)
    assert groups is not None and groups[: len(layer_groups(config) or [])] == layer_groups(config)
    assert len(groups) == 2  # the attention group, then the state group
    wake = threading.Event()
    engine = TransferEngine(redis_url, HostTier(2**20), timeout_s=30.0)
    connector = KVConnector(kv, engine, SPACE, worker_id="w", layer_groups=groups, notify=wake.set)
    try:
        attention = [layer for layer in kv.layers if isinstance(layer, torch.Tensor)]
        states = [layer for layer in kv.layers if isinstance(layer, MambaState)]
        for layer in attention:
            layer.normal_()
        for state in states:
            state.conv.normal_()
            state.ssm.normal_()
        kv_before = [layer[:, 3].clone() for layer in attention]
        conv_before = [s.conv[3].clone() for s in states]
        ssm_before = [s.ssm[3].clone() for s in states]
        chunks = [(key("a", 0), 0, 3), (key("a", 1), 1, 3)]
        plan = StepPlan(step_id=0, scheduler_id="s", kv_stores=[transfer("store", chunks)])
        connector.before_forward(plan)
        connector.after_forward(plan)
        stored = wait_done(connector, wake, "store")
        assert stored.ok, stored.error
        payload = redis.Redis.from_url(redis_url).get(key("a", 1))
        assert isinstance(payload, bytes)
        header, _ = read_header(payload)
        assert header.shape == (3, 1, 1, 1, state_elems(states[0]))
        assert header.dtype == torch.float32
        # The state chunk does not make the chunk size the scheduler costs with larger.
        assert connector.chunk_bytes == connector.pools[0].payload_bytes

        for layer in attention:
            layer.zero_()
        for state in states:
            state.conv.zero_()
            state.ssm.zero_()
        chunks = [(key("a", 0), 0, 9), (key("a", 1), 1, 11)]
        plan = StepPlan(step_id=1, scheduler_id="s", kv_loads=[transfer("load", chunks)])
        connector.before_forward(plan)
        connector.after_forward(plan)
        loaded = wait_done(connector, wake, "load")
        assert loaded.ok, loaded.error
        for layer, before in zip(attention, kv_before, strict=True):
            torch.testing.assert_close(layer[:, 9], before, rtol=0, atol=0)
        for state, conv, ssm in zip(states, conv_before, ssm_before, strict=True):
            torch.testing.assert_close(state.conv[11], conv, rtol=0, atol=0)
            torch.testing.assert_close(state.ssm[11], ssm, rtol=0, atol=0)
            assert not state.conv[3].any() and not state.ssm[3].any()

        # A state chunk under an attention key's group is refused by the header check.
        bad = [(key("a", 0), 1, 12)]
        plan = StepPlan(step_id=2, scheduler_id="s", kv_loads=[transfer("bad", bad)])
        connector.before_forward(plan)
        assert not wait_done(connector, wake, "bad").ok
        assert not states[0].conv[12].any()
    finally:
        connector.close()
