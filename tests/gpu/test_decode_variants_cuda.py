"""After the runner's warm-up on CUDA no eager decode-attention launch compiles: every choice
an eager step can make (meshllm_kernels/attention/decode_variants.py) at the table widths
eager steps use (services/worker/attention/table_width.py) was compiled at start-up."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from meshllm_kernels.attention.paged_decode import paged_decode_attention
from meshllm_kernels.runtime.compile_watch import CompileWatch
from services.worker.attention.table_width import table_width
from tests.support.tiny_llama import make_tiny_llama, tiny_runner


def test_no_decode_attention_compile_after_the_warmup(tmp_path: Path) -> None:
    make_tiny_llama(tmp_path)
    runner = tiny_runner(
        tmp_path, dtype=torch.bfloat16, num_blocks=512, block_size=4, max_num_reqs=64,
        device="cuda",
    )  # fmt: skip
    watch = CompileWatch().install()
    try:
        runner.warmup()
        watch.mark_warm()
        cache = runner.kv_cache.attention_layers[0]
        capacity = runner.batch.max_blocks_per_req
        heads, head_dim = runner.config.num_attention_heads, cache.shape[-1]
        longest = runner.max_model_len
        for d in (1, 2, 3, 5, 9, 17, 33, 64):
            for length in sorted({1, 5, 17, longest // 2, longest}):
                lens = np.full(d, length)
                width = table_width(lens, 4, capacity)
                tables = torch.zeros(d, width, dtype=torch.int32, device="cuda")
                q = torch.randn(d, heads, head_dim, dtype=torch.bfloat16, device="cuda")
                paged_decode_attention(
                    q, cache, tables, torch.from_numpy(lens).int().cuda(),
                    max_seq_len=int(lens.max()),
                )  # fmt: skip
        torch.cuda.synchronize()
    finally:
        watch.uninstall()
    assert [c for c in watch.compiles if not c.after_warmup], "the warm-up compiled nothing"
    assert watch.after_warmup() == []
