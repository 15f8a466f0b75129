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

from tests.stress.rounds import (
    Completion,
    RoundCheck,
    client_cuts,
    loaded_env,
    ran_to_length,
    send_all,
)
from tests.support.mesh import Mesh

CONCURRENCY = 128


@pytest.fixture(scope="module")
def mesh(tiny_env: dict[str, str]) -> Iterator[Mesh]:
    env = {**loaded_env(tiny_env, CONCURRENCY, 2**20), "MESHLLM_OVERLAP_STEPS": "on"}
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
    return await send_all(mesh.api, bodies, client_cuts(rng, len(bodies)))


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
