"""A drafter fed a target prefill of two prompts, the head's cache on the Triton kernels
(through the interpreter on a machine without a GPU): where the draft-loop and observe graph
tests start (tests/unit/worker/spec/test_draft_graphs.py, test_observe_graphs.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from meshllm_kernels.attention.backends import AttentionRequirements, select_backend
from services.worker.attention.reference import AttentionMetadata
from services.worker.loader import load_model
from services.worker.models.base import CausalLM, split_aux_hidden
from services.worker.runner.input_batch import InputBatch
from services.worker.runner.kv_cache import KVCache
from services.worker.sampling import SamplingState
from services.worker.spec import SpeculativeConfig
from services.worker.spec.drafts import Drafter
from shared.protocol import SamplingParams
from tests.support.spec_heads import (
    write_dflash_draft,
    write_eagle3_head,
    write_eagle_head,
    write_mtp_target,
)
from tests.support.tiny_llama import make_tiny_llama

K = 3
#: the Triton kernels compiled on a GPU machine, through the interpreter elsewhere
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = ([5, 17, 99, 3, 250, 41, 8], list(range(20, 39)))
PARAMS = (
    SamplingParams(temperature=0.0, max_tokens=8),
    SamplingParams(temperature=0.8, seed=5, max_tokens=8),
)
#: each prompt's target KV blocks (block size 16)
TABLES = np.array([[0, 1, 2, 3], [4, 5, 6, 7]])


def write_checkpoints(root: Path) -> Path:
    """A tiny Llama target and a drafter of every method beside it under `root`."""
    target = root / "target"
    make_tiny_llama(target, seed=0)
    write_eagle_head(target, root / "eagle", std=0.3)
    write_eagle3_head(target, root / "eagle3", std=0.3, draft_vocab_size=128)
    write_mtp_target(target, root / "mtp", std=0.3)
    make_tiny_llama(root / "draft", seed=1, num_hidden_layers=1)
    write_dflash_draft(target, root / "dflash", std=0.3, num_layers=2, target_layers=(0, 1))
    return root


@dataclass
class Observed:
    drafter: Drafter
    batch: InputBatch
    sampler: SamplingState
    target: CausalLM
    cache: KVCache

    def forward(
        self, ids: list[int], query_lens: np.ndarray, seq_lens: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target over a step of both rows (`ids` flat, row after row; each row's queries
        at the end of its `seq_lens`), its KV into the rows' blocks: (hidden, aux)."""
        positions = np.concatenate(
            [np.arange(s - q, s) for q, s in zip(query_lens, seq_lens, strict=True)]
        )
        rows = np.repeat(np.arange(len(query_lens)), query_lens)
        slots = TABLES[rows, positions // 16] * 16 + positions % 16
        attn = AttentionMetadata.build(
            query_lens=query_lens, seq_lens=seq_lens, block_tables=TABLES, block_size=16,
            slot_mapping=slots, device=DEVICE,
        )  # fmt: skip
        with torch.inference_mode():
            out = self.target(
                torch.tensor(ids, device=DEVICE),
                torch.tensor(positions, device=DEVICE),
                attn,
                self.cache.layers,
            )
        return split_aux_hidden(out, self.target.config.hidden_size)


def observed(root: Path, method: str) -> Observed:
    """The drafter of `method` after a target prefill of both prompts (observed: every prompt
    pair in its head's cache, each row ready to propose)."""
    served = root / ("mtp" if method == "mtp" else "target")
    target, _ = load_model(served, torch.float32, DEVICE)
    spec = SpeculativeConfig(method=method, model=str(root / method), num_spec_tokens=K)
    vocab = target.config.vocab_size
    drafter = Drafter(
        spec, vocab_size=vocab, max_num_reqs=4, max_model_len=64, device=DEVICE, target=target
    )
    inner = drafter.features or drafter.draft_model
    needs = AttentionRequirements(non_causal=method == "dflash")
    inner.kv.backend = select_backend("triton", needs)  # type: ignore[union-attr]
    lens = np.array([len(p) - 1 for p in PROMPTS])
    cache = KVCache.allocate(target.config, 8, 16, torch.float32, DEVICE)
    state = Observed(drafter, InputBatch(4, 64, 16), SamplingState(4, vocab, DEVICE), target, cache)
    hidden, aux = state.forward([t for p in PROMPTS for t in p[:-1]], lens, lens)
    batch = state.batch
    for row, (prompt, params) in enumerate(zip(PROMPTS, PARAMS, strict=True)):
        batch.row_req[row], batch.sampling[row] = f"r{row}", params
        batch.token_ids[row, : len(prompt)] = prompt
        batch.num_tokens[row], batch.num_computed_tokens[row] = len(prompt), len(prompt) - 1
        state.sampler.add_request(row, params, prompt, [])
    drafter.observe(batch, hidden, aux, np.array([0, 1]), lens, lens)
    return state
