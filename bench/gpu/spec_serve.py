"""n-gram speculation as users see it: the copy-heavy tasks of bench/spec_ngram.py as chat
completions through the gateway, against the same mesh without speculation.

    python3 -m bench.gpu.spec_serve --model SmolLM2.gguf --out $OUT/spec_serve.json   # GPU
    .venv/bin/python -m bench.gpu.spec_serve --dry-run                                  # CPU

Two meshes are up at once (tests/support/mesh.py: redis-server, gateway, scheduler, worker
processes each), the same model, one with MESHLLM_SPEC_METHOD=ngram (MESHLLM_SPEC_TOKENS=K,
prompt lookup n = 2..4), one without; everything else at its default, so plain decoding keeps
the worker's asynchronous scheduling and overlapped steps (a speculating worker's verify steps
overlap when chained on the device: MESHLLM_SPEC_DEVICE_CHAIN, on for CUDA). Per concurrency c
(`--concurrency`) and task, `--repeats` rounds of each mesh in ABBA order: c chat requests at
once (each prompt opened by its own number, as bench/spec_ngram.py --batch does), greedy,
`--max-tokens` each;
output tok/s = completion tokens of the round / its wall time. Reported per task: the best of
each mesh, the median of the rounds' ratios, and whether the two meshes answered the same
texts. `--against` adds speculating meshes to the rotation, each compared with the default
one (median ratio of rounds): `carried` (MESHLLM_SPEC_DRAFTS_ON_WORKER=false: drafts carried by
the scheduler, each verify step planned from the previous result; `ahead_vs_carried`) and
`unchained` (MESHLLM_SPEC_DEVICE_CHAIN=off: verify steps planned ahead, but drafted, laid out
and accepted on the host, each waiting for the previous step's tokens; `chained_vs_unchained`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai

from bench.spec_ngram import TASKS
from services.worker.runner.step_timeline_report import phase_medians
from tests.support.mesh import Mesh

#: --against: the speculating mesh's extra settings, and the name of its ratio column
AGAINST = {
    "carried": ({"MESHLLM_SPEC_DRAFTS_ON_WORKER": "false"}, "ahead_vs_carried"),
    "unchained": ({"MESHLLM_SPEC_DEVICE_CHAIN": "off"}, "chained_vs_unchained"),
}


def chat_round(api: str, model: str, text: str, c: int, max_tokens: int) -> tuple[float, list[str]]:
    """c requests of the task at once: (output tok/s, each answer's text in order)."""
    client = openai.OpenAI(base_url=api, api_key="unused", max_retries=0, timeout=600)

    def one(i: int) -> tuple[int, str]:
        content = f"Request {i + 1}.\n{text}" if c > 1 else text
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": content}],
            max_tokens=max_tokens,
            temperature=0.0,
        )
        assert reply.usage is not None
        return reply.usage.completion_tokens, reply.choices[0].message.content or ""

    started = time.perf_counter()
    with ThreadPoolExecutor(c) as pool:
        answers = list(pool.map(one, range(c)))
    seconds = time.perf_counter() - started
    return sum(n for n, _ in answers) / seconds, [t for _, t in answers]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="HF directory or .gguf (default: SmolLM2)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=None, help="[1, 16]")
    parser.add_argument("--repeats", type=int, default=None, help="rounds per mesh and task (2)")
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=None, help="128")
    parser.add_argument("--out", default="")
    parser.add_argument(
        "--prefill-graph-tokens",
        type=int,
        default=0,
        help="MESHLLM_PREFILL_GRAPH_TOKENS of both meshes (prefill/mixed steps from graphs)",
    )
    parser.add_argument(
        "--step-timeline",
        default="",
        help="a directory: each mesh's worker writes its step timeline there (MESHLLM_STEP_"
        "TIMELINE: plain.jsonl, spec.jsonl) and the result holds the median ms between the host "
        "marks of the plain mesh's decode steps and the speculating mesh's verify steps "
        "(`before`: from a step's result to the next step's launch, the bus and the scheduler)",
    )
    parser.add_argument(
        "--against",
        nargs="*",
        choices=list(AGAINST),
        default=[],
        help="more speculating meshes to compare with the default one (module doc)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="CPU, fp32; unless given c=1, 1 round, 16 tokens"
    )
    args = parser.parse_args()
    defaults = ([1], 1, 16) if args.dry_run else ([1, 16], 2, 128)
    args.concurrency = args.concurrency or defaults[0]
    args.repeats = args.repeats or defaults[1]
    args.max_tokens = args.max_tokens or defaults[2]
    env = {
        "MESHLLM_MODEL": args.model,
        "MESHLLM_DEVICE": "cpu" if args.dry_run else "cuda",
        "MESHLLM_DTYPE": "float32" if args.dry_run else "bfloat16",
        "MESHLLM_MAX_MODEL_LEN": "1024",
        "MESHLLM_MAX_NUM_SEQS": str(max(args.concurrency)),
        "MESHLLM_LOG_JSON": "false",
        "MESHLLM_PREFILL_GRAPH_TOKENS": str(args.prefill_graph_tokens),
        "MESHLLM_GEMV_MAX_ROWS": os.environ.get("MESHLLM_GEMV_MAX_ROWS", "16"),
    }
    if not args.dry_run:
        env["MESHLLM_KV_CACHE_BYTES"] = str(4 * 2**30)
    spec_env = {**env, "MESHLLM_SPEC_METHOD": "ngram", "MESHLLM_SPEC_TOKENS": str(args.k)}
    envs = {"plain": env, "spec": spec_env}
    for name in args.against:
        envs[name] = {**spec_env, **AGAINST[name][0]}
    timelines = {}
    if args.step_timeline:
        folder = Path(args.step_timeline).resolve()
        folder.mkdir(parents=True, exist_ok=True)
        timelines = {name: folder / f"{name}.jsonl" for name in envs}
        for name, path in timelines.items():
            path.unlink(missing_ok=True)
            envs[name]["MESHLLM_STEP_TIMELINE"] = str(path)
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        meshes = {n: stack.enter_context(Mesh(env=e, ready_timeout=600)) for n, e in envs.items()}
        api = meshes["plain"].api
        model = openai.OpenAI(base_url=api, api_key="unused").models.list().data[0].id
        for name in meshes:  # warm-up: first requests of each shape
            chat_round(meshes[name].api, model, "Say hello.", max(args.concurrency), 8)
        names = list(meshes)
        for c in args.concurrency:
            for task, text in TASKS.items():
                tok_s: dict[str, list[float]] = {name: [] for name in names}
                texts: dict[str, list[str]] = {}
                for r in range(args.repeats):
                    order = names if r % 2 == 0 else names[::-1]  # ABBA (ABCCBA)
                    for name in order:
                        rate, texts[name] = chat_round(
                            meshes[name].api, model, text, c, args.max_tokens
                        )
                        tok_s[name].append(rate)
                row = {
                    "concurrency": c,
                    "task": task,
                    "plain_tok_s": round(max(tok_s["plain"]), 1),
                    "spec_tok_s": round(max(tok_s["spec"]), 1),
                    "speedup_median": _median_ratio(tok_s["spec"], tok_s["plain"]),
                    "same_texts": texts["plain"] == texts["spec"],
                }
                for name in args.against:
                    row[f"{name}_tok_s"] = round(max(tok_s[name]), 1)
                    row[AGAINST[name][1]] = _median_ratio(tok_s["spec"], tok_s[name])
                    row["same_texts"] = row["same_texts"] and texts[name] == texts["plain"]
                rows.append(row)
                print(json.dumps(rows[-1]), flush=True)
    result = {
        "k": args.k,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "prefill_graph_tokens": args.prefill_graph_tokens,
        "gemv_max_rows": int(env["MESHLLM_GEMV_MAX_ROWS"]),
        "runs": rows,
    }
    if timelines:  # the whole run's steps, warm-up included (medians)
        result["phases_ms"] = {
            f"{name} {kind}": phase_medians(
                [json.loads(line) for line in timelines[name].read_text().splitlines()], kind
            )
            for name in timelines
            for kind in (("decode",) if name == "plain" else ("verify",))
        }
        print(json.dumps(result["phases_ms"]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


def _median_ratio(a: list[float], b: list[float]) -> float:
    return round(statistics.median(x / y for x, y in zip(a, b, strict=True)), 2)


if __name__ == "__main__":
    main()
