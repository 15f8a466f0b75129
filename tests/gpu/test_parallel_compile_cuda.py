"""meshllm_kernels/parallel_compile.py on CUDA: the decode-attention choices a warm-up compiles,
compiled in a pool of threads (launches inside only compile), are all there afterwards: the
real launches that follow compile nothing, and they compute what the PyTorch reference does.
In a fresh process with an empty Triton cache directory, so every kernel is compiled here and
not read from an earlier test's compile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])

SCRIPT = textwrap.dedent(
    """
    import json, torch
    from meshllm_kernels.attention.decode_variants import compile_decode_variants, decode_variants
    from meshllm_kernels.attention.paged_decode import (
        paged_decode_attention, paged_decode_reference,
    )
    from meshllm_kernels.parallel_compile import compiles_in_parallel
    from meshllm_kernels.runtime.compile_watch import CompileWatch
    from meshllm_kernels.runtime.tensor_checks import sm_count

    device = torch.device("cuda")
    torch.manual_seed(0)
    cache = torch.randn(2, 64, 16, 8, 128, dtype=torch.bfloat16, device=device)
    # Triton specializes a table's width by whether it is a multiple of 16: one width of each
    # class, as the runner's warm-up has (16 columns and a capacity of 63 blocks).
    WIDTHS = {16, 63}
    variants = decode_variants(8, 128, 2, sm_count(device), 32, 1024)
    watch = CompileWatch().install()
    with compiles_in_parallel(8) as pooled:
        compile_decode_variants(cache, 32, torch.bfloat16, variants, WIDTHS)
        compiled_inside = len(watch.compiles)
    compiled_by_pool = len(watch.compiles)
    watch.mark_warm()
    compile_decode_variants(cache, 32, torch.bfloat16, variants, WIDTHS)
    torch.cuda.synchronize()
    compiled_after = [c.kernel for c in watch.after_warmup()]
    # A real decode over real contexts with each choice's split count and tiles.
    lens = torch.tensor([1, 17, 300, 1000], dtype=torch.int32, device=device)
    tables = torch.stack([torch.randperm(64, device=device) for _ in range(4)]).int()
    q = torch.randn(4, 32, 128, dtype=torch.bfloat16, device=device)
    want = paged_decode_reference(q, cache, tables, lens)
    worst = 0.0
    for choice in variants:
        got = paged_decode_attention(
            q, cache, tables, lens, num_splits=choice.num_splits, max_seq_len=1000,
            tiles=choice.tiles, strided=choice.strided,
        )
        worst = max(worst, (got.float() - want.float()).abs().max().item())
    torch.cuda.synchronize()
    print(json.dumps({
        "pooled": pooled, "variants": len(variants), "compiled_inside": compiled_inside,
        "compiled_by_pool": compiled_by_pool,
        "compiled_after": compiled_after, "worst": worst,
    }))
    """
)


def test_a_pooled_compile_leaves_nothing_to_compile_and_the_kernels_right(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=ROOT, TRITON_CACHE_DIR=str(tmp_path / "triton"))
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["pooled"] is True
    assert got["variants"] >= 4
    # Compiles finish when the pool is left, not at each launch.
    assert got["compiled_inside"] < got["compiled_by_pool"]
    assert got["compiled_by_pool"] >= 2 * got["variants"]  # every choice at both width classes
    assert got["compiled_after"] == []  # the real launches found every kernel compiled
    assert got["worst"] < 2e-2
