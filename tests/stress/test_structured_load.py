"""Structured outputs under load: 64 streamed completions a round, each with one of the e2e
module's JSON schemas, sampled or greedy, a fifth cut by the client, preemption and overlapped
steps. Every output that ends 'stop' must parse and validate against its schema.

This is the load that found xgrammar's length-bounded strings admitting raw control characters
(services/grammar/json_strings.py)."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest

from tests.e2e.test_structured_outputs import SCHEMAS
from tests.stress.rounds import Completion, RoundCheck, client_cuts, loaded_env, send_all
from tests.support.mesh import Mesh

CONCURRENCY = 64


@pytest.fixture(scope="module")
def mesh(tiny_env: dict[str, str]) -> Iterator[Mesh]:
    env = {**loaded_env(tiny_env, CONCURRENCY, 2**20), "MESHLLM_OVERLAP_STEPS": "on"}
    with Mesh(services=("gateway", "scheduler", "worker", "grammar"), env=env) as m:
        yield m


def schema_problem(done: Completion) -> str | None:
    if done.problem or done.cut or done.finish == "length":
        return done.problem
    name = done.body["response_format"]["json_schema"]["name"]
    if done.finish != "stop":
        return f"{name}: finish {done.finish!r}"
    try:
        jsonschema.validate(json.loads(done.text), SCHEMAS[name])
    except (ValueError, jsonschema.ValidationError) as exc:
        return f"{name}: {done.text[:200]!r}: {str(exc)[:200]}"
    return None


async def one_round(mesh: Mesh, model: str, rng: random.Random, first_id: int) -> list[Completion]:
    names = sorted(SCHEMAS)
    bodies = []
    for i in range(first_id, first_id + CONCURRENCY):
        name = rng.choice(names)
        schema = {"name": name, "schema": SCHEMAS[name]}
        bodies.append(
            {
                "model": model,
                "prompt": f"{i} Give {name}:",
                "max_tokens": 150,
                "stream": True,
                "temperature": rng.choice([0.0, 1.0]),
                "seed": i,
                "response_format": {"type": "json_schema", "json_schema": schema},
            }
        )
    return await send_all(mesh.api, bodies, client_cuts(rng, len(bodies)))


def test_every_finished_output_is_valid_json_for_its_schema(
    mesh: Mesh, stress_rounds: int, stress_seed: int, evidence_dir: Path
) -> None:
    model = httpx.get(f"{mesh.api}/models").json()["data"][0]["id"]
    rng = random.Random(stress_seed)
    check = RoundCheck(mesh, evidence_dir)
    finished = 0
    for round_no in range(stress_rounds):
        done = asyncio.run(one_round(mesh, model, rng, round_no * 10_000))
        finished += sum(d.finish == "stop" and not d.cut for d in done)
        check(round_no, [p for d in done if (p := schema_problem(d))])
    assert finished > 0, "no output finished 'stop': the schemas were never completed"
