"""Verify steps chained on the device, PyTorch path (services/worker/spec/chain.py and
device_ngram.py): the device's n-gram drafts are the host lookup's, the device copy of each row
takes up exactly what the host appended outside the chain, and a landed step appends its
tokens to the host batch."""

from __future__ import annotations

import numpy as np
import torch

from services.worker.runner.input_batch import InputBatch
from services.worker.spec.chain import DraftChain
from services.worker.spec.device_ngram import ngram_drafts
from services.worker.spec.ngram import NgramProposer
from shared.protocol import NewRequestData, SamplingParams

CPU = torch.device("cpu")


def test_device_drafts_equal_the_host_lookup() -> None:
    rng = np.random.default_rng(0)
    proposer = NgramProposer(2, 4, native=False)
    found = 0
    for _ in range(200):
        tokens = rng.integers(0, int(rng.integers(2, 6)), size=(7, 60)).astype(np.int32)
        lengths = rng.integers(1, 61, size=7)
        ks = rng.integers(0, 6, size=7)
        want = proposer.propose(tokens, np.arange(7), lengths, ks)
        drafts, counts = ngram_drafts(
            torch.from_numpy(tokens), torch.from_numpy(lengths), torch.from_numpy(ks), 5, 2, 4
        )
        assert [drafts[i, : counts[i]].tolist() for i in range(7)] == want
        found += sum(map(len, want))
    assert found > 500


def _batch() -> InputBatch:
    batch = InputBatch(4, 64, 4)
    for i, prompt in enumerate(([1, 2, 3, 1, 2], [9, 8, 7])):
        batch.add(
            NewRequestData(
                request_id=f"r{i}",
                token_ids=prompt,
                num_prompt_tokens=len(prompt),
                num_computed_tokens=0,
                block_ids=[list(range(8 * i, 8 * i + 8))],
                sampling=SamplingParams(max_tokens=20),
            )
        )
    return batch


def _chain() -> DraftChain:
    return DraftChain(4, 64, 64, 3, 2, 3, CPU)


def test_sync_uploads_what_the_host_appended_and_only_that() -> None:
    batch, chain = _batch(), _chain()
    rows = np.array([0, 1])
    chain.sync(batch, rows, torch.from_numpy)
    assert chain.length[:2].tolist() == [5, 3]
    assert chain.tokens[0, :5].tolist() == [1, 2, 3, 1, 2]
    assert chain.tokens[1, :3].tolist() == [9, 8, 7]
    chain.tokens[0, 0] = 99  # a token the host already gave the device is not sent again
    batch.append_sampled(np.array([0]), np.array([3]))  # a step verified on the host
    chain.sync(batch, rows, torch.from_numpy)
    assert chain.tokens[0, :6].tolist() == [99, 2, 3, 1, 2, 3]
    assert chain.length[:2].tolist() == [6, 3]
    chain.forget(1)  # a new request in row 1: all of it again
    chain.sync(batch, rows, torch.from_numpy)
    assert chain.tokens[1, :3].tolist() == [9, 8, 7] and chain.known[1] == 3


def test_a_step_lays_out_accepts_and_lands() -> None:
    batch, chain = _batch(), _chain()
    rows = np.array([0, 1])
    chain.sync(batch, rows, torch.from_numpy)
    tables = torch.from_numpy(batch.block_tables[0, rows])
    rows_t = torch.from_numpy(rows)
    step = chain.lay_out(rows_t, torch.tensor([3, 3]), torch.tensor([25, 3 + 20]), tables, 4, 64)
    # row 0: "1 2" occurred at 0..1, so the drafts are 3 1 2 (cut at its last token); row 1:
    # no repeat, no drafts
    assert step.num_drafts.tolist() == [3, 0]
    assert step.drafts[0].tolist() == [3, 1, 2]
    width = chain.width
    assert step.input_ids.view(2, width).tolist() == [[2, 3, 1, 2], [7, 0, 0, 0]]
    assert step.positions.view(2, width).tolist() == [[4, 5, 6, 7], [2, 2, 2, 2]]
    assert step.slots.view(2, width)[1].tolist() == [8 * 4 + 2, -1, -1, -1]
    assert step.seq_lens.tolist() == [4 + width, 2 + width]
    latest = torch.zeros(4, dtype=torch.int64)
    draws = torch.tensor([[3, 1, 5, 6], [4, 0, 0, 0]])  # row 0: 2 drafts stand, then 5
    packed = chain.accept(rows_t, step, draws, latest)
    assert packed[:, :2].tolist() == [[3, 3], [1, 0]]
    assert chain.length[:2].tolist() == [8, 4] and latest[:2].tolist() == [5, 4]
    chain.ahead[rows] += 1 + 3
    emitted = chain.land(batch, rows, np.array([3, 3]), np.array([True, True]), packed.numpy())
    assert emitted == [(0, [3, 1, 5], 3), (1, [4], 0)]
    assert batch.tokens_of("r0") == [1, 2, 3, 1, 2, 3, 1, 5]
    assert batch.num_computed_tokens[0] == 7 and batch.num_tokens[1] == 4
    assert chain.known[:2].tolist() == [8, 4] and chain.ahead[:2].tolist() == [0, 0]
    assert chain.tokens[0, :8].tolist() == batch.tokens_of("r0")


def test_rows_at_max_tokens_compute_nothing_and_spans_must_fit() -> None:
    batch, chain = _batch(), _chain()
    rows = np.array([0, 1])
    chain.sync(batch, rows, torch.from_numpy)
    step = chain.lay_out(
        torch.from_numpy(rows),
        torch.tensor([3, 3]),
        torch.tensor([5, 4]),  # row 0 holds its 5 tokens already; row 1 may get one more
        torch.from_numpy(batch.block_tables[0, rows]),
        4,
        64,
    )
    assert step.active.tolist() == [False, True]
    assert (step.slots.view(2, -1)[0] == -1).all()
    assert step.num_drafts.tolist() == [0, 0]  # row 1: room for the bonus token only
    assert chain.fits(batch, rows)
    chain.ahead[0] = 64  # steps in flight could take row 0 past its table
    assert not chain.fits(batch, rows)
