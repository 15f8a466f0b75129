"""Request migration: how long the streams of a killed worker group stall, and how many tokens
their requests did not generate again, with progress checkpoints on and off.

Through the real mesh on CPU: two worker groups (gateway, scheduler + worker for groups 0 and
1, a private redis-server; SmolLM2-135M-Instruct), round-robin routing so each group runs half
of `--streams` streamed completions (greedy and seeded alternately, ignore_eos). Once every
stream delivered `--kill-at` tokens, group 1's scheduler (or `--victim`) is killed with -9;
group 0 claims its requests once idle `MESHLLM_CLAIM_IDLE_MS` (2 s here) and continues them.
Per stream, the client measures: tokens delivered at the kill, and the time from the kill to
the next token that stream receives (the stall; a group-0 stream's is one step). From group
0's scheduler: requests resumed from a checkpoint or from the prompt, and the output tokens
the resumed ones skipped (`meshllm:scheduler_resumed_skipped_tokens_sum`: decode steps not
done again). Each `--checkpoint-s` value (0 = off) runs on a fresh mesh.

    python -m bench.migration [--checkpoint-s 1 0] [--streams 8] [--kill-at 48]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import threading
import time

import openai

from tests.support.mesh import Mesh

TOPICS = ("harbour logistics", "alpine botany", "medieval bookbinding")
PREFIXES = [
    " ".join(f"Section {i} of the {t} manual describes step {i} in detail." for i in range(24))
    for t in TOPICS
]
ENV = {
    "MESHLLM_KV_CACHE_BYTES": str(256 * 2**20),
    "MESHLLM_MAX_MODEL_LEN": "4096",
    "MESHLLM_NUM_THREADS": "1",
    "MESHLLM_OVERLAP_STEPS": "on",
    "MESHLLM_HEARTBEAT_INTERVAL_S": "0.5",
    "MESHLLM_CLAIM_IDLE_MS": "2000",
    "MESHLLM_MAX_NUM_SEQS": "8",
    "MESHLLM_ROUTER_POLICY": "round_robin",
}


def run(checkpoint_s: float, streams: int, kill_at: int, max_tokens: int, victim: str) -> dict:
    env = {**ENV, "MESHLLM_PROGRESS_CHECKPOINT_S": str(checkpoint_s)}
    with Mesh(env=env, groups=2) as mesh:
        client = openai.OpenAI(base_url=mesh.api, api_key="x", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        arrivals: list[list[tuple[float, int]]] = [[] for _ in range(streams)]

        def one(i: int) -> None:
            sampling = {"temperature": 0} if i % 2 else {"temperature": 0.9, "seed": 1000 + i}
            stream = client.completions.create(
                model=model,
                prompt=f"{PREFIXES[i % 3]}\nStory {i}:",
                max_tokens=max_tokens,
                stream=True,
                logprobs=0,
                extra_body={"ignore_eos": True},
                **sampling,  # type: ignore[arg-type]
            )
            n = 0
            for chunk in stream:
                logprobs = chunk.choices[0].logprobs
                if logprobs and logprobs.tokens:
                    n += len(logprobs.tokens)
                    arrivals[i].append((time.monotonic(), n))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
        for t in threads:
            t.start()
        while min((a[-1][1] if a else 0) for a in arrivals) < kill_at:
            time.sleep(0.005)
        killed = time.monotonic()
        mesh.kill(victim, signal.SIGKILL)
        for t in threads:
            t.join(600)
        per_stream = []
        for a in arrivals:
            after = [t for t, _ in a if t > killed]
            per_stream.append(
                {
                    "delivered_at_kill": max(n for t, n in a if t <= killed),
                    "stall_s": round(after[0] - killed, 3) if after else None,
                    "total": a[-1][1],
                }
            )
        progress = mesh.admin_state("scheduler")["progress"]
        skipped = mesh.metric("scheduler", "meshllm:scheduler_resumed_skipped_tokens_sum")
    moved = [s["stall_s"] for s in per_stream if s["stall_s"] is not None and s["stall_s"] > 1]
    return {
        "checkpoint_s": checkpoint_s,
        "moved_streams": len(moved),
        "stall_s_median": statistics.median(moved) if moved else None,
        "stall_s_max": max(moved) if moved else None,
        "resumed_from_checkpoint": progress["resumed_from_checkpoint"],
        "resumed_from_prompt": progress["resumed_from_prompt"],
        "skipped_tokens": skipped,
        "streams": per_stream,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint-s", type=float, nargs="+", default=[1.0, 0.0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--kill-at", type=int, default=48, help="tokens every stream has first")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--victim", default="scheduler-g1", choices=["scheduler-g1", "worker-g1"])
    args = parser.parse_args()
    for checkpoint_s in args.checkpoint_s:
        result = run(checkpoint_s, args.streams, args.kill_at, args.max_tokens, args.victim)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
