"""Decode throughput of the worker alone on a GPU, against transformers `generate`, with a
breakdown of the batch-1 step (Llama-3-8B shape, bf16, random weights).

    python3 -m bench.gpu.decode_e2e --out $OUT/decode_e2e.json            # on the H200
    .venv/bin/python -m bench.gpu.decode_e2e --dry-run                   # CPU, tiny shapes

Worker alone: a ModelRunner with CUDA graphs, driven by plans (tests/support/plans.PlanDriver:
chunked prefill under a token budget, then one token per request per step), `--prompt` prompt
tokens and `--output` greedy tokens per request (ignore_eos). For each batch it reports the
output tokens/s over the whole run (prefill included) and over the decode steps alone.

transformers: `generate` on the same config with random weights, same batch/prompt/output.

Breakdown at batch 1 (graph replays timed with CUDA events, median): the whole decode step,
the weight GEMVs alone (every linear of the step in one graph), attention alone (the KV insert
and the decode attention of every layer in one graph, at the context reached), and the rest
(norms, activation, embedding, sampling, host work) as the difference. Each part is reported
with the bytes it must move and the bandwidth that implies.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.gpu.graph_replays import captured
from services.worker.models.random_init import PRESETS, build_random_model
from services.worker.runner.kv_cache import KVCache
from services.worker.runner.model_runner import ModelRunner
from shared.protocol import SamplingParams
from tests.support.plans import PlanDriver

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 256,
}


def gpu_ms(fn: Callable[[], Any], repeats: int = 30) -> float:
    """Median device time of fn() in ms (CUDA events; wall time on CPU)."""
    if not torch.cuda.is_available():
        started = time.perf_counter()
        fn()
        return (time.perf_counter() - started) * 1000
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graphed(fn: Callable[[], Any]) -> Callable[[], Any]:
    """fn captured in a CUDA graph (eager on CPU): launch gaps excluded, as in the worker."""
    if not torch.cuda.is_available():
        return fn
    return captured(fn).replay


def run_worker(model: Any, config: Any, args: argparse.Namespace, batch: int) -> dict[str, Any]:
    device = args.device
    per_req = -(-(args.prompt + args.output + 16) // 16)
    kv = KVCache.allocate(config, batch * per_req + 16, 16, model.embed_tokens.weight.dtype, device)
    runner = ModelRunner(
        model, config, kv, device, max_num_reqs=batch, max_model_len=args.max_model_len
    )
    runner.warmup()
    capture_s = runner.capture_cuda_graphs() if device == "cuda" else 0.0
    prompts = [
        [(7919 * i + 31 * j) % config.vocab_size for j in range(args.prompt)] for i in range(batch)
    ]
    if args.warm_tokens:
        warm_started = time.perf_counter()
        warm_pass(runner, prompts, args)
        warm_s = time.perf_counter() - warm_started
    driver = PlanDriver(runner, token_budget=args.token_budget)
    params = SamplingParams(temperature=0.0, max_tokens=args.output, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        driver.add(f"r{i}", prompt, params)
    step_ms: list[float] = []
    prefill_steps: list[tuple[int, float]] = []  # (scheduled tokens, ms) before decode-only
    started = time.perf_counter()
    decode_started = None
    while not all(r.finished for r in driver.requests.values()):
        t0 = time.perf_counter()
        plan_decode = all(r.num_computed >= len(r.prompt) for r in driver.requests.values())
        if plan_decode and decode_started is None:
            decode_started = t0
        driver.step()
        ms = (time.perf_counter() - t0) * 1000
        if plan_decode:
            step_ms.append(ms)
        else:
            scheduled = sum(driver.plans[-1].num_scheduled_tokens.values())
            prefill_steps.append((scheduled, round(ms, 2)))
    total_s = time.perf_counter() - started
    decode_s = time.perf_counter() - (decode_started or started)
    out_tokens = sum(len(r.output) for r in driver.requests.values())
    row = {
        "batch": batch,
        "prompt": args.prompt,
        "output": args.output,
        "graph_capture_s": round(capture_s, 2),
        "warm_pass_s": round(warm_s, 2) if args.warm_tokens else None,
        "total_s": round(total_s, 3),
        "throughput_tok_s": round(out_tokens / total_s, 1),
        "decode_tok_s": round(batch * len(step_ms) / decode_s, 1) if step_ms else None,
        "decode_step_ms_median": round(statistics.median(step_ms), 3) if step_ms else None,
        "steps": len(driver.results),
        "prefill_phase_s": round(sum(ms for _, ms in prefill_steps) / 1000, 3),
        "prefill_steps": prefill_steps,
    }
    if batch == 1:
        row["breakdown"] = breakdown(runner, model, config, driver)
        if args.trace and runner.graphs is not None and 1 in runner.graphs.graphs:
            print(trace_replays(runner.graphs.graphs[1].replay, args.trace), flush=True)
    if args.trace_steps:
        runner.reset()
        path = args.trace_steps.replace(".json", f"_b{batch}.json")
        print(f"batch {batch}:", trace_overlapped(runner, prompts, path), flush=True)
    del driver, runner, kv
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def warm_pass(runner: ModelRunner, prompts: list[list[int]], args: argparse.Namespace) -> None:
    """The same prompts for `--warm-tokens` tokens, discarded: Triton compiles a kernel variant
    the first time a step of its kind runs (mixed decode/prefill steps, a chunk continuing a
    prefix), ~0.4-1 s each on the H200, which would otherwise land in the timed run's first
    steps. The runner then forgets the requests (their blocks are simply reused)."""
    warm = PlanDriver(runner, token_budget=args.token_budget)
    params = SamplingParams(temperature=0.0, max_tokens=args.warm_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        warm.add(f"warm{i}", prompt, params)
    while not all(r.finished for r in warm.requests.values()):
        warm.step()
    runner.reset()


def trace_replays(replay: Callable[[], Any], path: str, replays: int = 10) -> str:
    """Kernel by kernel, the device time of `replays` graph replays and the gaps between their
    kernels (services/worker/runner/kernel_trace.py): where a graph step's time goes, launch
    gaps included."""
    from torch.profiler import ProfilerActivity, profile

    from services.worker.runner.kernel_trace import summarize_trace

    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            replay()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    return summarize_trace(path, steps=replays)


def trace_overlapped(
    runner: ModelRunner, prompts: list[list[int]], path: str, steps: int = 20, warm: int = 8
) -> str:
    """Kernel by kernel, `steps` whole decode steps as the worker service runs them
    with the scheduler ahead: plan N+1 launched before step N is finished (its input token
    fed on the device), then N finished. Everything a step puts on the device is in the
    trace: input copies, the graph's kernels, the LM head, sampling and the token copy."""
    from torch.profiler import ProfilerActivity, profile

    from services.worker.runner.kernel_trace import summarize_trace

    driver = PlanDriver(runner, token_budget=8192)
    params = SamplingParams(temperature=0.0, max_tokens=warm + steps + 8, ignore_eos=True)
    reqs = [driver.add(f"trace{i}", prompt, params) for i, prompt in enumerate(prompts)]
    while any(not r.output for r in reqs):
        driver.step()  # prefill; the first tokens are on the host

    def launch() -> Any:
        plan = driver.build_plan()
        driver.step_id += 1
        launched = runner.launch(plan)
        for req in reqs:
            req.num_computed += 1
            req.tokens.append(-1)  # its value reaches the worker on the device (the feed)
        return launched

    cuda = runner.device.type == "cuda"
    in_flight = launch()
    for _ in range(warm):
        nxt = launch()
        runner.finish(in_flight)
        in_flight = nxt
    if cuda:
        torch.cuda.synchronize()
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        for _ in range(steps):
            nxt = launch()
            runner.finish(in_flight)
            in_flight = nxt
        runner.finish(in_flight)
        if cuda:
            torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    return summarize_trace(path, steps=steps + 1)


def breakdown(runner: ModelRunner, model: Any, config: Any, driver: PlanDriver) -> dict[str, Any]:
    """Where a batch-1 decode step goes, at the context the run ended with."""
    from services.worker.attention.select import rotary_attention

    dtype = model.embed_tokens.weight.dtype
    device = model.embed_tokens.weight.device
    req = next(iter(driver.requests.values()))
    context = len(req.tokens) - 1
    graphs = runner.graphs
    out: dict[str, Any] = {"context": context}
    if graphs is not None and 1 in graphs.graphs:
        out["step_graph_ms"] = gpu_ms(graphs.graphs[1].replay)
    # Weights: every linear of one decode step, in one graph.
    x = torch.randn(1, config.hidden_size, dtype=dtype, device=device)
    h = torch.randn(1, config.intermediate_size, dtype=dtype, device=device)
    q = torch.randn(1, config.q_size, dtype=dtype, device=device)

    def linears() -> None:
        for layer in model.layers:
            layer.self_attn.qkv_proj(x)
            layer.self_attn.o_proj(q)
            layer.mlp.gate_up_proj(x)
            layer.mlp.down_proj(h)
        model.compute_logits(x)

    weight_bytes = sum(
        m.weight.numel() * m.weight.element_size()
        for m in model.modules()
        if isinstance(m, torch.nn.Linear)
    )
    if model.lm_head is None:
        weight_bytes += model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    out["weights_ms"] = gpu_ms(graphed(linears))
    out["weights_bytes"] = weight_bytes
    # Attention: fused RoPE + KV insert and decode attention of every layer at this context.
    if graphs is not None:
        meta = graphs.metadata(1)
        qkv = torch.randn(1, config.q_size + 2 * config.kv_size, dtype=dtype, device=device)
        cos, sin = model.rotary.lookup(torch.tensor([context], device=device))
        scale = config.head_dim**-0.5
        kv_layers = runner.kv_cache.layers
        heads, kv_heads, head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        # The graph buffers still hold the last step's row: its slot is rewritten in place.

        def attention() -> None:
            for kv in kv_layers:
                rotary_attention(qkv, cos, sin, meta, kv, heads, kv_heads, head_dim, scale)

        kv_bytes = (
            context
            * config.num_hidden_layers
            * 2
            * config.num_key_value_heads
            * config.head_dim
            * kv_layers[0].element_size()
        )
        out["attention_ms"] = gpu_ms(graphed(attention))
        out["attention_bytes"] = kv_bytes
    if "step_graph_ms" in out and "attention_ms" in out:
        out["rest_ms"] = out["step_graph_ms"] - out["weights_ms"] - out["attention_ms"]
    for part in ("weights", "attention"):
        if f"{part}_ms" in out:
            out[f"{part}_GBps"] = round(out[f"{part}_bytes"] / out[f"{part}_ms"] / 1e6, 1)
    return out


def run_transformers(hf_config: dict[str, Any], args: argparse.Namespace) -> list[dict]:
    from transformers import LlamaConfig, LlamaForCausalLM

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    cfg = {k: v for k, v in hf_config.items() if k not in ("architectures", "torch_dtype")}
    with torch.device(args.device):
        model = LlamaForCausalLM(LlamaConfig(**cfg)).to(dtype).eval()
    rows = []
    for batch in args.hf_batches:
        new = args.hf_output_b1 if batch == 1 else args.output
        ids = torch.randint(0, cfg["vocab_size"], (batch, args.prompt), device=args.device)
        kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        with torch.inference_mode():
            model.generate(ids[:, :16], max_new_tokens=2, do_sample=False, pad_token_id=0)
            if args.device == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            if args.device == "cuda":
                torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        produced = (out.shape[1] - args.prompt) * batch
        rows.append(
            {
                "batch": batch,
                "prompt": args.prompt,
                "output": new,
                "total_s": round(seconds, 3),
                "throughput_tok_s": round(produced / seconds, 1),
            }
        )
        print("transformers", rows[-1], flush=True)
    del model
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="llama-3-8b")
    parser.add_argument(
        "--batches", type=int, nargs="*", default=[1, 16, 64, 256], help="none: transformers only"
    )
    parser.add_argument("--hf-batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--hf-output-b1", type=int, default=32, help="new tokens, HF batch 1")
    parser.add_argument("--token-budget", type=int, default=8192)
    parser.add_argument(
        "--warm-tokens", type=int, default=4, help="untimed pass first (0: none, as before)"
    )
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="tiny model on CPU")
    parser.add_argument("--out", default="")
    parser.add_argument(
        "--trace", default="", help="chrome trace of 10 batch-1 step graph replays, summarized"
    )
    parser.add_argument(
        "--trace-steps",
        default="",
        help="chrome traces (FILE_b<batch>.json) of 20 whole decode steps at each batch, scheduled "
        "ahead as the mesh runs them (copies, graph, LM head, sampling), summarized",
    )
    args = parser.parse_args()
    args.device = "cpu" if args.dry_run else "cuda"
    hf_config = TINY if args.dry_run else PRESETS[args.preset]
    if args.dry_run:
        args.prompt, args.output, args.hf_output_b1 = 24, 6, 4
        args.batches, args.hf_batches, args.max_model_len = [1, 4], [1, 2], 64
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    import transformers

    from services.worker.attention.dense_prefill import DENSE_PREFILL_CHOICES

    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if not args.dry_run else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    results["worker"] = []
    if args.batches:
        started = time.perf_counter()
        model, config = build_random_model(hf_config, dtype, args.device, args.max_model_len)
        results["build_s"] = round(time.perf_counter() - started, 2)
        for batch in args.batches:
            row = run_worker(model, config, args, batch)
            results["worker"].append(row)
            print("worker", row, flush=True)
        del model
    results["dense_prefill"] = {"|".join(map(str, k)): v for k, v in DENSE_PREFILL_CHOICES.items()}
    if not args.skip_hf:
        results["transformers"] = run_transformers(hf_config, args)
    text = json.dumps(results, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
