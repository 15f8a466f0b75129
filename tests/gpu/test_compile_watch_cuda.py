"""A real Triton compile on CUDA reaches the compile watch
(meshllm_kernels/runtime/compile_watch.py): one compile per new specialization, none for a
launch that reuses one."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from meshllm_kernels.runtime.compile_watch import CompileWatch


@triton.jit
def _scaled_copy(x_ptr, out_ptr, n, SCALE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * SCALE, mask=mask)


def test_a_new_specialization_is_one_compile_after_the_warmup() -> None:
    x = torch.arange(100, device="cuda", dtype=torch.float32)
    out = torch.empty_like(x)
    watch = CompileWatch().install()
    try:
        _scaled_copy[(1,)](x, out, 100, SCALE=2, BLOCK=128)
        watch.mark_warm()
        _scaled_copy[(1,)](x, out, 100, SCALE=2, BLOCK=128)  # cached: no compile
        assert watch.after_warmup() == []
        _scaled_copy[(1,)](x, out, 100, SCALE=3, BLOCK=128)  # a new constexpr
        torch.cuda.synchronize()
    finally:
        watch.uninstall()
    assert torch.equal(out, x * 3)
    stalls = watch.after_warmup()
    assert [c.kernel for c in stalls] == ["_scaled_copy"]
    assert stalls[0].seconds > 0
    assert len(watch.compiles) == 2


def test_the_sampler_compiles_once_for_every_batch_size() -> None:
    """The Gumbel sampler's chunk count depends on the batch size; it must not make a new
    specialization (BLOCK_CHUNKS fixed per vocabulary, num_chunks not specialized): on the
    H200 each new class of batch size held a serving step ~0.5 s."""
    from meshllm_kernels.sampling.gumbel_kernel import gumbel_argmax_triton

    vocab = 128_256
    watch = CompileWatch().install()
    try:
        for i, batch in enumerate((1, 9, 17, 33, 64, 80, 113, 128, 256)):
            g = torch.Generator(device="cuda").manual_seed(i)
            logits = torch.randn(batch, vocab, device="cuda", generator=g)
            inv_t = torch.zeros(batch, device="cuda")  # greedy: the argmax, whatever the chunks
            seeds = torch.arange(batch, dtype=torch.int64, device="cuda") + 7
            positions = torch.arange(batch, dtype=torch.int64, device="cuda")
            got = gumbel_argmax_triton(logits, inv_t, seeds, positions)
            assert torch.equal(got, logits.argmax(-1)), batch
            watch.mark_warm()  # compiled at the first batch size, never again
        torch.cuda.synchronize()
    finally:
        watch.uninstall()
    # (the first batch size may find the kernel compiled by an earlier test of this process)
    assert watch.installed and watch.after_warmup() == []


def test_no_draw_compiles_after_the_sampler_warmup() -> None:
    """After compile_draws (the runner's warm-up), no request the sampler serves compiles the
    draw again: a feed, a grammar bitmask, an fp32 copy for top_p or logprobs, odd and even
    batches with rows and positions as the two rows of one upload (positions 16-byte aligned
    at even batch sizes only)."""
    from meshllm_kernels.sampling.bitmask import pack_bitmask
    from services.worker.sampling import SamplingState
    from services.worker.sampling.draw_variants import compile_draws
    from shared.protocol import SamplingParams

    vocab = 49_152
    state = SamplingState(64, vocab, "cuda")
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, seed=3),
        SamplingParams(temperature=0.8, seed=4, top_p=0.9),
        SamplingParams(temperature=0.0, logprobs=2),
    ]
    for row, p in enumerate(params):
        state.add_request(row, p, [5, 6], [])
    feed = torch.zeros(64, dtype=torch.int64, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    watch = CompileWatch().install()
    try:
        compile_draws(state, torch.randn(2, vocab, device="cuda", generator=g).bfloat16())
        watch.mark_warm()
        for rows in ([0], [0, 1], [0, 1, 3], [1, 2], [0, 1, 2], [3], [2]):
            batch = len(rows)
            packed = torch.tensor([rows, [7 + r for r in rows]], device="cuda")
            logits = torch.randn(batch, vocab, device="cuda", generator=g).bfloat16()
            state.sample(logits, packed[0], packed[1], feed=feed)
            allowed = torch.zeros(batch, vocab, dtype=torch.bool)
            allowed[:, :100] = True
            out = state.sample(
                logits, packed[0], packed[1], pack_bitmask(allowed).cuda(), feed=feed
            )
            assert bool((out.token_ids < 100).all())
        torch.cuda.synchronize()
    finally:
        watch.uninstall()
    assert [c.kernel for c in watch.after_warmup()] == []


def test_the_gemv_compiles_once_for_every_row_count_up_to_its_block() -> None:
    """An eager step's rows (a prefill chunk's logits rows: 1 when one prompt ends in it, 16
    when sixteen do) must not make a new GEMV specialization after the warm-up's rows: on the
    H100 an eager LM head over 16 rows compiled `_gemv_kernel` in a serving step (192 ms). A
    shape of its own, so that no earlier test has compiled it; split-K, so the reduce kernel
    is launched too."""
    from meshllm_kernels.decode_chain.gemv import GemvConfig, gemv

    config = GemvConfig(block_n=64, block_k=128, split_k=2)
    g = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(320, 768, device="cuda", dtype=torch.bfloat16, generator=g)
    watch = CompileWatch().install()
    try:
        for rows in (4, 1, 16, 9, 2):
            x = torch.randn(rows, 768, device="cuda", dtype=torch.bfloat16, generator=g)
            got = gemv(x, weight, config)
            want = x.float() @ weight.float().T
            torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=5e-2)
            watch.mark_warm()
        torch.cuda.synchronize()
    finally:
        watch.uninstall()
    assert [c.kernel for c in watch.compiles if not c.after_warmup] == [
        "_gemv_kernel",
        "_split_k_reduce_kernel",
    ]
    assert watch.after_warmup() == [], watch.after_warmup()
