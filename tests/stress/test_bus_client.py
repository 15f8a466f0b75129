"""A bus client (the benchmark's, bench.gpu.mesh_decode.run_batch) submitting 256 requests a
round straight onto the scheduler's stream, each round under a new reply stream and gateway
heartbeat, into a KV cache too small for them all (preemption). Every request must finish.

This is the load that found a new gateway's first requests aborted as orphans (edabb89): the
scheduler outlives MESHLLM_GATEWAY_TIMEOUT_S (3 s here) within a few rounds."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.gpu.mesh_decode import run_batch
from tests.stress.rounds import RoundCheck
from tests.support.mesh import Mesh

BATCH = 256


@pytest.fixture(scope="module")
def mesh(tiny_env: dict[str, str]) -> Iterator[Mesh]:
    env = {
        **tiny_env,
        "MESHLLM_MAX_MODEL_LEN": "64",
        "MESHLLM_KV_CACHE_BYTES": str(2**19),
        "MESHLLM_MAX_NUM_SEQS": str(BATCH),
        "MESHLLM_MAX_NUM_BATCHED_TOKENS": "512",
        "MESHLLM_ASYNC_SCHEDULING": "true",
        "MESHLLM_GATEWAY_TIMEOUT_S": "3",
    }
    with Mesh(services=("scheduler", "worker"), env=env) as m:
        yield m


def test_every_round_of_bus_requests_finishes(
    mesh: Mesh, stress_rounds: int, stress_seed: int, evidence_dir: Path
) -> None:
    check = RoundCheck(mesh, evidence_dir)
    args = argparse.Namespace(prompt=20, output=12, vocab=256, timeout=60.0)
    for round_no in range(stress_rounds):
        problems = []
        try:
            asyncio.run(run_batch(mesh, BATCH, args, f"s{stress_seed}-{round_no}"))
        except (TimeoutError, RuntimeError) as exc:  # unfinished, or an error delta
            problems.append(repr(exc)[:500])
        check(round_no, problems)
