"""KV offload through one rank of a tensor-parallel group (run on every rank by
tests/support/tp_ranks.py, or in-process at TP=1): the real ModelRunner, rank 0's real
KVConnector and TransferEngine against a real Redis, the other ranks' real KVFollower.

`stage` runs the same plans on every rank, as the worker's followers do. Rank 0's runner calls
for the followers (`kv_load`) travel as a broadcast object here, where the worker uses a pipe
(parallel/ranks.py): each follower receives one exactly where rank 0 sends it.

The scenario: request "a" prefills PROMPT and stores its full blocks under the writer's tag;
a `load(tag)` wipes the cache, loads the tag's chunks into other blocks and decodes greedily
from the loaded prefix; `recompute` decodes the same prompt from scratch.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import redis
import torch
import torch.distributed as dist

from services.worker.kv_offload.connector import KVConnector
from services.worker.kv_offload.group_blocks import GroupKVBlocks, KVFollower
from services.worker.kv_offload.head_shards import KVHeadShards
from services.worker.kv_offload.host_tier import HostTier
from services.worker.kv_offload.payload import LAYOUT_VERSION
from services.worker.kv_offload.staging import take_blocks
from services.worker.kv_offload.transfer_engine import TransferEngine
from services.worker.loader import load_model
from services.worker.parallel.group import TensorParallel
from services.worker.runner.kv_cache import KVCache
from services.worker.runner.model_runner import ModelRunner
from shared.kv.offload_key import KeySpace, OffloadKey
from shared.model.config import ModelConfig
from shared.protocol import (
    CachedRequestData,
    KVTransfer,
    KVTransferDone,
    StepPlan,
)
from tests.support.plans import new_request

SPACE = KeySpace("tpoff", "tiny-tp", LAYOUT_VERSION)
BLOCK = 4
PROMPT = [1, 17, 99, 4, 250, 31, 8, 77, 300, 12, 5, 40, 61]  # 3 full blocks, then 1 token
STORED = [1, 2, 3]  # the blocks "a" stores
LOADED = [20, 21, 22]  # where a load puts them
MAX_TOKENS = 6
TIMEOUT_S = 60.0


def chunk_keys(tag: str) -> list[str]:
    hashes = [f"{tag}-{i}".encode().ljust(16, b".") for i in range(len(STORED))]
    return [SPACE.payload_key(OffloadKey(h, 0)) for h in hashes]


class Broadcast:
    """Rank 0's runner calls for the followers, as broadcast objects over the group."""

    def __init__(self, tp: TensorParallel) -> None:
        self.tp = tp

    def send(self, op: str, arg: Any) -> None:
        dist.broadcast_object_list([(op, arg)], src=0)

    def receive(self) -> tuple[str, Any]:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        return box[0]  # type: ignore[no-any-return]


class OffloadRank:
    def __init__(self, tp: TensorParallel, hf_dir: str, redis_url: str) -> None:
        self.tp = tp
        model, config = load_model(Path(hf_dir), torch.float32, "cpu", tp=tp)
        kv = KVCache.allocate(config, 48, BLOCK, torch.float32, "cpu")
        self.runner = ModelRunner(model, config, kv, "cpu", max_num_reqs=4)
        shards = KVHeadShards.of_model(ModelConfig.from_hf_dir(Path(hf_dir)), tp)
        self.pipe = Broadcast(tp)
        self.done: dict[str, KVTransferDone] = {}
        self.wake = threading.Event()
        self.connector: KVConnector | None = None
        if tp.rank == 0:
            engine = TransferEngine(redis_url, HostTier(0), timeout_s=TIMEOUT_S)
            self.connector = KVConnector(
                kv,
                engine,
                SPACE,
                worker_id="w",
                staging_bytes=2**20,
                notify=self.wake.set,
                shards=shards,
                followers=self.pipe.send if tp.size > 1 else None,
            )
            self.runner.kv_connector = self.connector
        else:
            self.runner.kv_connector = KVFollower(GroupKVBlocks(kv, SPACE, shards))
        self.redis_url = redis_url
        self.step = 0

    def execute(self, **plan: Any) -> list[int]:
        """One plan on this rank; the tokens it sampled (every rank samples the same)."""
        result = self.runner.execute(StepPlan(step_id=self.step, scheduler_id="s", **plan))
        self.step += 1
        return [t for sampled in result.sampled for t in sampled.token_ids]

    def transfer(self, transfer_id: str) -> KVTransferDone:
        """Rank 0: wait for the transfer's answer."""
        assert self.connector is not None
        while transfer_id not in self.done:
            for done in self.connector.drain_done():
                self.done[done.transfer_id] = done
            if transfer_id not in self.done:
                assert self.wake.wait(TIMEOUT_S), f"timed out waiting for {transfer_id}"
                self.wake.clear()
        return self.done[transfer_id]

    def store(self, tag: str) -> dict[str, Any]:
        """Prefill "a" and store its full blocks: rank 0 returns the payloads, every rank its
        cache shard of the stored blocks."""
        keys = chunk_keys(tag)
        self.execute(
            new_requests=[new_request("a", PROMPT, [1, 2, 3, 4])],
            num_scheduled_tokens={"a": len(PROMPT)},
            kv_stores=[_transfer(f"store-{tag}", keys, STORED)],
        )
        shard = take_blocks(self.runner.kv_cache.layers, STORED).numpy()
        self.execute(finished_request_ids=["a"])
        out: dict[str, Any] = {"shard": shard}
        if self.connector is not None:
            done = self.transfer(f"store-{tag}")
            assert done.ok, done.error
            client = redis.Redis.from_url(self.redis_url)
            out["payloads"] = [client.get(key) for key in keys]
            client.close()
        return out

    def load(self, tag: str, rid: str) -> list[int]:
        """Wipe the cache, load `tag`'s chunks into other blocks, decode greedily from them."""
        for layer in self.runner.kv_cache.layers:
            layer.zero_()
        computed = len(STORED) * BLOCK
        transfer = _transfer(f"load-{rid}", chunk_keys(tag), LOADED)
        self.execute(
            new_requests=[new_request(rid, PROMPT, [*LOADED, 23, 24, 25], computed)],
            kv_loads=[transfer],
        )
        if self.connector is not None:  # read, then applied as a group call
            while not self.connector.has_ready_loads():
                assert self.wake.wait(TIMEOUT_S), "the load was never read"
                self.wake.clear()
            assert self.connector.apply_ready_loads() == 1
            done = self.transfer(transfer.transfer_id)
            assert done.ok, done.error
        else:
            op, arg = self.pipe.receive()
            assert op == "kv_load"
            assert isinstance(self.runner.kv_connector, KVFollower)
            self.runner.kv_connector.apply_loads(arg)
        return self._decode(rid, computed)

    def recompute(self, rid: str) -> list[int]:
        """The same prompt from scratch, no offload: what a load must reproduce."""
        return self._decode(rid, 0, [30, 31, 32, 33, 34, 35])

    def unloaded(self, rid: str) -> list[int]:
        """Decode as `load` does over a wiped cache, without the load (a control)."""
        for layer in self.runner.kv_cache.layers:
            layer.zero_()
        return self._decode(rid, len(STORED) * BLOCK, [*LOADED, 23, 24, 25])

    def _decode(self, rid: str, computed: int, blocks: list[int] | None = None) -> list[int]:
        """Greedy tokens of `rid` from `computed` on (a new request in `blocks`, or one the
        worker holds)."""
        tokens: list[int] = []
        plan: dict[str, Any] = {}
        if blocks is not None:
            plan["new_requests"] = [new_request(rid, PROMPT, blocks, computed)]
        else:
            plan["cached_requests"] = [_cached(rid, computed)]
        plan["num_scheduled_tokens"] = {rid: len(PROMPT) - computed}
        while len(tokens) < MAX_TOKENS:
            tokens += self.execute(**plan)
            position = len(PROMPT) + len(tokens) - 1
            plan = {
                "cached_requests": [_cached(rid, position)],
                "num_scheduled_tokens": {rid: 1},
            }
        self.execute(finished_request_ids=[rid])
        return tokens

    def close(self) -> None:
        if self.connector is not None:
            self.connector.close()


def _cached(rid: str, computed: int) -> CachedRequestData:
    return CachedRequestData(request_id=rid, new_block_ids=[[]], num_computed_tokens=computed)


def _transfer(transfer_id: str, keys: list[str], blocks: list[int]) -> KVTransfer:
    return KVTransfer(
        transfer_id=transfer_id, request_id="r", keys=keys, groups=[0] * len(keys), block_ids=blocks
    )


def tp_scenario(tp: TensorParallel, hf_dir: str, redis_url: str, other_tag: str) -> dict[str, Any]:
    """Store under "tp{size}", load it back, load `other_tag` (another TP size's payloads),
    and recompute: everything a test compares, from this rank."""
    rank = OffloadRank(tp, hf_dir, redis_url)
    try:
        tag = f"tp{tp.size}"
        out = rank.store(tag)
        out["own"] = rank.load(tag, "own")
        if other_tag:
            out["other"] = rank.load(other_tag, "other")
        out["recompute"] = rank.recompute("again")
        out["kv_heads"] = rank.runner.config.num_key_value_heads
        return out
    finally:
        rank.close()
