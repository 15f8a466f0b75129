"""SamplingState: parameters take effect as specified, rows are independent, logprobs are raw."""

from __future__ import annotations

import pytest
import torch

from meshllm_kernels.sampling.bitmask import pack_bitmask
from services.worker.sampling import SamplingState
from shared.protocol import SamplingParams
from tests.unit.worker.sampling.stats import chi_square_pvalue

V = 64
EOS = 2


def _state(rows: int = 8) -> SamplingState:
    return SamplingState(rows, V, eos_token_ids=[EOS])


def _greedy(state: SamplingState, logits: torch.Tensor, row: int = 0, pos: int = 0) -> int:
    out = state.sample(logits.reshape(1, -1), torch.tensor([row]), torch.tensor([pos]))
    return int(out.token_ids[0])


def _logits(top: int, second: int, gap: float = 0.5) -> torch.Tensor:
    logits = torch.linspace(-3, 0, V)
    logits[top] = 5.0
    logits[second] = 5.0 - gap
    return logits


def test_greedy_is_the_argmax_and_temperature_zero_ignores_the_seed() -> None:
    state = _state()
    logits = torch.randn(3, V)
    for row, seed in enumerate((0, 1, 2**64 - 1)):
        state.add_request(row, SamplingParams(temperature=0.0, seed=seed), [1], [])
    out = state.sample(logits, torch.tensor([0, 1, 2]), torch.tensor([5, 6, 7]))
    assert torch.equal(out.token_ids, logits.argmax(dim=1))
    assert out.logprobs is None


def test_repetition_penalty_applies_to_prompt_and_output_tokens() -> None:
    state = _state()
    logits = _logits(top=10, second=20)
    state.add_request(0, SamplingParams(temperature=0.0, repetition_penalty=1.5), [10], [])
    assert _greedy(state, logits) == 20  # 5 / 1.5 < 4.5
    state.add_request(1, SamplingParams(temperature=0.0, repetition_penalty=1.5), [7], [10])
    assert _greedy(state, logits, row=1) == 20  # as an earlier output token too
    state.add_request(2, SamplingParams(temperature=0.0, repetition_penalty=1.5), [7], [])
    assert _greedy(state, logits, row=2) == 10


def test_frequency_and_presence_penalties_count_recorded_outputs() -> None:
    state = _state()
    logits = _logits(top=10, second=20, gap=1.0)
    state.add_request(0, SamplingParams(temperature=0.0, frequency_penalty=0.4), [1], [])
    state.add_request(1, SamplingParams(temperature=0.0, presence_penalty=1.5), [1], [])
    assert _greedy(state, logits, 0) == 10 and _greedy(state, logits, 1) == 10
    state.record_sampled(torch.tensor([0, 1]), torch.tensor([10, 10]))
    assert _greedy(state, logits, 0) == 10  # 5 - 0.4 > 4
    assert _greedy(state, logits, 1) == 20  # 5 - 1.5 < 4
    state.record_sampled(torch.tensor([0, 0, 0]), torch.tensor([10, 10, -1]))  # -1: placeholder
    assert state.num_output[0].item() == 3
    assert _greedy(state, logits, 0) == 20  # 5 - 0.4 * 3 < 4


def test_logit_bias_is_added_and_clamped_to_100() -> None:
    state = _state()
    logits = _logits(top=10, second=20)
    state.add_request(0, SamplingParams(temperature=0.0, logit_bias={30: 9.0}), [1], [])
    assert _greedy(state, logits) == 30
    state.add_request(0, SamplingParams(temperature=0.0, logit_bias={10: -1e9, 20: -0.1}), [1], [])
    assert _greedy(state, logits) == 20  # -1e9 became -100, so token 10 is still a number
    logits[20] = -200.0
    assert _greedy(state, logits) not in (10, 20)


def test_allowed_and_bad_token_ids() -> None:
    state = _state()
    state.add_request(0, SamplingParams(temperature=1.0, seed=3, allowed_token_ids=[4, 9]), [1], [])
    state.add_request(1, SamplingParams(temperature=1.0, seed=3, bad_token_ids=[4, 9]), [1], [])
    state.add_request(2, SamplingParams(temperature=1.0, seed=3), [1], [])
    logits = torch.zeros(3, V)
    logits[:, 4] = logits[:, 9] = 3.0
    seen: list[set[int]] = [set(), set(), set()]
    for pos in range(200):
        out = state.sample(logits, torch.tensor([0, 1, 2]), torch.full((3,), pos))
        for i in range(3):
            seen[i].add(int(out.token_ids[i]))
    assert seen[0] == {4, 9}
    assert not seen[1] & {4, 9} and len(seen[1]) > 20
    assert {4, 9} <= seen[2]  # the unrestricted row, in the same batch, still draws them


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    state = _state()
    logits = _logits(top=EOS, second=30)
    logits[40] = 4.8
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[30])
    state.add_request(0, params, [1], [])
    assert _greedy(state, logits) == 40  # eos and the stop id are masked
    state.record_sampled(torch.tensor([0]), torch.tensor([40]))
    assert _greedy(state, logits) == 40
    state.record_sampled(torch.tensor([0]), torch.tensor([40]))
    assert _greedy(state, logits) == EOS  # two outputs: min_tokens reached
    ignore = SamplingParams(temperature=0.0, min_tokens=5, stop_token_ids=[30], ignore_eos=True)
    state.add_request(1, ignore, [1], [])
    assert _greedy(state, logits, row=1) == EOS  # eos is no stop here; 30 still is
    resumed = SamplingParams(temperature=0.0, min_tokens=2)
    state.add_request(2, resumed, [1], [5, 6])  # preempted request already has 2 outputs
    assert _greedy(state, logits, row=2) == EOS


def test_min_tokens_counts_start_at_add_when_counting_was_off() -> None:
    # With no min_tokens or penalty row, record_sampled counts nothing (nothing reads the
    # counts); a min_tokens request that joins later is counted from its add onwards.
    state = _state()
    state.add_request(0, SamplingParams(temperature=0.0), [1], [])
    state.record_sampled(torch.tensor([0]), torch.tensor([40]))
    assert state.num_output[0].item() == 0  # not counted: no reader
    logits = _logits(top=EOS, second=30)
    logits[40] = 4.8
    state.add_request(1, SamplingParams(temperature=0.0, min_tokens=2), [1], [7])
    assert _greedy(state, logits, row=1) == 40  # 1 output of 2: eos masked
    state.record_sampled(torch.tensor([0, 1]), torch.tensor([40, 40]))
    assert _greedy(state, logits, row=1) == EOS  # counted: 2 outputs
    assert _greedy(state, logits, row=0) == EOS  # the plain row was never masked


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_logits_are_not_written_and_plain_rows_read_them_as_they_are(dtype) -> None:  # type: ignore[no-untyped-def]
    # A plain batch (temperature and seed only) hands the model's logits straight to the draw;
    # a batch with an editing stage (here a banned token) works on an fp32 copy. Either way
    # the caller's logits are unchanged and the draw is that of their fp32 values.
    torch.manual_seed(0)
    logits = torch.randn(4, V).to(dtype)
    before = logits.clone()
    plain, edited = _state(), _state()
    for row in range(4):
        plain.add_request(row, SamplingParams(temperature=0.8, seed=row), [1], [])
        edited.add_request(row, SamplingParams(temperature=0.8, seed=row), [1], [])
    edited.add_request(3, SamplingParams(temperature=0.8, seed=3, bad_token_ids=[63]), [1], [])
    rows, pos = torch.arange(4), torch.tensor([3, 4, 5, 6])
    out = plain.sample(logits, rows, pos)
    assert torch.equal(logits, before)
    assert torch.equal(out.token_ids, plain.sample(logits.float(), rows, pos).token_ids)
    out_edited = edited.sample(logits, rows, pos)
    assert torch.equal(logits, before)
    assert torch.equal(out_edited.token_ids[:3], out.token_ids[:3])  # rows 0-2 unaffected


def _allow(*token_ids: int) -> torch.Tensor:
    allowed = torch.zeros(1, V, dtype=torch.bool)
    allowed[0, list(token_ids)] = True
    return pack_bitmask(allowed)


def test_the_grammar_wins_over_min_tokens_and_banned_tokens() -> None:
    # A finished JSON object allows only eos; min_tokens masks eos. Before: every allowed token
    # at -inf drew token 0, which the grammar rejects (a 500). Now the grammar's smallest
    # allowed token is drawn: the output ends, parseable, min_tokens yielding.
    state = _state()
    logits = torch.randn(3, V)
    state.add_request(0, SamplingParams(temperature=0.0, min_tokens=4), [1], [])
    state.add_request(1, SamplingParams(temperature=0.7, seed=3, bad_token_ids=[9, 17]), [1], [])
    state.add_request(2, SamplingParams(temperature=0.0, min_tokens=4), [1], [])
    bitmask = torch.cat([_allow(EOS), _allow(9, 17), _allow(EOS, 12)])
    out = state.sample(logits, torch.arange(3), torch.tensor([1, 1, 1]), bitmask)
    # row 0: only eos allowed, masked by min_tokens; row 1: both allowed tokens banned;
    # row 2: eos masked but 12 remains, so min_tokens holds.
    assert out.token_ids.tolist() == [EOS, 9, 12]
    assert state.sample(logits, torch.arange(3), torch.tensor([1, 1, 1])).token_ids[0] != EOS


def test_grammar_check_reads_the_sign_bit_and_skips_unconstrained_rows() -> None:
    # Token 63 is bit 31 of word 1 (the int32 sign bit); an allowed draw there is kept (a
    # misread bit would fall back to 31, the smallest allowed). A row without a grammar
    # (index -1) keeps its draw, whatever mask row 0 holds.
    state = _state()
    logits = torch.full((2, V), -5.0)
    logits[0, 63] = 3.0
    logits[1, 40] = 4.0
    for row in range(2):
        state.add_request(row, SamplingParams(temperature=0.0), [1], [])
    bitmask = _allow(31, 63)
    out = state.sample(
        logits, torch.arange(2), torch.tensor([1, 1]), bitmask, bitmask_index=torch.tensor([0, -1])
    )
    assert out.token_ids.tolist() == [63, 40]


def test_bitmask_full_and_indexed_forms() -> None:
    state = _state()
    for row in range(3):
        state.add_request(row, SamplingParams(temperature=0.0), [1], [])
    logits = torch.randn(3, V)
    logits[:, 0] = 10.0
    allowed = torch.zeros(2, V, dtype=torch.bool)
    allowed[0, 33] = allowed[1, 63] = True
    rows, pos = torch.tensor([0, 1, 2]), torch.zeros(3)
    index = torch.tensor([1, -1, 0])
    out = state.sample(logits, rows, pos, pack_bitmask(allowed), bitmask_index=index)
    assert out.token_ids.tolist() == [63, 0, 33]
    full = torch.full((3, 2), -1, dtype=torch.int32)
    full[2] = pack_bitmask(allowed[1:])[0]
    assert state.sample(logits, rows, pos, full).token_ids.tolist() == [0, 0, 63]


def test_truncation_sees_the_grammar_mask() -> None:
    # top_p / top_k alone would keep only token 0, which the grammar forbids: the grammar mask
    # goes first (as in vLLM), so truncation picks among the allowed tokens.
    state = _state()
    state.add_request(0, SamplingParams(temperature=1.0, top_p=0.5, seed=1), [1], [])
    state.add_request(1, SamplingParams(temperature=1.0, top_k=1, seed=1), [1], [])
    logits = torch.zeros(2, V)
    logits[:, 0] = 20.0
    logits[:, 17] = 1.0
    allowed = torch.zeros(1, V, dtype=torch.bool)
    allowed[0, 17:20] = True
    for pos in range(20):
        out = state.sample(
            logits,
            torch.tensor([0, 1]),
            torch.full((2,), pos),
            pack_bitmask(allowed),
            bitmask_index=torch.tensor([0, 0]),
        )
        assert out.token_ids[1].item() == 17
        assert out.token_ids[0].item() == 17  # mass of 17 alone reaches 0.5 of the allowed


def test_logprobs_are_raw_log_softmax_with_top_k() -> None:
    state = _state()
    state.add_request(
        0,
        SamplingParams(
            temperature=0.7, seed=5, logprobs=3, repetition_penalty=2.0, logit_bias={1: 5.0}
        ),
        [3],
        [],
    )
    state.add_request(1, SamplingParams(temperature=0.0, logprobs=0), [3], [])
    state.add_request(2, SamplingParams(temperature=1.0), [3], [])
    logits = torch.randn(3, V) * 3
    out = state.sample(logits, torch.tensor([0, 1, 2]), torch.tensor([1, 2, 3]))
    expected = torch.log_softmax(logits.double(), dim=-1)
    assert out.logprobs is not None and out.top_token_ids is not None
    assert out.top_logprobs is not None
    assert torch.allclose(
        out.logprobs.double(),
        expected.gather(1, out.token_ids.unsqueeze(1)).squeeze(1),
        atol=1e-4,
        rtol=0,
    )
    assert out.top_token_ids.shape == (3, 3)  # k = the largest request in the batch
    top = expected.topk(3, dim=-1)
    assert torch.equal(out.top_token_ids, top.indices)
    assert torch.allclose(out.top_logprobs.double(), top.values, atol=1e-4, rtol=0)


def test_logprobs_under_a_grammar_are_of_the_masked_distribution() -> None:
    state = _state()
    state.add_request(0, SamplingParams(temperature=0.0, logprobs=2), [3], [])
    logits = torch.randn(1, V)
    allowed = torch.zeros(1, V, dtype=torch.bool)
    allowed[0, [5, 6, 7]] = True
    out = state.sample(logits, torch.tensor([0]), torch.tensor([0]), pack_bitmask(allowed))
    masked = logits.masked_fill(~allowed, float("-inf"))
    expected = torch.log_softmax(masked, dim=-1)
    assert out.token_ids.item() in (5, 6, 7)
    assert out.logprobs is not None and out.top_token_ids is not None
    assert torch.allclose(out.logprobs, expected[0, out.token_ids], atol=1e-5)
    assert set(out.top_token_ids[0].tolist()) <= {5, 6, 7}


def test_a_request_draws_the_same_tokens_whatever_joins_its_batch() -> None:
    params = SamplingParams(temperature=0.8, top_p=0.95, top_k=40, seed=12345, presence_penalty=0.3)
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(10, V, generator=gen) * 2

    alone = _state()
    alone.add_request(0, params, [1, 2], [])
    solo = []
    for step in range(10):
        token = alone.sample(logits[step : step + 1], torch.tensor([0]), torch.tensor([step]))
        solo.append(int(token.token_ids[0]))
        alone.record_sampled(torch.tensor([0]), token.token_ids)

    crowd = _state()
    crowd.add_request(5, params, [1, 2], [])
    crowd.add_request(1, SamplingParams(temperature=1.5, seed=1, logit_bias={3: 2.0}), [4], [])
    greedy = SamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=2)
    crowd.add_request(7, greedy, [4], [])
    mixed = []
    for step in range(10):
        batch_logits = torch.cat([torch.randn(2, V, generator=gen), logits[step : step + 1]])
        out = crowd.sample(batch_logits, torch.tensor([1, 7, 5]), torch.tensor([40, 41, step]))
        mixed.append(int(out.token_ids[2]))
        crowd.record_sampled(torch.tensor([1, 7, 5]), out.token_ids)
    assert mixed == solo


def test_position_salt_moves_to_other_noise() -> None:
    state = _state()
    state.add_request(0, SamplingParams(temperature=1.0, seed=8), [1], [])
    logits = torch.zeros(1, V)
    salted = [
        int(
            state.sample(
                logits, torch.tensor([0]), torch.tensor([p]), position_salt=2**30
            ).token_ids[0]
        )
        for p in range(30)
    ]
    shifted = [
        int(state.sample(logits, torch.tensor([0]), torch.tensor([p + 2**30])).token_ids[0])
        for p in range(30)
    ]
    plain = [
        int(state.sample(logits, torch.tensor([0]), torch.tensor([p])).token_ids[0])
        for p in range(30)
    ]
    assert salted == shifted
    assert salted != plain


def _frequencies(params: SamplingParams, logits: torch.Tensor, draws: int) -> torch.Tensor:
    rows = 256
    state = SamplingState(rows, logits.numel())
    for row in range(rows):
        state.add_request(row, params.model_copy(update={"seed": 1000 + row}), [0], [])
    counts = torch.zeros(logits.numel())
    for step in range(draws // rows):
        out = state.sample(logits.expand(rows, -1), torch.arange(rows), torch.full((rows,), step))
        counts += torch.bincount(out.token_ids, minlength=logits.numel())
    return counts


@pytest.mark.parametrize(
    ("update", "kept"),
    [
        ({"top_k": 4}, [0, 1, 2, 3]),
        ({"top_p": 0.8}, [0, 1, 2]),  # 0.35 + 0.25 + 0.2 = 0.8 reached with the third
        ({"min_p": 0.3}, [0, 1, 2]),  # > 0.3 * 0.35 = 0.105
        ({"top_k": 5, "top_p": 0.7, "temperature": 0.8}, None),
    ],
)
def test_truncated_draws_follow_the_renormalized_distribution(update, kept) -> None:
    probs = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.05, 0.03, 0.02], dtype=torch.float64)
    logits = probs.log().float()
    params = SamplingParams(temperature=1.0).model_copy(update=update)
    if kept is None:  # temperature first, then top_k, then top_p on what is left
        tempered = torch.softmax(probs.log() / params.temperature, dim=0)
        top5 = tempered[:5] / tempered[:5].sum()
        mass_before = torch.cumsum(top5, 0) - top5
        kept = [i for i in range(5) if mass_before[i] < params.top_p]
        target = tempered
    else:
        target = probs
    draws = 256 * 75
    counts = _frequencies(params, logits, draws)
    assert counts[[i for i in range(7) if i not in kept]].sum() == 0
    expected = target[kept] / target[kept].sum() * draws
    assert chi_square_pvalue(counts[kept], expected) > 1e-3


def test_remove_request_resets_the_row() -> None:
    state = _state()
    logits = _logits(top=10, second=20)
    state.add_request(
        0,
        SamplingParams(
            temperature=0.0, repetition_penalty=3.0, bad_token_ids=[20], logit_bias={30: 50.0}
        ),
        [10],
        [],
    )
    assert _greedy(state, logits) == 30
    state.remove_request(0)
    state.add_request(0, SamplingParams(temperature=0.0), [10], [])
    assert _greedy(state, logits) == 10


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(logit_bias={V: 1.0}),
        SamplingParams(bad_token_ids=[-1]),
        SamplingParams(allowed_token_ids=[]),
        SamplingParams(allowed_token_ids=[3, V + 5]),
    ],
)
def test_out_of_vocabulary_ids_are_rejected(params: SamplingParams) -> None:
    with pytest.raises(ValueError, match=r"allowed_token_ids|logit_bias|bad_token_ids"):
        _state().add_request(0, params, [1], [])


def test_bad_shapes_and_rows_are_rejected() -> None:
    state = _state()
    with pytest.raises(ValueError, match="row 8 outside"):
        state.add_request(8, SamplingParams(), [1], [])
    with pytest.raises(ValueError, match="prompt_token_ids"):
        state.add_request(0, SamplingParams(), [V], [])
    with pytest.raises(ValueError, match="logits must be"):
        state.sample(torch.zeros(1, V + 1), torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="logits are on meta"):
        state.sample(torch.zeros(1, V, device="meta"), torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="positions must be"):
        state.sample(torch.zeros(2, V), torch.tensor([0, 1]), torch.tensor([0]))
    with pytest.raises(ValueError, match="1-D of the same length"):
        state.record_sampled(torch.tensor([0, 1]), torch.tensor([3]))


def test_state_works_inside_and_outside_inference_mode() -> None:
    with torch.inference_mode():
        state = _state()  # built where the model runner builds it
        state.add_request(0, SamplingParams(temperature=1.0, repetition_penalty=1.2), [1], [])
        out = state.sample(torch.randn(1, V), torch.tensor([0]), torch.tensor([0]))
        state.record_sampled(torch.tensor([0]), out.token_ids)
    state.record_sampled(torch.tensor([0]), out.token_ids)
    state.add_request(1, SamplingParams(presence_penalty=1.0), [5], [6])
    state.remove_request(0)
    with torch.inference_mode():
        state.record_sampled(torch.tensor([1]), torch.tensor([7]))
    assert state.num_output[:2].tolist() == [0, 2]
    assert state.output_counts is not None and state.output_counts[1, 7].item() == 1
