"""Drawing drafts: greedy rows take the argmax, sampled rows the Gumbel-max draw of the
request's seed at the draft's salted position (2^30 past the target's), and keep q =
softmax(logits / T) over the target vocabulary for rejection sampling."""

from __future__ import annotations

import numpy as np
import torch

from meshllm_kernels.sampling.gumbel import gumbel_argmax
from services.worker.runner.input_batch import InputBatch
from services.worker.sampling import SamplingState
from services.worker.spec.draft_sampler import DraftSampler
from services.worker.spec.draws import DRAFT_POSITION_SALT
from shared.protocol import SamplingParams

VOCAB = 32
BASE = 10
PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, seed=11),
    SamplingParams(temperature=1.3, seed=5),
]


def setup(vocab: int = VOCAB) -> tuple[SamplingState, InputBatch]:
    sampler = SamplingState(len(PARAMS), vocab)
    batch = InputBatch(len(PARAMS), 64, 16)
    for row, params in enumerate(PARAMS):
        sampler.add_request(row, params, list(range(BASE)), [])
        batch.row_req[row] = f"r{row}"
        batch.sampling[row] = params
        batch.num_tokens[row] = BASE
    return sampler, batch


def test_greedy_and_seeded_draws_at_the_salted_position_with_their_q() -> None:
    sampler, batch = setup()
    draws = DraftSampler(sampler, batch, np.arange(3), np.array([2, 2, 1]), VOCAB)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    ids = draws.draw(logits, np.arange(3))
    assert ids[0] == logits[0].argmax()
    inv_t = torch.tensor([0.0, 1 / 0.7, 1 / 1.3])
    seeds = torch.tensor([0, 11, 5])
    salted = gumbel_argmax(logits, inv_t, seeds, torch.full((3,), BASE + DRAFT_POSITION_SALT))
    assert ids.tolist() == salted.tolist()
    later = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    ids2 = draws.draw(later, np.array([0, 1]))  # draft 2 of rows 0 and 1 only
    assert (
        ids2.tolist()
        == gumbel_argmax(
            later, inv_t[:2], seeds[:2], torch.full((2,), BASE + 1 + DRAFT_POSITION_SALT)
        ).tolist()
    )

    proposals = draws.proposals(draws.drafts())
    assert [p.drafts for p in proposals] == [
        [int(ids[0]), int(ids2[0])],
        [int(ids[1]), int(ids2[1])],
        [int(ids[2])],
    ]
    assert [p.base for p in proposals] == [BASE] * 3
    assert proposals[0].q is None  # greedy: a point mass, verified by the same-noise rule
    q1, q2 = proposals[1].q, proposals[2].q
    assert q1 is not None and q2 is not None and q1.shape == (2, VOCAB) and q2.shape == (1, VOCAB)
    torch.testing.assert_close(q1[0], torch.softmax(logits[1] / 0.7, -1))
    torch.testing.assert_close(q1[1], torch.softmax(later[1] / 0.7, -1))
    torch.testing.assert_close(q2[0], torch.softmax(logits[2] / 1.3, -1))


def test_a_smaller_draft_vocabulary_draws_in_its_ids_and_spreads_q_over_the_targets() -> None:
    sampler, batch = setup()
    vocab_map = torch.arange(8) * 4 + 1  # draft i -> target 4i + 1
    draws = DraftSampler(sampler, batch, np.array([1, 2]), np.array([1, 1]), VOCAB, vocab_map)
    logits = torch.randn(2, 8, generator=torch.Generator().manual_seed(2))
    ids = draws.draw(logits, np.arange(2))
    assert ((ids >= 0) & (ids < 8)).all()  # the drafter's own ids (its next input)
    drafts = draws.drafts()
    assert drafts == [[int(vocab_map[ids[0]])], [int(vocab_map[ids[1]])]]
    q = draws.proposals(drafts)[0].q
    assert q is not None
    unmapped = torch.ones(VOCAB, dtype=torch.bool)
    unmapped[vocab_map] = False
    assert (q[0, unmapped] == 0).all()
    torch.testing.assert_close(q[0, vocab_map], torch.softmax(logits[0] / 0.7, -1))
