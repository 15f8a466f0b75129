"""GPU serving as users measure it: through the gateway, with a real tokenizer, driven by an
OpenAI-API benchmark client: `vllm bench serve` itself (`--client vllm`, bench/vllm_client.py;
`make vllm-client` builds it) or bench/serve.py (`--client builtin`, the same metrics; token-id
prompts, so the gateway does not tokenize them). With several `--client`s the gateway-cost
runs drive every one of them and the datasets the first.

    python3 -m bench.gpu.gateway_serve --out $OUT/gateway_serve.json        # GPU (run.sh serve)
    .venv/bin/python -m bench.gpu.gateway_serve --dry-run                    # CPU, tiny model

The model: the Llama-3-8B shape with random bf16 weights (MESHLLM_LOAD_FORMAT=dummy) and the
embedded SmolLM2 tokenizer and its vocabulary (49,152), in a directory of config.json and
tokenizer files, so the gateway tokenizes, validates and detokenizes for real while the worker
builds random weights at the config's shapes. One mesh: redis-server, gateway, scheduler,
worker processes (tests/support/mesh.py).

1. Gateway cost: per concurrency (`--concurrency`, default 1 16 64 256), `--repeats` times,
   alternating, the same shape two ways: `c` requests of `--prompt` random token ids and
   `--output` greedy tokens (ignore_eos) at once, (a) put on the scheduler's request stream
   as token ids (bench/gpu/mesh_decode.py's run_batch: no gateway), (b) streamed through
   `/v1/completions` by each client, in ABBA order (direct first on even repeats). Output
   tok/s of each, best-of-N, with the scheduler's steps and each process's CPU per token; the
   target is gateway >= 95% of direct at every concurrency.
2. Closed loop through the gateway: random dataset, `2 c` prompts at max concurrency `c`,
   with output tok/s, TTFT/TPOT/ITL p50/p99 and goodput under `--goodput` (default TTFT 2 s,
   TPOT 50 ms).
3. Shared-prefix dataset (8 prefixes of 1,024 tokens + 128 own) at concurrency 64.
4. Request-rate sweep (`--rates`, Poisson arrivals, at most 256 in flight).
5. Long prompts through the gateway (`--long`, default 8,192 and 32,768 tokens, concurrency 1):
   TTFT and decode speed after it; the context is sized to the longest.

Every run draws prompts of its own (its seed or tag), so no run is served from an earlier
run's prefix cache except where the dataset shares prefixes on purpose.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import serve, vllm_client
from bench.gpu.clocks import ClockSampler
from bench.gpu.mesh_decode import TINY, run_batch, scrape, start_phases
from bench.processes import tree_cpu_seconds
from services.worker.models.random_init import PRESETS
from shared.model.source import resolve_model
from tests.support.mesh import Mesh

#: What the model directory takes from the tokenizer's directory (besides config values).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def tokenizer_dir(path: str) -> Path:
    """The directory with the SmolLM2 tokenizer: `path` (the GPU bundle's .tokenizer/), else
    the embedded model's converted copy."""
    if path:
        return Path(path)
    return resolve_model("", Path("~/.cache/meshllm").expanduser()).hf_dir


def model_dir(shape: dict[str, Any], tokenizer: Path, out: Path, context: int) -> Path:
    """A directory the whole mesh serves: `shape` with the tokenizer's vocabulary and special
    ids (config.json), the tokenizer files beside it, no weights."""
    own = json.loads((tokenizer / "config.json").read_text())
    config = {
        **shape,
        "vocab_size": own["vocab_size"],
        "bos_token_id": own["bos_token_id"],
        "eos_token_id": own["eos_token_id"],
        "max_position_embeddings": max(shape["max_position_embeddings"], context),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in TOKENIZER_FILES:
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, out / name)
    return out


def serve_args(base_url: str, vocab: int, **overrides: Any) -> argparse.Namespace:
    """bench/serve.py's arguments: its defaults, then `overrides`."""
    args = serve.parser().parse_args(["--base-url", base_url, "--vocab", str(vocab)])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The figures a results table takes from one bench/serve.py run."""
    keys = (
        "completed", "failed", "duration", "client_wall_s", "total_input_tokens",
        "total_output_tokens",
        "output_throughput", "request_goodput",
        "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
        "median_itl_ms", "p99_itl_ms", "errors",
    )  # fmt: skip
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in result.items() if k in keys}


class RunCosts:
    """What one run cost besides its wall time: the scheduler's steps (and their mean wall
    time), each service process's CPU time per output token, and the GPU's clocks and power
    over the run (bench/gpu/clocks.py; none on a CPU)."""

    def __init__(self, mesh: Mesh) -> None:
        self.clocks = ClockSampler()
        self.mesh = mesh
        self.pids = {name: proc.pid for name, proc in mesh.procs.items()}
        self.metrics = scrape(mesh)
        self.cpu = {name: tree_cpu_seconds(pid) for name, pid in self.pids.items()}

    def since(self, output_tokens: int) -> dict[str, Any]:
        now = scrape(self.mesh)
        steps = now["scheduler_step_seconds_count"] - self.metrics["scheduler_step_seconds_count"]
        step_s = now["scheduler_step_seconds_sum"] - self.metrics["scheduler_step_seconds_sum"]
        out: dict[str, Any] = {
            "steps": int(steps),
            "step_ms_mean": round(1000 * step_s / steps, 2) if steps else None,
        }
        for name, pid in self.pids.items():
            used = tree_cpu_seconds(pid) - self.cpu[name]
            out[f"{name}_cpu_us_per_token"] = round(1e6 * used / max(output_tokens, 1), 1)
        if gpu := self.clocks.stop():
            out["gpu"] = gpu
        return out


async def direct_run(
    mesh: Mesh, c: int, args: argparse.Namespace, vocab: int, repeat: int
) -> tuple[float, dict[str, Any]]:
    """`c` requests put on the scheduler's request stream (no gateway): (output tok/s, costs)."""
    shape = argparse.Namespace(
        prompt=args.prompt, output=args.output, vocab=vocab, timeout=args.timeout
    )
    before = RunCosts(mesh)
    got = await run_batch(mesh, c, shape, f"direct-{c}-{repeat}")
    return got["throughput_tok_s"], {"path": "direct", **before.since(c * args.output)}


#: The `vllm bench serve` process every run of a benchmark shares (its imports paid once).
VLLM = vllm_client.Session()


async def drive(client: str, workload: argparse.Namespace, tokenizer: Path) -> dict[str, Any]:
    """One benchmark run of `workload` (bench/serve.py's arguments) by `client`, with the
    client's whole wall time (`client_wall_s`: its start and prompt making included)."""
    started = time.monotonic()
    if client == "vllm":
        ran = await VLLM.run(workload, tokenizer)
    else:
        ran = await serve.run(workload)
    return ran | {"client_wall_s": time.monotonic() - started}


async def gateway_run(
    mesh: Mesh, c: int, args: argparse.Namespace, vocab: int, repeat: int, client: str
) -> tuple[float, dict[str, Any]]:
    """The same shape streamed through the gateway by `client`: (output tok/s, costs)."""
    before = RunCosts(mesh)
    workload = serve_args(
        mesh.api, vocab, num_prompts=c, max_concurrency=c, input_len=args.prompt,
        output_len=args.output, seed=10_000 * c + repeat, goodput=args.goodput,
    )  # fmt: skip
    ran = await drive(client, workload, args.served)
    if ran["failed"]:
        raise RuntimeError(f"gateway run at {c} ({client}): {ran.get('errors')}")
    costs = {"path": f"gateway-{client}", **before.since(ran["total_output_tokens"])}
    return round(ran["output_throughput"], 1), costs


async def gateway_cost(mesh: Mesh, args: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    """Direct (bus) and gateway runs (one per client) of the same shape per concurrency, in
    ABBA order."""
    rows = []
    for c in args.concurrency:
        tok_s: dict[str, list[float]] = {"direct": []} | {f"gateway-{k}": [] for k in args.client}
        costs = []
        for repeat in range(args.repeats):
            paths = ["direct", *args.client]
            for path in paths if repeat % 2 == 0 else reversed(paths):
                if path == "direct":
                    speed, cost = await direct_run(mesh, c, args, vocab, repeat)
                else:
                    speed, cost = await gateway_run(mesh, c, args, vocab, repeat, path)
                tok_s[cost["path"]].append(speed)
                costs.append(cost)
        row: dict[str, Any] = {"concurrency": c, "direct_tok_s": tok_s["direct"]}
        for client in args.client:
            row[f"gateway_{client}_tok_s"] = tok_s[f"gateway-{client}"]
            best = max(tok_s[f"gateway-{client}"]) / max(tok_s["direct"])
            row[f"gateway_{client}_over_direct"] = round(best, 4)
        row["costs"] = costs
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


async def datasets(mesh: Mesh, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """Closed-loop, shared-prefix, request-rate and long-prompt runs through the gateway, driven
    by the first client."""
    client = args.client[0]
    out: dict[str, Any] = {
        "client": client, "closed_loop": [], "shared_prefix": {}, "rates": [], "long": [],
    }  # fmt: skip
    common = dict(goodput=args.goodput, output_len=args.output)
    for c in args.concurrency if args.closed_loop is None else args.closed_loop:
        ran = await drive(
            client,
            serve_args(
                mesh.api, vocab, num_prompts=2 * c, max_concurrency=c, input_len=args.prompt,
                seed=20_000 + c, **common,
            ),
            args.served,
        )  # fmt: skip
        out["closed_loop"].append({"concurrency": c, **summary(ran)})
        print(json.dumps(out["closed_loop"][-1]), flush=True)
    if args.shared_concurrency:
        ran = await drive(
            client,
            serve_args(
                mesh.api, vocab, dataset="shared-prefix", num_prompts=4 * args.shared_concurrency,
                max_concurrency=args.shared_concurrency, prefix_len=args.shared_prefix,
                num_prefixes=8, input_len=128, seed=30_000, **common,
            ),
            args.served,
        )  # fmt: skip
        out["shared_prefix"] = {"concurrency": args.shared_concurrency, **summary(ran)}
        print(json.dumps(out["shared_prefix"]), flush=True)
    for rate in args.rates:
        ran = await drive(
            client,
            serve_args(
                mesh.api, vocab, num_prompts=args.rate_prompts, max_concurrency=256,
                request_rate=rate, input_len=args.prompt, seed=40_000 + int(rate), **common,
            ),
            args.served,
        )  # fmt: skip
        out["rates"].append({"request_rate": rate, **summary(ran)})
        print(json.dumps(out["rates"][-1]), flush=True)
    for length in args.long:
        ran = await drive(
            client,
            serve_args(
                mesh.api, vocab, num_prompts=1, max_concurrency=1, input_len=length,
                output_len=64, seed=50_000 + length, goodput=[],
            ),
            args.served,
        )  # fmt: skip
        out["long"].append({"prompt": length, **summary(ran)})
        print(json.dumps(out["long"][-1]), flush=True)
    return out


def keep_evidence(mesh: Mesh, into: Path) -> None:
    """After a failed run: each service's /admin/state and its log, under `into`."""
    into.mkdir(parents=True, exist_ok=True)
    states: dict[str, Any] = {}
    for name in mesh.procs:
        try:
            states[name] = mesh.admin_state(name)
        except Exception as exc:  # a dead service: its log says why
            states[name] = repr(exc)
        for log in mesh.logdir.glob(f"{name}.*.log"):
            shutil.copy(log, into / log.name)
    (into / "admin_state.json").write_text(json.dumps(states, indent=1, default=str))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokenizer", default="", help="directory (default: the embedded SmolLM2's)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--output", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--shared-prefix", type=int, default=1024)
    p.add_argument(
        "--closed-loop", type=int, nargs="*", help="step 2's concurrencies (default: --concurrency)"
    )
    p.add_argument("--shared-concurrency", type=int, default=64, help="0: no step 3")
    p.add_argument("--rates", type=float, nargs="*", default=[8.0, 32.0, 64.0])
    p.add_argument("--rate-prompts", type=int, default=256)
    p.add_argument("--long", type=int, nargs="*", default=[8192, 32768])
    p.add_argument("--goodput", nargs="+", default=["ttft:2000", "tpot:50"])
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument(
        "--client", nargs="+", choices=("vllm", "builtin"),
        default=["vllm"] if vllm_client.available() else ["builtin"],
        help="vllm: `vllm bench serve` (the default once `make vllm-client` built it); builtin: "
        "bench/serve.py",
    )  # fmt: skip
    p.add_argument("--cost-only", action="store_true", help="step 1 only (gateway vs direct)")
    p.add_argument("--datasets-only", action="store_true", help="steps 2-5 only")
    p.add_argument("--dry-run", action="store_true", help="tiny random model on CPU")
    p.add_argument(
        "--set", action="append", default=[], metavar="MESHLLM_X=VALUE",
        help="a setting for every service (repeatable), e.g. MESHLLM_EVENT_LOOP=asyncio",
    )  # fmt: skip
    p.add_argument("--out", default="")
    p.add_argument("--logs", default="", help="on failure: services' logs and state here")
    args = p.parse_args()
    shape: dict[str, Any] = PRESETS["llama-3-8b"]
    context = max([args.prompt + args.output, *[n + 64 for n in args.long], 1024])
    env = {
        "MESHLLM_LOAD_FORMAT": "dummy",
        "MESHLLM_DEVICE": "cuda",
        "MESHLLM_DTYPE": "bfloat16",
        "MESHLLM_MAX_MODEL_LEN": str(context),
        "MESHLLM_KV_CACHE_BYTES": str(24 * 2**30),
        "MESHLLM_MAX_NUM_SEQS": str(max(args.concurrency)),
        "MESHLLM_MAX_NUM_BATCHED_TOKENS": "8192",
        "MESHLLM_LOG_JSON": "false",
        # The benchmark's own bounds, not the gateway's: 256 in flight plus a rate sweep's queue.
        "MESHLLM_MAX_PENDING_REQUESTS": "4096",
        "MESHLLM_MAX_QUEUED_PER_GROUP": "0",
    }
    if args.dry_run:
        shape = {**TINY, "max_position_embeddings": 256, "model_type": "llama"}
        args.prompt, args.output, args.concurrency, args.repeats = 20, 8, [1, 4], 1
        args.shared_prefix, args.shared_concurrency, args.rates = 32, 2, [4.0]
        args.rate_prompts, args.long = 4, [120]
        context = 256
        env.update(
            MESHLLM_DEVICE="cpu",
            MESHLLM_DTYPE="float32",
            MESHLLM_MAX_MODEL_LEN=str(context),
            MESHLLM_KV_CACHE_BYTES=str(2**24),
            MESHLLM_NUM_THREADS="1",
        )
    work = Path(tempfile.mkdtemp(prefix="gateway-serve-"))
    settings: dict[str, str] = {}
    for setting in args.set:
        key, sep, value = setting.partition("=")
        if not (sep and key.startswith("MESHLLM_")):
            p.error(f"--set {setting!r}: expected MESHLLM_<NAME>=<value>")
        settings[key] = value
    env.update(settings)
    served = model_dir(shape, tokenizer_dir(args.tokenizer), work / "llama-3-8b-shape", context)
    env["MESHLLM_MODEL"] = str(served)
    vocab = json.loads((served / "config.json").read_text())["vocab_size"]
    args.served = served  # the tokenizer vllm bench serve writes its prompts with
    results: dict[str, Any] = {
        "model": "llama-3-8b shape, random weights, SmolLM2 tokenizer", "clients": args.client,
        "settings": settings,
    }  # fmt: skip
    mesh = Mesh(services=("gateway", "scheduler", "worker"), env=env)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        started = time.monotonic()
        mesh.redis.start()
        for name in mesh.services:
            mesh.start_service(name)
        for name in ("scheduler", "worker", "gateway"):  # the gateway waits for a worker
            mesh.wait_ready(name, timeout=400)
        results["start_s"] = round(time.monotonic() - started, 1)
        results["start_phases"] = start_phases(mesh)
        ready = f"mesh ready in {results['start_s']} s"
        print(ready, *results["start_phases"], sep="\n", flush=True)

        async def measure() -> None:
            if "vllm" in args.client:
                async with VLLM:  # one client process for every run
                    await measure_with_clients()
            else:
                await measure_with_clients()

        async def measure_with_clients() -> None:
            # Untimed first: Triton's compile of every step kind, through both paths.
            warm = argparse.Namespace(prompt=args.prompt, output=4, vocab=vocab, timeout=600)
            await run_batch(mesh, max(args.concurrency), warm, "warm")
            for client in args.client:
                workload = serve_args(
                    mesh.api, vocab, num_prompts=max(args.concurrency), input_len=args.prompt,
                    output_len=4, seed=1, timeout=600,
                )  # fmt: skip
                await drive(client, workload, served)
            results["warm_s"] = round(time.monotonic() - started - results["start_s"], 1)
            print(f"warmed in {results['warm_s']} s", flush=True)
            if not args.datasets_only:
                results["gateway_cost"] = await gateway_cost(mesh, args, vocab)
            if not args.cost_only:
                results.update(await datasets(mesh, args, vocab))

        asyncio.run(measure())
    except Exception:
        if args.logs:
            keep_evidence(mesh, Path(args.logs))
        raise
    finally:
        mesh.stop()
        shutil.rmtree(work, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
