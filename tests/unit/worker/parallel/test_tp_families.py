"""Tensor parallelism on CPU (gloo, two real rank processes): for every supported family on tiny
random weights, TP=2 gives transformers' greedy tokens and TP=1's logits (within fp32
reduction-order tolerance), identical seeded samples, logprobs and prompt logprobs, and the same
routed experts.
Both ranks compute the same results (rank 0 answers for the group; the others must agree to
stay in step). Variants: a Llama with one KV head (replicated on both ranks) and a vocabulary
that does not split evenly (padded vocab-parallel embedding and LM head), one with 3 KV heads
(ranks hold different head counts), and the real SmolLM2 (9 heads, 3 KV heads)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.support.tiny_llama import make_tiny_llama, reference_greedy
from tests.support.tiny_models import FAMILIES, make_tiny
from tests.support.tp_families import GREEDY, PROMPTS, family_runs, smollm2_greedy
from tests.support.tp_ranks import run_ranks, single

VARIANTS = ["llama", "llama_kv1_odd_vocab", "llama_uneven_heads", *sorted(FAMILIES)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every variant's checkpoint and reference, the TP=1 runs and both ranks' TP=2 runs
    (one process pair for all of them: spawning ranks costs seconds)."""
    references: dict[str, Any] = {}
    paths: dict[str, str] = {}
    for variant in VARIANTS:
        path = tmp_path_factory.mktemp(variant)
        if variant == "llama":
            references[variant] = make_tiny_llama(path)
        elif variant == "llama_kv1_odd_vocab":
            references[variant] = make_tiny_llama(path, num_key_value_heads=1, vocab_size=509)
        elif variant == "llama_uneven_heads":  # 3 KV heads over 2 ranks: 1 and 2, as SmolLM2
            references[variant] = make_tiny_llama(
                path, hidden_size=96, num_attention_heads=6, num_key_value_heads=3
            )
        else:
            references[variant] = make_tiny(path, variant)
        paths[variant] = str(path)
    torch.set_num_threads(1)
    return {
        "references": references,
        "tp1": single(family_runs, paths),
        "tp2": run_ranks(family_runs, 2, paths),
    }


@pytest.mark.parametrize("variant", VARIANTS)
def test_tp2_greedy_equals_transformers_and_tp1(runs: dict[str, Any], variant: str) -> None:
    rank0, rank1 = (r[variant]["greedy"] for r in runs["tp2"])
    tp1 = runs["tp1"][variant]["greedy"]
    reference = runs["references"][variant]
    for rid, prompt in PROMPTS.items():
        expected = reference_greedy(reference, prompt, GREEDY.max_tokens)
        assert rank0["outputs"][rid] == expected, rid
        assert tp1["outputs"][rid] == expected, rid
    assert len(rank0["logits"]) == len(tp1["logits"])
    for ours, single_rank in zip(rank0["logits"], tp1["logits"], strict=True):
        torch.testing.assert_close(
            torch.from_numpy(ours), torch.from_numpy(single_rank), rtol=1e-4, atol=1e-4
        )
    # The ranks hold bit-identical logits (ring all-reduce, exact all-gather), so each samples
    # what the other does.
    for a, b in zip(rank0["logits"], rank1["logits"], strict=True):
        assert (a == b).all()
    assert rank0["sampled"] == rank1["sampled"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_tp2_seeded_sampling_equals_tp1(runs: dict[str, Any], variant: str) -> None:
    rank0, rank1 = (r[variant]["seeded"] for r in runs["tp2"])
    tp1 = runs["tp1"][variant]["seeded"]
    assert rank0["outputs"] == tp1["outputs"]
    assert rank0["outputs"] == rank1["outputs"]
    for ours, theirs in zip(rank0["sampled"], tp1["sampled"], strict=True):
        assert ours["request_id"] == theirs["request_id"]
        assert ours["token_ids"] == theirs["token_ids"]
        assert ours["top_token_ids"] == theirs["top_token_ids"]
        ours_lp, theirs_lp = (np.frombuffer(x["logprobs"], "<f4") for x in (ours, theirs))
        np.testing.assert_allclose(ours_lp, theirs_lp, atol=1e-4)
        # Prompt logprobs (chunked prefill: the driver's chunks of 5) as TP=1's
        assert ours["prompt_logprobs_start"] == theirs["prompt_logprobs_start"]
        assert ours["prompt_top_token_ids"] == theirs["prompt_top_token_ids"]
        if theirs["prompt_logprobs"] is not None:
            ours_p, theirs_p = (np.frombuffer(x["prompt_logprobs"], "<f4") for x in (ours, theirs))
            np.testing.assert_allclose(ours_p, theirs_p, atol=1e-4)
        # MoE families: the routed experts of every position are TP=1's
        assert ours["routed_experts"] == theirs["routed_experts"]
        assert ours["routed_experts_shape"] == theirs["routed_experts_shape"]


def test_shards_are_what_the_layout_says(runs: dict[str, Any]) -> None:
    """A rank holds half the KV heads of a 2-KV-head model, and the one KV head of a 1-KV-head
    model (replicated); MoE runs returned routed experts at all."""
    rank0 = runs["tp2"][0]
    assert rank0["llama"]["greedy"]["kv_heads"] == 1
    assert runs["tp1"]["llama"]["greedy"]["kv_heads"] == 2
    assert rank0["llama_kv1_odd_vocab"]["greedy"]["kv_heads"] == 1
    assert [r["llama_uneven_heads"]["greedy"]["kv_heads"] for r in runs["tp2"]] == [1, 2]
    moe = rank0["mixtral"]["greedy"]["sampled"]
    assert moe and all(s["routed_experts"] is not None for s in moe)
    # Prompt logprobs came (with each request's first token): all but "one"'s empty prompt part
    firsts = [s for s in rank0["llama"]["seeded"]["sampled"] if s["prompt_logprobs"] is not None]
    assert {s["request_id"] for s in firsts} == {"long", "short"}


@pytest.mark.slow
def test_smollm2_tp2_equals_transformers(smollm2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    texts = ["The quick brown fox", "def fibonacci(n):\n    ", "1, 2, 3, 4, 5,"]
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    max_tokens = 12
    rank0, rank1 = run_ranks(smollm2_greedy, 2, str(smollm2_dir), prompts, max_tokens)
    reference = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    expected = [reference_greedy(reference, p, max_tokens) for p in prompts]
    assert rank0["outputs"] == expected
    assert rank1["outputs"] == expected
    assert (rank0["heads"], rank1["heads"]) == ((3, 1), (6, 2))
    with torch.no_grad():
        last = torch.stack([reference(torch.tensor([p])).logits[0, -1] for p in prompts])
    torch.testing.assert_close(torch.from_numpy(rank0["first_logits"]), last, rtol=0, atol=2e-4)
