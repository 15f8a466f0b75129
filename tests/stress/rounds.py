"""What every stress module does each round: stream completions through the gateway, then check
that the scheduler let go of everything the round brought."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.gpu.gateway_serve import keep_evidence
from tests.support.mesh import Mesh


@dataclass
class Completion:
    """One request as its client saw it. `problem` is set for anything but a clean end or a cut
    the client made itself (an HTTP error status, an error event, a stream without a finish)."""

    body: dict[str, Any]
    text: str = ""
    finish: str | None = None
    completion_tokens: int | None = None
    cut: bool = False
    problem: str | None = None


async def complete(
    client: httpx.AsyncClient, api: str, body: dict[str, Any], cut_after: int | None = None
) -> Completion:
    """POST /completions; streamed bodies are read chunk by chunk and, with `cut_after`, dropped
    by the client after that many chunks (the connection closed mid-stream)."""
    done = Completion(body)
    if not body.get("stream"):
        resp = await client.post(f"{api}/completions", json=body, timeout=300)
        if resp.status_code != 200:
            done.problem = f"HTTP {resp.status_code}: {resp.text[:300]}"
            return done
        data = resp.json()
        choice = data["choices"][0]
        done.text, done.finish = choice["text"], choice["finish_reason"]
        done.completion_tokens = data["usage"]["completion_tokens"]
        return done
    chunks = 0
    async with client.stream("POST", f"{api}/completions", json=body, timeout=300) as resp:
        if resp.status_code != 200:
            done.problem = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
            return done
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                done.problem = f"error event: {event['error']}"
                return done
            for choice in event.get("choices", []):
                done.text += choice.get("text") or ""
                done.finish = choice.get("finish_reason") or done.finish
                chunks += 1
            if event.get("usage"):
                done.completion_tokens = event["usage"]["completion_tokens"]
            if cut_after is not None and chunks >= cut_after:
                done.cut = True
                return done
    if done.finish is None:
        done.problem = "the stream ended without a finish reason"
    return done


def loaded_env(base: dict[str, str], concurrency: int, kv_bytes: int) -> dict[str, str]:
    """`base` for a mesh that takes `concurrency` requests at once into `kv_bytes` of KV (too
    little for all of them: preemption), none refused or held back at the gateway."""
    return {
        **base,
        "MESHLLM_KV_CACHE_BYTES": str(kv_bytes),
        "MESHLLM_MAX_NUM_SEQS": str(concurrency),
        "MESHLLM_MAX_NUM_BATCHED_TOKENS": "1024",
        "MESHLLM_MAX_PENDING_REQUESTS": "4096",
        "MESHLLM_MAX_QUEUED_PER_GROUP": "0",
    }


def client_cuts(rng: random.Random, count: int) -> list[int | None]:
    """For each of `count` requests: None, or (a fifth of them) the chunk after which its
    client drops the stream."""
    return [rng.randint(1, 5) if rng.random() < 0.2 else None for _ in range(count)]


async def send_all(
    api: str, bodies: list[dict[str, Any]], cuts: list[int | None] | None = None
) -> list[Completion]:
    """Every body at once, each on a connection of its own."""
    limits = httpx.Limits(max_connections=len(bodies) + 8)
    async with httpx.AsyncClient(limits=limits) as client:
        return await asyncio.gather(
            *(
                complete(client, api, body, cut)
                for body, cut in zip(bodies, cuts or [None] * len(bodies), strict=True)
            )
        )


def ran_to_length(done: Completion) -> str | None:
    """For requests with ignore_eos: what is wrong unless it ended 'length' with max_tokens."""
    if done.problem or done.cut:
        return done.problem
    want = done.body["max_tokens"]
    if done.finish != "length" or done.completion_tokens != want:
        return f"finish {done.finish!r} after {done.completion_tokens} of {want} tokens"
    return None


def holds_nothing(state: dict[str, Any]) -> bool:
    return (
        not state["running_request_ids"]
        and not state["waiting_request_ids"]
        and state["inflight_entries"] == 0
    )


class RoundCheck:
    """After each round: the scheduler idle within `settle_s` and its free KV blocks back at the
    first round's count; otherwise the evidence is kept and the round fails."""

    def __init__(self, mesh: Mesh, evidence: Path, settle_s: float = 30.0) -> None:
        self.mesh, self.evidence, self.settle_s = mesh, evidence, settle_s
        self.free_blocks: int | None = None

    def settled_state(self) -> dict[str, Any]:
        deadline = time.monotonic() + self.settle_s
        while True:
            state = self.mesh.admin_state("scheduler")
            if holds_nothing(state) or time.monotonic() > deadline:
                return state
            time.sleep(0.2)

    def __call__(self, round_no: int, problems: list[str]) -> None:
        state = self.settled_state()
        free = state["scheduler"]["num_free_blocks"]
        if self.free_blocks is None:
            self.free_blocks = free
        faults = [*problems]
        if not holds_nothing(state):
            faults.append(
                f"scheduler still holds running {state['running_request_ids'][:5]}, waiting "
                f"{state['waiting_request_ids'][:5]}, {state['inflight_entries']} in flight"
            )
        if free != self.free_blocks:
            faults.append(f"{free} free KV blocks, {self.free_blocks} after the first round")
        print(f"round {round_no}: {len(problems)} problems, {free} free blocks", flush=True)
        if faults:
            keep_evidence(self.mesh, self.evidence / f"round-{round_no}")
            shown = "\n".join(faults[:8])
            raise AssertionError(
                f"round {round_no}: {len(faults)} faults (evidence in {self.evidence}):\n{shown}"
            )
