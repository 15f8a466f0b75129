"""64 concurrent requests all complete, and the scheduler does not keep anything per request:
its memory and its bookkeeping return to the same level after a second round."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai

from tests.support.mesh import Mesh

CONCURRENCY = 64


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def _round(mesh: Mesh, model: str, tag: str) -> list[openai.types.Completion]:
    client = openai.AsyncOpenAI(base_url=mesh.api, api_key="x", max_retries=0, timeout=600)
    try:
        return await asyncio.gather(
            *(
                client.completions.create(
                    model=model,
                    prompt=f"Request {tag}-{i}: the number {i} is",
                    max_tokens=8,
                    temperature=0.7,
                    seed=i,
                    extra_body={"ignore_eos": True},
                )
                for i in range(CONCURRENCY)
            )
        )
    finally:
        await client.close()


def test_64_concurrent_requests_complete_and_memory_is_flat(mesh: Mesh, model_name: str):
    pid = mesh.procs["scheduler"].pid
    results = []
    rss = []
    for tag in ("a", "b", "c"):
        results.append(asyncio.run(_round(mesh, model_name, tag)))
        rss.append(_rss_kib(pid))
    for batch in results:
        assert len(batch) == CONCURRENCY
        assert all(r.usage.completion_tokens == 8 for r in batch)
        assert all(r.choices[0].finish_reason == "length" for r in batch)
    state = mesh.admin_state("scheduler")
    assert state["inflight_entries"] == 0
    assert state["scheduler"]["num_running"] == 0 and state["scheduler"]["num_waiting"] == 0
    # Round one warms up allocator pools and caches; later rounds must not add to them.
    assert rss[2] - rss[1] < 4 * 1024, rss
