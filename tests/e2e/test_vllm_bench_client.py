"""`vllm bench serve`, vLLM's own benchmark client (bench/vllm_client.py, built by `make
vllm-client`), drives the gateway: every request completes, and the gateway's streamed usage
counts exactly the tokens the client asked for. The GPU serving benchmark (#36) is measured
with this client, so a gateway change it cannot read fails here, not in a device call."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

import pytest

from bench import serve, vllm_client
from tests.support.mesh import Mesh


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    if not vllm_client.available():
        pytest.fail("vllm bench serve is not built: `make vllm-client` (`make test` builds it)")


def workload(mesh: Mesh, *argv: str) -> argparse.Namespace:
    return serve.parser().parse_args(["--base-url", mesh.api, "--timeout", "300", *argv])


def test_random_prompts_streamed_and_counted(mesh: Mesh, smollm2_dir: Path) -> None:
    args = workload(
        mesh, "--num-prompts", "8", "--max-concurrency", "4", "--input-len", "48",
        "--output-len", "12", "--goodput", "ttft:60000", "tpot:60000",
    )  # fmt: skip
    ran = asyncio.run(vllm_client.run(args, smollm2_dir))
    assert (ran["completed"], ran["failed"]) == (8, 0), ran.get("errors")
    # The client writes each prompt to 48 tokens with the model's tokenizer; the gateway's
    # usage chunk is what it counts, so both sides must agree on every token.
    assert ran["total_input_tokens"] == 8 * 48
    assert ran["total_output_tokens"] == 8 * 12  # ignore_eos honoured
    assert ran["max_concurrency"] == 4
    assert 0 < ran["median_ttft_ms"] < ran["median_e2el_ms"]
    assert ran["median_itl_ms"] > 0  # tokens arrived as a stream, not in one chunk
    assert ran["request_goodput"] > 0


def test_shared_prefixes_at_a_rate(mesh: Mesh, smollm2_dir: Path) -> None:
    """vllm's prefix_repetition dataset at a Poisson rate, in the same client process as a
    second run (Session): both complete with the prefixes' tokens counted."""

    async def two_runs() -> list[dict[str, Any]]:
        async with vllm_client.Session() as session:
            shared = workload(
                mesh, "--dataset", "shared-prefix", "--prefix-len", "64", "--num-prefixes", "2",
                "--input-len", "16", "--output-len", "8", "--num-prompts", "6",
                "--request-rate", "20",
            )  # fmt: skip
            plain = workload(mesh, "--num-prompts", "2", "--input-len", "20", "--output-len", "4")
            return [await session.run(shared, smollm2_dir), await session.run(plain, smollm2_dir)]

    shared, plain = asyncio.run(two_runs())
    assert (shared["completed"], shared["failed"]) == (6, 0), shared.get("errors")
    assert shared["total_input_tokens"] == 6 * (64 + 16)
    assert shared["total_output_tokens"] == 6 * 8
    assert shared["request_rate"] == 20.0
    assert (plain["completed"], plain["total_output_tokens"]) == (2, 8), plain.get("errors")
