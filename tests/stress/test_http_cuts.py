"""Streamed completions through the gateway, 128 at once, a fifth of them dropped by their
client after a few chunks, into a KV cache that forces preemption, with overlapped steps; once
with distinct prompts, once with prompts sharing prefixes (the prefix cache). Every request not
cut must run to max_tokens."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.stress.rounds import Completion, RoundCheck, complete, ran_to_length
from tests.support.mesh import Mesh

CONCURRENCY = 128


@pytest.fixture(scope="module")
def mesh(tiny_env: dict[str, str]) -> Iterator[Mesh]:
    env = {
        **tiny_env,
        "MESHLLM_KV_CACHE_BYTES": str(2**20),
        "MESHLLM_MAX_NUM_SEQS": str(CONCURRENCY),
        "MESHLLM_MAX_NUM_BATCHED_TOKENS": "1024",
        "MESHLLM_MAX_PENDING_REQUESTS": "4096",
        "MESHLLM_MAX_QUEUED_PER_GROUP": "0",
        "MESHLLM_OVERLAP_STEPS": "on",
    }
    with Mesh(services=("gateway", "scheduler", "worker"), env=env) as m:
        yield m


async def one_round(
    mesh: Mesh, model: str, rng: random.Random, first_id: int, shared: bool
) -> list[Completion]:
    bodies = []
    for i in range(first_id, first_id + CONCURRENCY):
        words = "word " * rng.randint(1, 60)
        bodies.append(
            {
                "model": model,
                "prompt": words + str(i) if shared else f"{i} {words}",
                "max_tokens": rng.randint(1, 40),
                "stream": True,
                "stream_options": {"include_usage": True},
                "ignore_eos": True,
                "temperature": rng.choice([0.0, 1.0]),
                "seed": i,
            }
        )
    cuts = [rng.randint(1, 5) if rng.random() < 0.2 else None for _ in bodies]
    limits = httpx.Limits(max_connections=CONCURRENCY + 8)
    async with httpx.AsyncClient(limits=limits) as client:
        return await asyncio.gather(
            *(complete(client, mesh.api, b, cut) for b, cut in zip(bodies, cuts, strict=True))
        )


@pytest.mark.parametrize("prefixes", ["distinct", "shared"])
def test_cut_and_preempted_streams_lose_nothing(
    mesh: Mesh, prefixes: str, stress_rounds: int, stress_seed: int, evidence_dir: Path
) -> None:
    model = httpx.get(f"{mesh.api}/models").json()["data"][0]["id"]
    rng = random.Random(f"{stress_seed}-{prefixes}")
    check = RoundCheck(mesh, evidence_dir / prefixes)
    for round_no in range(stress_rounds):
        shared = prefixes == "shared"
        done = asyncio.run(one_round(mesh, model, rng, round_no * 10_000, shared))
        check(round_no, [p for d in done if (p := ran_to_length(d))])
