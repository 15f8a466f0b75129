"""On the H200: the fused Gumbel-max sampler vs its reference at real sizes, then timings.

    python3 bench/gpu/sampler_check.py [--out PATH] [--vocab 128256]

Checks, each a row of the printed table (and of the JSON written to --out, default
$OUT/sampler_check.json):
- kernel tokens == PyTorch reference tokens on the GPU, batch 1..256, fp32 and bf16 logits,
  mixed greedy and sampled rows, with and without a grammar bitmask;
- kernel uniforms and noise == the CPU reference bit for bit, and kernel tokens == CPU tokens
  (same seed, position, token -> same bits on every device);
- SamplingState on CUDA == SamplingState on CPU for the same logits and parameters;
- Monte Carlo tail mass through the kernel at logit gaps 18 and 20 (|z| < 3);
then the kernel and the reference timed with triton.testing.do_bench (median).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

from kernels.sampling.bitmask import pack_bitmask  # noqa: E402
from kernels.sampling.gumbel_kernel import (  # noqa: E402
    gumbel_argmax_reference,
    gumbel_argmax_triton,
    gumbel_noise_reference,
)
from kernels.sampling.murmur3 import uniform32  # noqa: E402
from services.worker.sampling import SamplingState  # noqa: E402
from shared.protocol import SamplingParams  # noqa: E402

BATCHES = (1, 8, 32, 64, 128, 256)


def _inputs(batch: int, vocab: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, vocab, generator=gen) * 4).to(dtype).cuda()
    inv_t = 1.0 / (torch.rand(batch, generator=gen) * 1.2 + 0.3)
    inv_t[torch.rand(batch, generator=gen) < 0.25] = 0.0  # greedy rows
    seeds = torch.randint(-(2**63), 2**63 - 1, (batch,), generator=gen, dtype=torch.int64)
    positions = torch.randint(0, 2**31, (batch,), generator=gen, dtype=torch.int64)
    return logits, inv_t.cuda(), seeds.cuda(), positions.cuda()


class Run:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.timings: list[dict[str, Any]] = []

    def check(self, name: str, fn: Any) -> None:
        start = time.perf_counter()
        try:
            ok, detail = fn()
        except Exception:  # a failing check is reported; the others still run
            ok, detail = False, traceback.format_exc(limit=4)
        row = {
            "check": name,
            "ok": bool(ok),
            "detail": detail,
            "seconds": round(time.perf_counter() - start, 2),
        }
        self.rows.append(row)
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)


def check_tokens(batch: int, vocab: int, dtype: torch.dtype, bitmask: bool) -> tuple[bool, str]:
    logits, inv_t, seeds, positions = _inputs(batch, vocab, dtype, seed=batch)
    packed = index = None
    if bitmask:
        gen = torch.Generator().manual_seed(batch + 1)
        allowed = torch.rand(max(1, batch // 2), vocab, generator=gen) < 0.1
        packed = pack_bitmask(allowed).cuda()
        index = torch.randint(-1, packed.shape[0], (batch,), generator=gen, dtype=torch.int32)
        index = index.cuda()
    mismatches = 0
    for step in range(4):
        got = gumbel_argmax_triton(logits, inv_t, seeds, positions + step, packed, index)
        want = gumbel_argmax_reference(logits, inv_t, seeds, positions + step, packed, index)
        mismatches += int((got != want).sum())
    return mismatches == 0, f"{mismatches} mismatching tokens of {4 * batch}"


def check_cross_device(vocab: int) -> tuple[bool, str]:
    logits, inv_t, seeds, positions = _inputs(16, vocab, torch.float32, seed=99)
    inv_t[inv_t == 0] = 1.0
    u = torch.empty(logits.shape, device="cuda")
    g = torch.empty(logits.shape, device="cuda")
    tokens = gumbel_argmax_triton(logits, inv_t, seeds, positions, noise_out=(u, g))
    cpu_u = uniform32(seeds.cpu().unsqueeze(1), positions.cpu().unsqueeze(1), torch.arange(vocab))
    cpu_g = gumbel_noise_reference(seeds.cpu(), positions.cpu(), vocab)
    cuda_g = gumbel_noise_reference(seeds, positions, vocab)
    u_bad = int((u.cpu().view(torch.int32) != cpu_u.view(torch.int32)).sum())
    g_bad = int((g.cpu().view(torch.int32) != cpu_g.view(torch.int32)).sum())
    ref_bad = int((cuda_g.cpu().view(torch.int32) != cpu_g.view(torch.int32)).sum())
    cpu_tokens = gumbel_argmax_reference(logits.cpu(), inv_t.cpu(), seeds.cpu(), positions.cpu())
    tok_bad = int((tokens.cpu() != cpu_tokens).sum())
    ok = u_bad == g_bad == ref_bad == tok_bad == 0
    return ok, (
        f"uniform bits differing {u_bad}, kernel noise vs CPU {g_bad}, torch-CUDA noise "
        f"vs CPU {ref_bad} (of {u.numel()}); tokens differing {tok_bad} of 16"
    )


def check_state(vocab: int) -> tuple[bool, str]:
    variants = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=1.0, seed=2, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(temperature=0.7, seed=3, logit_bias={5: 4.0}, bad_token_ids=[7, 8]),
        SamplingParams(temperature=1.2, seed=2**64 - 1, frequency_penalty=0.2, logprobs=5),
    ]
    states = [SamplingState(8, vocab, device, eos_token_ids=[2]) for device in ("cpu", "cuda")]
    for state in states:
        for row, params in enumerate(variants):
            state.add_request(row, params, [1, 5, 9], [])
    gen = torch.Generator().manual_seed(5)
    rows = torch.arange(len(variants))
    bad = 0
    for step in range(16):
        logits = torch.randn(len(variants), vocab, generator=gen) * 3
        outs = [
            state.sample(
                logits.to(state.device),
                rows.to(state.device),
                torch.full((len(variants),), step, device=state.device),
            )
            for state in states
        ]
        bad += int((outs[0].token_ids != outs[1].token_ids.cpu()).sum())
        for state, out in zip(states, outs, strict=True):
            state.record_sampled(rows.to(state.device), out.token_ids)
    return bad == 0, f"{bad} of {16 * len(variants)} tokens differ between CPU and CUDA state"


def check_tail(vocab: int, gap: float, draws_target: int) -> tuple[bool, str]:
    batch = 256
    logits = torch.full((batch, vocab), -gap, device="cuda")
    logits[:, 0] = 0.0
    inv_t = torch.ones(batch, device="cuda")
    seeds = torch.arange(batch, device="cuda", dtype=torch.int64) * 7919 + 17
    wins = 0
    steps = draws_target // batch
    for step in range(steps):
        positions = torch.full((batch,), step, device="cuda", dtype=torch.int64)
        wins += int((gumbel_argmax_triton(logits, inv_t, seeds, positions) != 0).sum())
    draws = steps * batch
    weight = (vocab - 1) * math.exp(-gap)
    p = weight / (1 + weight)
    z = (wins - draws * p) / math.sqrt(draws * p * (1 - p))
    return abs(z) < 3, f"{wins} tail wins in {draws} draws, expected {draws * p:.1f}, z={z:+.2f}"


def time_batch(vocab: int, batch: int, run: Run) -> None:
    logits, inv_t, seeds, positions = _inputs(batch, vocab, torch.float32, seed=batch)
    inv_t[inv_t == 0] = 1.0  # time the sampled path: every row hashes every token
    kernel_ms = triton.testing.do_bench(
        lambda: gumbel_argmax_triton(logits, inv_t, seeds, positions), return_mode="median"
    )
    ref_ms = triton.testing.do_bench(
        lambda: gumbel_argmax_reference(logits, inv_t, seeds, positions), return_mode="median"
    )
    argmax_ms = triton.testing.do_bench(lambda: logits.argmax(dim=1), return_mode="median")
    row = {
        "batch": batch,
        "vocab": vocab,
        "kernel_us": round(kernel_ms * 1e3, 1),
        "reference_us": round(ref_ms * 1e3, 1),
        "torch_argmax_us": round(argmax_ms * 1e3, 1),
        "speedup": round(ref_ms / kernel_ms, 1),
        "kernel_logits_GBps": round(logits.numel() * 4 / (kernel_ms * 1e-3) / 1e9, 1),
        "kernel_Gtokens_per_s": round(logits.numel() / (kernel_ms * 1e-3) / 1e9, 2),
    }
    run.timings.append(row)
    print(row, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_out = Path(os.environ.get("OUT", ROOT / "bench" / "gpu")) / "sampler_check.json"
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--vocab", type=int, default=128256)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("sampler_check needs a CUDA GPU", file=sys.stderr)
        return 2
    vocab = args.vocab
    run = Run()
    for batch in BATCHES:
        run.check(
            f"tokens fp32 B={batch}", lambda b=batch: check_tokens(b, vocab, torch.float32, False)
        )
    run.check("tokens bf16 B=64", lambda: check_tokens(64, vocab, torch.bfloat16, False))
    run.check("tokens bitmask B=64", lambda: check_tokens(64, vocab, torch.float32, True))
    run.check("tokens bitmask B=256", lambda: check_tokens(256, vocab, torch.float32, True))
    run.check("cross-device bits B=16", lambda: check_cross_device(vocab))
    run.check("SamplingState CUDA == CPU", lambda: check_state(vocab))
    run.check("tail gap 18", lambda: check_tail(vocab, 18.0, 1 << 19))
    run.check("tail gap 20", lambda: check_tail(vocab, 20.0, 1 << 21))
    for batch in BATCHES:
        try:
            time_batch(vocab, batch, run)
        except Exception:
            run.rows.append(
                {"check": f"timing B={batch}", "ok": False, "detail": traceback.format_exc(limit=4)}
            )
    props = torch.cuda.get_device_properties(0)
    env = {"gpu": props.name, "torch": torch.__version__, "triton": triton.__version__}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"env": env, "checks": run.rows, "timings": run.timings}, indent=2)
    )
    print(f"\n{env}\n")
    print("| check | result | detail |\n|---|---|---|")
    for row in run.rows:
        print(
            f"| {row['check']} | {'PASS' if row['ok'] else 'FAIL'} | "
            f"{row['detail'].splitlines()[-1] if row['detail'] else ''} |"
        )
    print(
        "\n| batch | vocab | kernel µs | torch reference µs | speedup | torch argmax µs "
        "| logits GB/s | Gtok/s |\n|---|---|---|---|---|---|---|---|"
    )
    for t in run.timings:
        print(
            f"| {t['batch']} | {t['vocab']} | {t['kernel_us']} | {t['reference_us']} | "
            f"{t['speedup']}x | {t['torch_argmax_us']} | {t['kernel_logits_GBps']} | "
            f"{t['kernel_Gtokens_per_s']} |"
        )
    return 0 if all(row["ok"] for row in run.rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
