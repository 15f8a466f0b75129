"""The KV offload tier under load: 64 streamed completions a round with shared prefixes, a fifth
cut by the client, every block stored to Redis (policy 'always') and loaded back for prefixes
the device cache evicted, and the worker killed and restarted before round 1, 6, 11, ... (its device
cache lost; prefixes come back from the tier). Every request not cut must run to max_tokens."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.stress.rounds import (
    Completion,
    RoundCheck,
    client_cuts,
    loaded_env,
    ran_to_length,
    send_all,
)
from tests.support.mesh import Mesh

CONCURRENCY = 64
LOADS = "meshllm:worker_kv_transfers_total"
LOREM = "lorem ipsum dolor sit amet " * 40


@pytest.fixture(scope="module")
def mesh(tiny_env: dict[str, str]) -> Iterator[Mesh]:
    env = {
        **loaded_env(tiny_env, CONCURRENCY, 2**20),
        "MESHLLM_KV_OFFLOAD": "true",
        "MESHLLM_KV_STORE_POLICY": "always",
        "MESHLLM_KV_LOAD_BYTES_PER_S": "1e12",
        "MESHLLM_HEARTBEAT_INTERVAL_S": "0.5",
        "MESHLLM_KVSTORE_RETRY_S": "1.0",
    }
    with Mesh(services=("gateway", "scheduler", "worker", "kvstore"), env=env) as m:
        yield m


async def one_round(mesh: Mesh, model: str, rng: random.Random, first_id: int) -> list[Completion]:
    bodies = [
        {
            "model": model,
            "prompt": LOREM[: 40 * rng.randint(1, 12)] + str(i),
            "max_tokens": rng.randint(1, 40),
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
            "temperature": rng.choice([0.0, 1.0]),
            "seed": i,
        }
        for i in range(first_id, first_id + CONCURRENCY)
    ]
    return await send_all(mesh.api, bodies, client_cuts(rng, len(bodies)))


def test_offloaded_prefixes_survive_worker_restarts(
    mesh: Mesh, stress_rounds: int, stress_seed: int, evidence_dir: Path
) -> None:
    model = httpx.get(f"{mesh.api}/models").json()["data"][0]["id"]
    rng = random.Random(stress_seed)
    check = RoundCheck(mesh, evidence_dir)
    loads = 0.0  # the worker's counter starts again at each restart
    for round_no in range(stress_rounds):
        if round_no % 5 == 1:
            loads += mesh.metric("worker", LOADS, kind="load", result="ok")
            mesh.kill("worker")
            mesh.restart("worker")
        done = asyncio.run(one_round(mesh, model, rng, round_no * 10_000))
        check(round_no, [p for d in done if (p := ran_to_length(d))])
    loads += mesh.metric("worker", LOADS, kind="load", result="ok")
    print(f"{loads:.0f} KV loads from the tier")
    assert loads > 0 or stress_rounds < 2, "nothing loaded from the tier"
