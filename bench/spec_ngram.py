"""n-gram (prompt lookup) speculative decoding vs plain decoding, SmolLM2, CPU or CUDA.

Copy-heavy chat tasks (editing a given code snippet, answering with quotes from a given text)
are where prompt lookup pays: the answer repeats long spans of the prompt. Each task runs
greedy through the real scheduler core and model runner (no bus), alternating plain and
speculative runs so both see the same machine load; every speculative output is checked
token-for-token against the plain one. Reported: tokens/s of each, the speed-up (median of
the per-pair ratios), mean tokens per verification step, acceptance per draft position, and
the median wall and device time of a plain decode step and of a step that verifies drafts
(with a drafter the step's device span ends after its drafts are proposed, so there "device"
includes the host's lookup), and the time of one lookup for the whole batch at the end of the
outputs, with the C++ search and the NumPy one.
`--batch B` runs B requests of a task at once (each prompt opens with its own number, so they
are B different prompts). On CUDA (`--device cuda`, bf16) the runner is set up as the worker's
(bootstrap.py): warmed up, decode steps and the steps that verify drafts replayed from CUDA
graphs (services/worker/accel/verify_graphs.py), as in the worker; `--eager-verify` also times
a third engine whose verify steps run eagerly (the cost the verify graphs remove). In bf16 a
near-tie may flip between the verify and decode kernels: `same_tokens` says whether the outputs
matched (on CPU, fp32, they must). `--model` serves another
checkpoint (an HF directory or a .gguf file) than the embedded SmolLM2. `--kernel-profile`
adds one plain and one speculative run of the first task under the PyTorch profiler: each
kernel's calls and device time (graph replays included), where a verify step's time goes, and
the host operators by their own host time (what an eager prefill step spends its time on).
`--step-marks` splits the last repeat's verify steps (and the plain engine's decode steps) by
the runner's host marks, the worker's step timeline (step_timeline.py): median ms of each
phase (inputs, forward queued, draws on the host, acceptance, drafts proposed), and on CUDA
the device's own time for the forward.

    python -m bench.spec_ngram [--k 5] [--min-n 2] [--max-n 5] [--max-tokens 128] [--repeats 3]
                               [--threads 1] [--device cpu|cuda] [--batch 1] [--model PATH]
                               [--eager-verify] [--kernel-profile] [--gemv-max-rows 16]
                               [--step-marks]
                               [--prefill-graph-tokens 0]
                               [--json] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from meshllm_kernels.runtime.compile_watch import CompileWatch
from services.scheduler.config import SchedulerConfig
from services.scheduler.scheduler import Scheduler
from services.worker.accel.cuda_layers import set_gemv_max_rows
from services.worker.loader import load_model
from services.worker.runner.kv_cache import KVCache
from services.worker.runner.model_runner import ModelRunner
from services.worker.runner.step_timeline import StepTimeline
from services.worker.runner.step_timeline_report import phase_medians
from services.worker.spec import SpeculativeConfig
from services.worker.spec.ngram import NgramProposer
from shared.config import ModelSettings
from shared.model.source import resolve_model
from shared.protocol import SamplingParams, SubmitRequest

SNIPPET = '''def moving_average(values, window):
    """Average of each window of consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    for i in range(len(values) - window + 1):
        chunk = values[i : i + window]
        out.append(sum(chunk) / window)
    return out
'''
TEXT = (
    "The lighthouse stood on the northern cliff for two hundred years. Its keeper, Mara Quill, "
    "climbed the one hundred and twelve steps every evening to light the lamp. She wrote in "
    "her logbook that the sea was never the same colour twice, and that the gulls always "
    "knew a storm was coming a day before the barometer did. When the lamp was finally "
    "automated, Mara moved to the village below, but she still walked up to the cliff each "
    "evening to watch the beam sweep across the water."
)
TASKS = {
    "edit_code": f'```python\n{SNIPPET}```\n\nChange the error message to "window must be at '
    f'least 1". Reply with the complete corrected code only.',
    "docstring": f"Print this code again exactly, with the docstring changed to say 'Rolling "
    f"means of a list.':\n\n{SNIPPET}",
    "quote": f"Text: {TEXT}\n\nQuote, word for word, the sentence of the text that says what "
    f"Mara wrote in her logbook.",
}


class Engine:
    """Scheduler core + model runner, stepped in one process (the mesh's loop minus Redis)."""

    def __init__(
        self,
        model: Any,
        config: Any,
        spec: SpeculativeConfig | None,
        device: str = "cpu",
        eager_verify: bool = False,
        prefill_graph_tokens: int = 0,
        marks_dir: str = "",
    ) -> None:
        max_len = min(config.max_position_embeddings, 4096)
        dtype = next(model.parameters()).dtype
        kv = KVCache.allocate(config, 2048, 16, dtype, device)
        self.runner = ModelRunner(
            model, config, kv, device, max_model_len=max_len, speculative=spec
        )
        if device == "cuda":  # as the worker sets it up (bootstrap.py)
            self.runner.warmup()
            self.runner.capture_cuda_graphs(prefill_tokens=prefill_graph_tokens)
            if eager_verify:
                self.runner.verify_graphs = None
        # --step-marks: the worker's step timeline (MESHLLM_STEP_TIMELINE) into a scratch file
        self.timeline_path: Path | None = None
        if marks_dir:
            self.timeline_path = Path(tempfile.mkstemp(suffix=".jsonl", dir=marks_dir)[1])
            self.runner.timeline = StepTimeline(str(self.timeline_path), self.runner.device)
        k = spec.num_spec_tokens if spec else 0
        # (wall, device) ms of each step after the prefills: plain decode steps, and the steps
        # that verify drafts (decode steps of a speculating engine without any draft count as
        # decode).
        self.step_ms: dict[str, list[tuple[float, float]]] = {
            "decode": [],
            "verify": [],
            "prefill": [],
        }
        self.generate_ms = 0.0  # the last generate's wall time
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_gpu_blocks=2048,
                max_model_len=max_len,
                eos_token_ids=list(config.eos_token_ids),
                num_spec_tokens=k,
            ),
            "bench",
        )

    def generate(
        self, prompts: list[list[int]], params: SamplingParams
    ) -> tuple[list[list[int]], int]:
        """Every prompt's output tokens (in order) and the steps they took, all at once."""
        for i, prompt in enumerate(prompts):
            self.scheduler.add_request(
                SubmitRequest(
                    request_id=f"r{i}", prompt_token_ids=prompt, sampling=params, reply_stream="r"
                )
            )
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        steps = 0
        started = time.perf_counter()
        while self.scheduler.has_work():
            t0 = time.perf_counter()
            plan = self.scheduler.schedule()
            assert plan is not None
            out = self.scheduler.update_from_output(plan, self.runner.execute(plan))
            if plan.spec_token_ids:
                kind = "verify"
            elif all(n == 1 for n in plan.num_scheduled_tokens.values()):
                kind = "decode"
            else:
                kind = "prefill"
            wall_ms = (time.perf_counter() - t0) * 1000.0
            self.step_ms[kind].append((wall_ms, self.runner.last_device_seconds * 1000.0))
            steps += 1
            for deltas in out.deltas.values():
                for delta in deltas:
                    tokens[delta.request_id] += delta.token_ids
        self.generate_ms = (time.perf_counter() - started) * 1000.0
        return [tokens[f"r{i}"] for i in range(len(prompts))], steps

    def phase_split(self, kind: str) -> dict[str, float] | None:
        """With --step-marks: the median ms between the host marks of the `kind` steps of
        this engine's runs (step_timeline_report.phase_medians)."""
        if self.timeline_path is None or self.runner.timeline is None:
            return None
        self.runner.timeline.close()
        rows = [json.loads(line) for line in self.timeline_path.read_text().splitlines()]
        return phase_medians(rows, kind)

    def wall_split(self) -> dict[str, float]:
        """The last generate's wall ms: summed per kind of step, and outside the steps."""
        split = {kind: round(sum(w for w, _ in ms), 1) for kind, ms in self.step_ms.items()}
        split["outside"] = round(self.generate_ms - sum(split.values()), 1)
        return split


def lookup_us(
    sequences: list[list[int]], k: int, min_n: int, max_n: int, repeats: int = 500
) -> dict[str, float]:
    """Median microseconds of one n-gram lookup for the whole batch (each row: a request's
    prompt and output), with the C++ search and with the NumPy one (the host's work after
    every step of a speculating engine, between the GPU's steps)."""
    width = max(len(s) for s in sequences)
    token_ids = np.zeros((len(sequences), width), dtype=np.int32)
    for i, seq in enumerate(sequences):
        token_ids[i, : len(seq)] = seq
    rows = np.arange(len(sequences))
    lengths = np.array([len(s) for s in sequences], dtype=np.int64)
    ks = np.full(len(sequences), k, dtype=np.int64)
    out: dict[str, float] = {}
    for name, native in (("cpp", True), ("numpy", False)):
        proposer = NgramProposer(min_n, max_n, native=native)
        if native and proposer.lookup is None:
            continue  # no compiler here
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            proposer.propose(token_ids, rows, lengths, ks)
            times.append(time.perf_counter() - t0)
        out[name] = round(statistics.median(times) * 1e6, 1)
    return out


def kernel_profile(run: Any, top: int = 30) -> dict[str, list[dict[str, Any]]]:
    """`run()` under the PyTorch profiler: its device kernels (CUDA graph replays included),
    the `top` ones by total device time (name, calls, total and mean microseconds), and its
    host operators (aten ops, CUDA runtime calls, Triton launches), the `top` ones by their
    own host time. Graph replays launch few host ops, so the eager steps (prefill chunks)
    dominate the host list: where an eager step's host time goes."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        run()
        if cuda:
            torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(event.name, []).append(event.time_range.elapsed_us())
    rows = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:top]
    host = sorted(
        (e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU),
        key=lambda e: -e.self_cpu_time_total,
    )[:top]
    return {
        "kernels": [
            {
                "kernel": name[:90],
                "calls": len(times),
                "total_us": round(sum(times), 1),
                "mean_us": round(sum(times) / len(times), 2),
            }
            for name, times in rows
        ],
        "host_ops": [
            {
                "op": e.key[:90],
                "calls": e.count,
                "self_us": round(e.self_cpu_time_total, 1),
                "total_us": round(e.cpu_time_total, 1),
            }
            for e in host
        ],
    }


def step_medians(samples: list[tuple[float, float]]) -> dict[str, float] | None:
    """Median wall and device ms of a kind of step (None when there was none)."""
    if not samples:
        return None
    return {
        "n": len(samples),
        "wall_ms": round(statistics.median(w for w, _ in samples), 3),
        "device_ms": round(statistics.median(d for _, d in samples), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--min-n", type=int, default=2)
    parser.add_argument("--max-n", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--model", default="", help="HF directory or .gguf (default: SmolLM2)")
    parser.add_argument("--eager-verify", action="store_true")
    parser.add_argument(
        "--prefill-graph-tokens",
        type=int,
        default=0,
        help="CUDA: prefill and mixed steps of up to this many tokens replay CUDA graphs (the "
        "worker's MESHLLM_PREFILL_GRAPH_TOKENS; 0 = eager)",
    )
    parser.add_argument(
        "--gemv-max-rows",
        type=int,
        default=16,
        help="CUDA: steps of up to this many rows run the GEMV + decode chain (the worker's "
        "MESHLLM_GEMV_MAX_ROWS; 96 takes batch-16 verify steps of K = 5)",
    )
    parser.add_argument(
        "--kernel-profile",
        action="store_true",
        help="also profile one plain and one speculative run of the first task: each device "
        "kernel's time (CUDA) and the host operators' own time",
    )
    parser.add_argument(
        "--step-marks",
        action="store_true",
        help="split the last repeat's verify and decode steps by the runner's host marks (the "
        "worker's step timeline): median ms of each phase, and on CUDA the device's forward",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", default="", help="also write the JSON summary here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    set_gemv_max_rows(args.gemv_max_rows)

    marks_dir = tempfile.TemporaryDirectory() if args.step_marks else None
    source = resolve_model(args.model, ModelSettings().model_cache_dir)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model, config = load_model(source.hf_dir, dtype, args.device)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(Path(source.hf_dir))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    spec = SpeculativeConfig(
        method="ngram",
        num_spec_tokens=args.k,
        prompt_lookup_min=args.min_n,
        prompt_lookup_max=args.max_n,
    )
    engine_of = partial(
        Engine,
        model,
        config,
        device=args.device,
        prefill_graph_tokens=args.prefill_graph_tokens,
        marks_dir=marks_dir.name if marks_dir else "",
    )
    watch = CompileWatch().install()
    engine_of(None).generate([[1, 2, 3]], SamplingParams(max_tokens=4))
    watch.mark_warm()  # compiles from here on land in a timed run

    rows: list[dict[str, Any]] = []
    profiles: dict[str, dict[str, list[dict[str, Any]]]] = {}
    accepted_per_pos = [0] * args.k
    num_drafts = 0
    for name, text in TASKS.items():
        prompts = []
        for i in range(args.batch):
            numbered = f"Request {i + 1}.\n{text}" if args.batch > 1 else text
            chat = tokenizer.apply_chat_template(
                [{"role": "user", "content": numbered}], add_generation_prompt=True, tokenize=False
            )
            prompts.append(tokenizer(chat, add_special_tokens=False)["input_ids"])
        ratios, plain_tps, spec_tps, eager_ratios = [], [], [], []
        same = True
        for _ in range(args.repeats):
            plain = engine_of(None)
            t0 = time.perf_counter()
            plain_tokens, _ = plain.generate(prompts, params)
            t_plain = time.perf_counter() - t0
            engine = engine_of(spec)
            t0 = time.perf_counter()
            spec_tokens, steps = engine.generate(prompts, params)
            t_spec = time.perf_counter() - t0
            if args.eager_verify:
                eager = engine_of(spec, eager_verify=True)
                t0 = time.perf_counter()
                eager.generate(prompts, params)
                eager_ratios.append(t_plain / (time.perf_counter() - t0))
            if spec_tokens != plain_tokens:
                # fp32 on CPU must match exactly; in bf16 the verify step's attention kernel
                # (one span per request) may flip a near-tie against the decode kernel's.
                if args.device == "cpu":
                    raise SystemExit(f"{name}: speculative output differs from plain greedy")
                same = False
            total = sum(len(t) for t in spec_tokens)
            ratios.append(t_plain / t_spec)
            plain_tps.append(sum(len(t) for t in plain_tokens) / t_plain)
            spec_tps.append(total / t_spec)
        if args.kernel_profile and not rows:
            # engines built (warmed up, graphs captured) outside the profile: generate only
            runs = {"plain": engine_of(None)}
            runs["spec"] = engine_of(spec)
            profiles = {
                kind: kernel_profile(partial(e.generate, prompts, params))
                for kind, e in runs.items()
            }
        stats = engine.scheduler.spec.stats
        num_drafts += stats.num_drafts
        for i, n in enumerate(stats.accepted_per_pos[: args.k]):
            accepted_per_pos[i] += n
        eager_speedup = round(statistics.median(eager_ratios), 2) if eager_ratios else None
        rows.append(
            {
                "task": name,
                "prompt_tokens": len(prompts[0]),
                "output_tokens": total,
                "plain_tok_s": round(statistics.median(plain_tps), 2),
                "spec_tok_s": round(statistics.median(spec_tps), 2),
                "speedup": round(statistics.median(ratios), 2),
                "steps": steps,
                "tokens_per_step": round(total / steps / args.batch, 2),
                "acceptance_rate": round(stats.acceptance_rate, 3),
                "eager_verify_speedup": eager_speedup,
                "same_tokens": same,
                # the last repeat's steps: where a speculating step's time goes
                "plain_decode_step": step_medians(plain.step_ms["decode"]),
                "spec_decode_step": step_medians(engine.step_ms["decode"]),
                "spec_verify_step": step_medians(engine.step_ms["verify"]),
                "plain_prefill_steps": step_medians(plain.step_ms["prefill"]),
                "plain_decode_phases_ms": plain.phase_split("decode"),
                "spec_verify_phases_ms": engine.phase_split("verify"),
                "plain_wall_split_ms": plain.wall_split(),
                "spec_wall_split_ms": engine.wall_split(),
                "lookup_us": lookup_us(
                    [p + t for p, t in zip(prompts, plain_tokens, strict=True)],
                    args.k,
                    args.min_n,
                    args.max_n,
                ),
            }
        )
    summary = {
        "k": args.k,
        "n": [args.min_n, args.max_n],
        "threads": args.threads,
        "device": args.device,
        "batch": args.batch,
        "gemv_max_rows": args.gemv_max_rows,
        "prefill_graph_tokens": args.prefill_graph_tokens,
        "speedup_median": round(statistics.median(r["speedup"] for r in rows), 2),
        "acceptance_per_position": [round(n / max(num_drafts, 1), 3) for n in accepted_per_pos],
        "compiles_in_timed_runs": [
            (c.kernel, round(c.seconds * 1000.0, 1)) for c in watch.after_warmup()
        ],
        "tasks": rows,
        "kernel_profile": profiles,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2))
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(
        f"{'task':<10} {'prompt':>6} {'out':>4} {'plain t/s':>9} {'spec t/s':>8} "
        f"{'speedup':>7} {'tok/step':>8} {'accept':>6} {'eager-verify':>12} {'same':>5}"
    )
    for r in rows:
        print(
            f"{r['task']:<10} {r['prompt_tokens']:>6} {r['output_tokens']:>4} "
            f"{r['plain_tok_s']:>9} {r['spec_tok_s']:>8} {r['speedup']:>7} "
            f"{r['tokens_per_step']:>8} {r['acceptance_rate']:>6} "
            f"{r['eager_verify_speedup'] or '-':>12} {r['same_tokens']!s:>5}"
        )
    for r in rows:
        print(
            f"{r['task']}: steps (n, wall ms, device ms) plain decode {r['plain_decode_step']}, "
            f"spec decode {r['spec_decode_step']}, spec verify {r['spec_verify_step']}; "
            f"one batch lookup (us) {r['lookup_us']}; prefill steps {r['plain_prefill_steps']}; "
            f"wall ms per kind plain {r['plain_wall_split_ms']} spec {r['spec_wall_split_ms']}"
        )
        if r["spec_verify_phases_ms"]:
            print(
                f"{r['task']}: median ms between host marks: plain decode "
                f"{r['plain_decode_phases_ms']}, spec verify {r['spec_verify_phases_ms']}"
            )
    print(
        f"median speed-up {summary['speedup_median']}x; acceptance per draft position "
        f"{summary['acceptance_per_position']}; Triton compiles in the timed runs (ms) "
        f"{summary['compiles_in_timed_runs']}"
    )


if __name__ == "__main__":
    main()
