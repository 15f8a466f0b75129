"""kill -9 of the scheduler or the worker (by turns) in the middle of every round, then a
restart: 48 requests a round through the gateway, half streamed, greedy and seeded, with
overlapped steps; once plain, once with n-gram speculation. No accepted request may be lost or
cut short: each must end 'length' with max_tokens tokens."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.stress.rounds import Completion, RoundCheck, ran_to_length, send_all
from tests.support.mesh import Mesh

REQUESTS = 48
VICTIMS = ("scheduler", "worker")


@pytest.fixture(scope="module", params=["plain", "ngram"])
def mesh(request: pytest.FixtureRequest, tiny_env: dict[str, str]) -> Iterator[Mesh]:
    env = {
        **tiny_env,
        "MESHLLM_KV_CACHE_BYTES": str(2**22),
        "MESHLLM_HEARTBEAT_INTERVAL_S": "0.5",
        "MESHLLM_CLAIM_IDLE_MS": "3000",
        "MESHLLM_PROGRESS_CHECKPOINT_S": "0.2",
        "MESHLLM_OVERLAP_STEPS": "on",
    }
    if request.param == "ngram":
        env.update(MESHLLM_SPEC_METHOD="ngram", MESHLLM_SPEC_TOKENS="4")
    with Mesh(services=("gateway", "scheduler", "worker"), env=env) as m:
        yield m


async def one_round(
    mesh: Mesh, model: str, rng: random.Random, first_id: int, victim: str
) -> list[Completion]:
    bodies = []
    for i in range(first_id, first_id + REQUESTS):
        body = {
            "model": model,
            "prompt": f"{i} " + "one two three four " * rng.randint(1, 15),
            "max_tokens": rng.randint(20, 120),
            "ignore_eos": True,
            "temperature": rng.choice([0.0, 0.8]),
            "seed": i,
            "stream": rng.random() < 0.5,
        }
        if body["stream"]:
            body["stream_options"] = {"include_usage": True}
        bodies.append(body)
    kill_after = rng.uniform(0.2, 1.5)

    async def kill_and_restart() -> None:
        await asyncio.sleep(kill_after)
        await asyncio.to_thread(mesh.kill, victim)
        await asyncio.to_thread(mesh.restart, victim)

    done, _ = await asyncio.gather(send_all(mesh.api, bodies), kill_and_restart())
    return done


def test_a_killed_service_loses_no_request(
    mesh: Mesh, stress_rounds: int, stress_seed: int, evidence_dir: Path
) -> None:
    model = httpx.get(f"{mesh.api}/models").json()["data"][0]["id"]
    spec = mesh.extra_env.get("MESHLLM_SPEC_METHOD", "plain")
    rng = random.Random(f"{stress_seed}-{spec}")
    check = RoundCheck(mesh, evidence_dir / spec)
    for round_no in range(stress_rounds):
        victim = VICTIMS[round_no % 2]
        done = asyncio.run(one_round(mesh, model, rng, round_no * 10_000, victim))
        check(round_no, [f"{victim} killed: {p}" for d in done if (p := ran_to_length(d))])
