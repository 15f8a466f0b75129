"""CPU decode throughput, every engine treated alike: the mesh vs transformers vs vLLM.

All engines are up at once and take turns in blocks: round after round, each engine serves
the same block of prompts (fresh token ids every block, so no prefix cache helps anyone), and
the median of per-round ratios is reported. On a shared VM whose speed drifts 2-4x over minutes,
measuring one engine after the other ranks the minutes, not the engines.

Alike for every engine:
- warm-up: one untimed block of each batch size before the first round;
- best-of-N: `--rounds` timed blocks per batch size; best, median and every round reported;
- token accounting: output tokens of the block over its wall time, prefill included. Serving
  engines (the mesh, vLLM) get `--prompts-per-batch` x batch requests at concurrency = batch
  through bench/serve.py (OpenAI API, streamed, usage counted); transformers `generate` runs
  the same prompts in batches of `batch` in this process.

Engines: `mesh` (gateway + scheduler + worker through infra/launcher.py, like `make up`;
`--mesh-env KEY=VALUE` sets its environment), `mesh-b` (a second mesh for an A/B of a setting
or a checkout: `--b-env`, `--b-repo`), `vllm` (`--vllm-python` of a venv with vLLM's CPU build),
`transformers` (fp32 by default, the precision of the reference figures in ENVIRONMENT.md).
For each mesh, the CPU seconds of its processes during its own blocks are reported per output
token: where a saturated 2-core machine's time goes (worker, scheduler, gateway, Redis).

    python -m bench.cpu_compare --rounds 3                                   # mesh vs transformers
    python -m bench.cpu_compare --engines mesh,vllm,transformers --vllm-python ~/vllm/bin/python
    python -m bench.cpu_compare --engines mesh,mesh-b --b-env MESHLLM_CPU_ATTENTION=torch --batch 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from bench import serve
from bench.baseline_transformers import TransformersDecode
from bench.processes import cpu_seconds, service_pids, start_mesh, start_vllm, stop

MESH_PROCESSES = ("worker", "scheduler", "gateway", "redis-server")


@dataclass
class Engine:
    name: str
    url: str = ""  # serving engines
    proc: subprocess.Popen[bytes] | None = None
    local: TransformersDecode | None = None  # in-process transformers
    pids: dict[str, int] = field(default_factory=dict)  # mesh processes, for CPU accounting
    cpu_s: dict[str, float] = field(default_factory=dict)
    tokens: int = 0


def _env(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"environment settings are KEY=VALUE, got {pair!r}")
        out[key] = value
    return out


def block(engine: Engine, batch: int, seed: int, args: argparse.Namespace) -> float:
    """Output tokens/s of one block: prompts-per-batch x batch prompts drawn with `seed`."""
    n = args.prompts_per_batch * batch
    before = {name: cpu_seconds(pid) for name, pid in engine.pids.items()}
    if engine.local is not None:
        prompts = serve.random_prompts(n, args.input_len, engine.local.vocab, seed)
        rates = [
            engine.local.tok_s(prompts[i : i + batch], args.output_len) for i in range(0, n, batch)
        ]
        # Tokens over time, not a mean of rates: every call makes the same number of tokens.
        tok_s = len(rates) / sum(1 / r for r in rates)
        engine.tokens += n * args.output_len
    else:
        ns = serve.parser().parse_args(
            [
                "--base-url", engine.url, "--num-prompts", str(n),
                "--max-concurrency", str(batch), "--input-len", str(args.input_len),
                "--output-len", str(args.output_len), "--seed", str(seed),
            ]
        )  # fmt: skip
        result = asyncio.run(serve.run(ns))
        if result["failed"]:
            raise RuntimeError(f"{engine.name}: {result['failed']} requests failed: {result}")
        tok_s = float(result["output_throughput"])
        engine.tokens += int(result["total_output_tokens"])
    for name, pid in engine.pids.items():
        engine.cpu_s[name] = engine.cpu_s.get(name, 0.0) + cpu_seconds(pid) - before[name]
    return tok_s


def start(args: argparse.Namespace, log_dir: Path) -> list[Engine]:
    engines: list[Engine] = []
    wanted = [e.strip() for e in args.engines.split(",") if e.strip()]
    mesh_env = {
        "MESHLLM_DTYPE": args.mesh_dtype,
        "MESHLLM_NUM_THREADS": str(args.threads),
        "MESHLLM_KV_CACHE_BYTES": str(512 * 2**20),
    }
    for i, name in enumerate(e for e in wanted if e in ("mesh", "mesh-b")):
        b = name == "mesh-b"
        env = {**mesh_env, **_env(args.b_env if b else args.mesh_env)}
        repo = {"repo": Path(args.b_repo)} if b and args.b_repo else {}
        proc, url = start_mesh(
            log_dir / name, env, port_offset=300 + 20 * i, redis_port=16398 + i, **repo
        )
        engines.append(Engine(name, url, proc, pids=service_pids(proc.pid, MESH_PROCESSES)))
    if "vllm" in wanted:
        if not args.vllm_python:
            raise SystemExit("--engines vllm needs --vllm-python")
        proc, url = start_vllm(args.vllm_python, model_dir(), log_dir, args.threads)
        engines.append(Engine("vllm", url, proc))
    if "transformers" in wanted:
        local = TransformersDecode(args.model_for_transformers, args.transformers_dtype, "cpu")
        engines.append(Engine(f"transformers ({args.transformers_dtype})", local=local))
    return engines


def model_dir() -> str:
    from shared.config import ModelSettings
    from shared.model.source import resolve_model

    settings = ModelSettings()
    return str(resolve_model(settings.model, settings.model_cache_dir).hf_dir)


def report(engines: list[Engine], rows: list[dict[str, float]], args: argparse.Namespace) -> None:
    base = next((e.name for e in engines if e.local is not None), engines[0].name)
    print(
        f"\n{args.threads} threads, input {args.input_len}, output {args.output_len}, greedy, ",
        end="",
    )
    print(f"eos ignored, {args.rounds} rounds; ratios: median over rounds of engine / {base}\n")
    print("| engine | batch | tok/s per round | best | median | ratio to " + base + " |")
    print("|---|---|---|---|---|---|")
    for batch in args.batch:
        mine = [r for r in rows if r["batch"] == batch]
        for e in engines:
            runs = [r[e.name] for r in mine]
            ratio = statistics.median(r[e.name] / r[base] for r in mine)
            cells = " / ".join(f"{x:.1f}" for x in runs)
            print(
                f"| {e.name} | {batch} | {cells} | {max(runs):.1f} | "
                f"{statistics.median(runs):.1f} | {ratio:.2f}x |"
            )
    for e in engines:
        if e.cpu_s and e.tokens:
            per = ", ".join(f"{n} {s / e.tokens * 1000:.2f}" for n, s in e.cpu_s.items())
            print(f"\n{e.name}: CPU ms per output token (its own blocks): {per}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--engines", default="mesh,transformers", help="mesh,mesh-b,vllm,transformers")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prompts-per-batch", type=int, default=2, help="block = this x batch")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mesh-dtype", default="bfloat16")
    p.add_argument("--mesh-env", nargs="*", default=[], metavar="KEY=VALUE")
    p.add_argument("--b-env", nargs="*", default=[], metavar="KEY=VALUE", help="mesh-b only")
    p.add_argument("--b-repo", default="", help="run mesh-b from this checkout")
    p.add_argument("--vllm-python", default="")
    p.add_argument("--transformers-dtype", default="float32")
    p.add_argument("--log-dir", default="bench/results", help="service logs (git-ignored)")
    p.add_argument("--out", default="", help="also write every round as JSON here")
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)  # the in-process transformers engine
    args.model_for_transformers = model_dir()
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    engines: list[Engine] = []
    rows: list[dict[str, float]] = []
    try:
        engines = start(args, log_dir)
        for batch in args.batch:
            for e in engines:
                block(e, batch, seed=10_000 + batch, args=args)  # warm-up, own prompts
                e.tokens, e.cpu_s = 0, {}
        for round_no in range(args.rounds):
            for batch in args.batch:
                seed = 1000 * round_no + batch  # the same prompts for every engine
                row: dict[str, float] = {"round": round_no, "batch": batch}
                for e in engines:
                    row[e.name] = block(e, batch, seed, args)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for e in engines:
            if e.proc is not None:
                stop(e.proc)
    if args.out:
        Path(args.out).write_text(json.dumps({"rounds": rows, "args": vars(args)}, indent=1))
    report(engines, rows, args)


if __name__ == "__main__":
    main()
