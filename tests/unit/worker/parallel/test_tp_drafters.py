"""Model drafters under tensor parallelism (two real gloo ranks, a tiny random Llama whose
vocabulary pads over the ranks): a draft model, EAGLE-1/2 (the target's embedding and LM head),
EAGLE-3 (fused auxiliary layer states, its own smaller vocabulary through d2t) and MTP modules
in the target's checkpoint, each run whole on every rank (services/worker/spec/__init__.py).

- Greedy output equals transformers', TP=1's without speculation and the group's without
  speculation, on both ranks.
- The group drafts what TP=1 drafts: the same draft and acceptance counts, greedy and seeded,
  on both ranks (a drafter loaded with the target's shard plan would draft from partial sums
  and accept less, or not load at all). Drafts are accepted and rejected for every method
  (EAGLE-3's pass-through head only when sampled; the others greedy too).
- Seeded sampling with the drafter gives TP=1's tokens on both ranks, as without speculation
  (test_tp_families.py).
- The worker's start-up (bootstrap.build_runner, which the followers run too) gives every rank
  the whole drafter with TP=1's weights next to its half of the target.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.tiny_llama import reference_greedy
from tests.support.tp_drafters import (
    DRAFTERS,
    NEW_TOKENS,
    PROMPTS,
    built_drafters,
    drafter_runs,
    write_checkpoints,
)
from tests.support.tp_ranks import run_ranks, single

METHODS = list(DRAFTERS)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """(the checkpoints' root, the target in transformers)."""
    root = tmp_path_factory.mktemp("tp_drafters")
    return root, write_checkpoints(root)


@pytest.fixture(scope="module")
def runs(checkpoints: tuple[Path, Any]) -> dict[str, Any]:
    root, hf = checkpoints
    torch.set_num_threads(1)
    return {
        "expected": {rid: reference_greedy(hf, p, NEW_TOKENS) for rid, p in PROMPTS.items()},
        "tp1": single(drafter_runs, str(root), METHODS),
        "tp2": run_ranks(drafter_runs, 2, str(root), METHODS),
    }


@pytest.mark.parametrize("method", METHODS)
def test_tp2_greedy_with_drafts_equals_transformers_and_no_speculation(
    runs: dict[str, Any], method: str
) -> None:
    rank0, rank1 = (r[method]["greedy"] for r in runs["tp2"])
    expected = runs["expected"]
    assert runs["tp1"]["plain"] == expected
    assert runs["tp2"][0]["plain"] == expected
    assert rank0["outputs"] == expected
    assert rank1["outputs"] == expected


@pytest.mark.parametrize("method", METHODS)
def test_tp2_drafts_as_tp1_accepted_and_rejected_alike_on_both_ranks(
    runs: dict[str, Any], method: str
) -> None:
    tp1 = runs["tp1"][method]
    rank0, rank1 = (r[method] for r in runs["tp2"])
    for kind in ("greedy", "seeded"):
        counts = (rank0[kind]["drafted"], rank0[kind]["accepted"], rank0[kind]["steps"])
        assert counts == (rank1[kind]["drafted"], rank1[kind]["accepted"], rank1[kind]["steps"])
        assert counts == (tp1[kind]["drafted"], tp1[kind]["accepted"], tp1[kind]["steps"])
    drafted = rank0["greedy"]["drafted"] + rank0["seeded"]["drafted"]
    accepted = rank0["greedy"]["accepted"] + rank0["seeded"]["accepted"]
    assert 0 < accepted < drafted
    # EAGLE-3's pass-through head drafts the last token again, the DFlash draft is random:
    # greedy drafts missed, sampled ones accepted now and then
    if method not in ("eagle3", "dflash"):
        assert 0 < rank0["greedy"]["accepted"] < rank0["greedy"]["drafted"]


@pytest.mark.parametrize("method", METHODS)
def test_tp2_seeded_sampling_with_drafts_equals_tp1(runs: dict[str, Any], method: str) -> None:
    rank0, rank1 = (r[method]["seeded"] for r in runs["tp2"])
    tp1 = runs["tp1"][method]["seeded"]
    assert rank0["outputs"] == tp1["outputs"]
    assert rank1["outputs"] == rank0["outputs"]
    assert rank0["drafted"] > 0


def test_the_worker_builds_every_rank_a_whole_drafter(checkpoints: tuple[Path, Any]) -> None:
    """Through the worker's own start-up (bootstrap.build_runner, as rank 0 and each follower
    run it): the target's shard plan splits the target, never the drafter, which every rank
    holds whole, with TP=1's weights."""
    root = checkpoints[0]
    torch.set_num_threads(1)
    tp1 = single(built_drafters, str(root), METHODS)
    rank0, rank1 = run_ranks(built_drafters, 2, str(root), METHODS)
    for method in METHODS:
        (qkv1, whole), (qkv_a, ours_a), (qkv_b, ours_b) = tp1[method], rank0[method], rank1[method]
        assert qkv_a == qkv_b == qkv1 // 2  # the target: half the heads on each rank
        assert ours_a == whole and ours_b == whole, method
