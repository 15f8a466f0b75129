"""ModelRunner on tiny random-weight Llamas: tokens and logits equal transformers' for the same
weights, through batching, chunked prefill, prefix hits and preemption."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from services.worker.runner.input_batch import PlanError
from services.worker.sampling import SamplingState
from shared.codec import decode, encode
from shared.protocol import (
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    StepPlan,
    StepResult,
)
from tests.support.plans import PlanDriver
from tests.support.tiny_llama import (
    TINY_PROMPTS,
    LogitsCapture,
    make_tiny_llama,
    reference_greedy,
    reference_logits,
    tiny_runner,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
PROMPTS = TINY_PROMPTS

ROPE_VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    # positions run past original_max_position_embeddings, where the scaling really acts
    "llama3": {
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
    },
    "yarn": {
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
        }
    },
    "linear": {"rope_parameters": {"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0}},
    "tied_with_biases": {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True},
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("tiny-llama")
    return path, make_tiny_llama(path)


def check_run_against_reference(driver: PlanDriver, reference: Any, capture: LogitsCapture) -> None:
    """Every request's tokens equal transformers' greedy generate, and the logits the runner
    sampled from equal a full transformers forward at the same positions."""
    per_request: dict[str, list[torch.Tensor]] = {rid: [] for rid in driver.requests}
    sampling_steps = [r for r in driver.results if r.sampled]  # one logits call each
    assert len(sampling_steps) == len(capture.calls)
    seen = 0
    for result, logits in zip(sampling_steps, capture.calls, strict=True):
        for sampled, row in zip(result.sampled, logits, strict=True):
            per_request[sampled.request_id].append(row)
            seen += 1
    assert seen > 0
    for rid, request in driver.requests.items():
        expected = reference_greedy(reference, request.prompt, request.sampling.max_tokens)
        assert request.output == expected, rid
        full = reference_logits(reference, request.tokens)
        start = len(request.prompt) - 1
        ours = torch.stack(per_request[rid])
        torch.testing.assert_close(ours, full[start : start + len(ours)], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("variant", sorted(ROPE_VARIANTS))
def test_batched_greedy_equals_transformers(tmp_path: Path, variant: str) -> None:
    reference = make_tiny_llama(tmp_path, **ROPE_VARIANTS[variant])
    runner = tiny_runner(tmp_path)
    if variant == "tied_with_biases":
        assert runner.model.lm_head is None
    capture = LogitsCapture(runner)
    driver = PlanDriver(runner)
    for i, prompt in enumerate(PROMPTS):
        driver.add(f"r{i}", prompt, GREEDY)
    driver.run()
    check_run_against_reference(driver, reference, capture)


def test_chunked_prefill_mixed_with_decodes(tiny: tuple[Path, Any]) -> None:
    path, reference = tiny
    runner = tiny_runner(path)
    capture = LogitsCapture(runner)
    driver = PlanDriver(runner, chunk_size=3, token_budget=8)
    driver.add("early", PROMPTS[1], GREEDY)
    driver.step()
    driver.step()  # "early" decodes while the long prompts arrive in chunks
    driver.add("long", PROMPTS[2], GREEDY)
    driver.add("mid", PROMPTS[0], GREEDY)
    driver.run()
    chunked = [p for p in driver.plans if any(r.request_id == "long" for r in p.cached_requests)]
    assert any(p.num_scheduled_tokens.get("long", 0) == 3 for p in chunked)
    mixed = [p for p in driver.plans if len(set(p.num_scheduled_tokens.values())) > 1]
    assert mixed, "some step must mix a decode with a prefill chunk"
    check_run_against_reference(driver, reference, capture)


def test_prefix_hit_reuses_blocks_filled_by_an_earlier_request(tiny: tuple[Path, Any]) -> None:
    path, reference = tiny
    runner = tiny_runner(path)
    driver = PlanDriver(runner, prefix_caching=True)
    shared = PROMPTS[2][:13]
    driver.add("first", [*shared, 100, 101], GREEDY)
    driver.run()
    second = driver.add("second", [*shared, 200, 201, 202], GREEDY)
    assert second.num_computed == 12  # three full blocks of 4 come from "first"
    driver.run()
    new = next(r for p in driver.plans for r in p.new_requests if r.request_id == "second")
    assert new.num_computed_tokens == 12
    first_scheduled = next(p for p in driver.plans if "second" in p.num_scheduled_tokens)
    assert first_scheduled.num_scheduled_tokens["second"] == len(second.prompt) - 12
    assert second.output == reference_greedy(reference, second.prompt, GREEDY.max_tokens)


def test_preempted_request_resumes_with_the_same_tokens(tiny: tuple[Path, Any]) -> None:
    path, reference = tiny
    runner = tiny_runner(path)
    driver = PlanDriver(runner)
    request = driver.add("p", PROMPTS[0], GREEDY)
    other = driver.add("q", PROMPTS[2], GREEDY)
    for _ in range(4):
        driver.step()
    driver.preempt("p")
    driver.run()
    resumed = next(r for p in driver.plans[1:] for r in p.new_requests if r.request_id == "p")
    assert len(resumed.token_ids) > len(PROMPTS[0])  # it came back with its outputs
    assert request.output == reference_greedy(reference, PROMPTS[0], GREEDY.max_tokens)
    assert other.output == reference_greedy(reference, PROMPTS[2], GREEDY.max_tokens)


def plan_for(runner_tokens: list[int], scheduled: int, blocks: list[int]) -> StepPlan:
    return StepPlan(
        step_id=0,
        scheduler_id="s",
        new_requests=[
            NewRequestData(
                request_id="a",
                token_ids=runner_tokens,
                num_prompt_tokens=len(runner_tokens),
                block_ids=[blocks],
                num_computed_tokens=0,
                sampling=GREEDY,
            )
        ],
        num_scheduled_tokens={"a": scheduled},
    )


def test_bad_plans_are_plan_errors(tiny: tuple[Path, Any]) -> None:
    path, _ = tiny
    runner = tiny_runner(path)
    with pytest.raises(PlanError, match="tokens known"):
        runner.execute(plan_for([1, 2, 3], scheduled=4, blocks=[0]))
    runner = tiny_runner(path)
    with pytest.raises(PlanError, match="need 2 blocks"):
        runner.execute(plan_for([1, 2, 3, 4, 5], scheduled=5, blocks=[0]))
    runner = tiny_runner(path)
    with pytest.raises(PlanError, match="not in the worker's batch"):
        runner.execute(StepPlan(step_id=0, scheduler_id="s", num_scheduled_tokens={"zz": 1}))
    for bad in (b"", b"\x00" * 6):
        runner = tiny_runner(path)
        plan = plan_for([1, 2], scheduled=2, blocks=[0])
        plan.grammar_request_ids = ["a"]
        plan.grammar_bitmask = bad
        with pytest.raises(PlanError, match="grammar_bitmask"):
            runner.execute(plan)
    runner = tiny_runner(path)
    with pytest.raises(PlanError, match=r"vocab|token"):
        runner.execute(plan_for([1, 9999], scheduled=2, blocks=[0]))  # id outside the vocab
    assert len(runner.batch) == 0


def test_grammar_bitmask_constrains_only_its_request(tiny: tuple[Path, Any]) -> None:
    path, reference = tiny
    runner = tiny_runner(path)
    free = reference_greedy(reference, PROMPTS[0], 1)[0]
    forced = (free + 7) % 512
    words = np.zeros((1, 512 // 32), dtype="<i4")
    words[0, forced // 32] = np.int32(np.uint32(1 << (forced % 32)).view(np.int32))
    plan = StepPlan(
        step_id=0,
        scheduler_id="s",
        new_requests=[
            NewRequestData(
                request_id=rid,
                token_ids=PROMPTS[0],
                num_prompt_tokens=len(PROMPTS[0]),
                block_ids=[blocks],
                num_computed_tokens=0,
                sampling=GREEDY,
            )
            for rid, blocks in (("free", [0, 1, 2]), ("constrained", [3, 4, 5]))
        ],
        num_scheduled_tokens={"free": len(PROMPTS[0]), "constrained": len(PROMPTS[0])},
        grammar_request_ids=["constrained"],
        grammar_bitmask=words.tobytes(),
    )
    result = runner.execute(plan)
    tokens = {s.request_id: s.token_ids for s in result.sampled}
    assert tokens == {"free": [free], "constrained": [forced]}


def test_partial_prefill_samples_nothing_and_advances(tiny: tuple[Path, Any]) -> None:
    path, _ = tiny
    runner = tiny_runner(path)
    result = runner.execute(plan_for([1, 2, 3, 4, 5, 6], scheduled=4, blocks=[0, 1]))
    assert result.sampled == []
    assert runner.batch.num_computed_tokens[runner.batch.row_of("a")] == 4
    follow = StepPlan(
        step_id=1,
        scheduler_id="s",
        cached_requests=[
            CachedRequestData(request_id="a", new_block_ids=[[]], num_computed_tokens=4)
        ],
        num_scheduled_tokens={"a": 2},
    )
    result = runner.execute(follow)
    assert [s.request_id for s in result.sampled] == ["a"]
    assert decode(encode(result), StepResult) == result  # built without validation, still valid
    assert len(runner.batch.tokens_of("a")) == 7
    assert result.step_id == 1 and result.execute_ms > 0
    empty = runner.execute(StepPlan(step_id=2, scheduler_id="s", finished_request_ids=["a"]))
    assert empty.sampled == [] and "a" not in runner.batch


def test_profile_run_and_warmup(tiny: tuple[Path, Any]) -> None:
    path, _ = tiny
    runner = tiny_runner(path)
    assert runner.profile_run(num_tokens=40, num_decodes=3) > 0
    assert runner.warmup() > 0
    assert len(runner.batch) == 0  # no request state left behind


def test_bfloat16_runs_close_to_float32(tiny: tuple[Path, Any]) -> None:
    path, _ = tiny
    outputs = {}
    for dtype in (torch.float32, torch.bfloat16):
        runner = tiny_runner(path, dtype=dtype)
        capture = LogitsCapture(runner)
        driver = PlanDriver(runner)
        driver.add("a", PROMPTS[2], GREEDY)
        driver.step()
        outputs[dtype] = capture.calls[0].float()
        assert runner.kv_cache.layers[0].dtype == dtype
    diff = (outputs[torch.float32] - outputs[torch.bfloat16]).abs().max().item()
    assert diff < 0.1, diff
    assert np.isfinite(diff)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ),
    ],
)
def test_runner_on_device_matches_transformers(tiny: tuple[Path, Any], device: str) -> None:
    """The same code path on each device: batched, chunked, prefix hit; tokens equal the CPU
    transformers reference."""
    path, reference = tiny
    runner = tiny_runner(path, device=device)
    assert runner.kv_cache.layers[0].device.type == device
    driver = PlanDriver(runner, chunk_size=5, token_budget=12, prefix_caching=True)
    for i, prompt in enumerate(PROMPTS):
        driver.add(f"r{i}", prompt, GREEDY)
        driver.step()
    driver.run()
    driver.add("hit", [*PROMPTS[2][:13], 300], GREEDY)  # blocks of r2's prompt are cached
    outputs = driver.run()
    assert driver.requests["hit"].num_cached_prompt_tokens == 12
    for i, prompt in enumerate(PROMPTS):
        assert outputs[f"r{i}"] == reference_greedy(reference, prompt, GREEDY.max_tokens)
    hit_prompt = driver.requests["hit"].prompt
    assert outputs["hit"] == reference_greedy(reference, hit_prompt, GREEDY.max_tokens)


def test_logprobs_are_the_models_log_softmax(tiny: tuple[Path, Any]) -> None:
    path, reference = tiny
    runner = tiny_runner(path)
    driver = PlanDriver(runner)
    with_top = driver.add(
        "top", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=3, logprobs=3)
    )
    chosen_only = driver.add(
        "chosen", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=3, logprobs=0)
    )
    plain = driver.add("plain", PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=3))
    driver.run()
    entries = {rid: [] for rid in ("top", "chosen", "plain")}
    for result in driver.results:
        assert decode(encode(result), StepResult) == result
        for sampled in result.sampled:
            entries[sampled.request_id].append(sampled)
    expected = torch.log_softmax(reference_logits(reference, with_top.tokens), dim=-1)
    start = len(with_top.prompt) - 1
    for i, entry in enumerate(entries["top"]):
        row = expected[start + i]
        assert entry.logprobs == pytest.approx([row[entry.token_ids[0]].item()], abs=1e-4)
        assert entry.top_token_ids == row.topk(3).indices.tolist()
        assert entry.top_logprobs == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)
    assert all(e.logprobs is not None and e.top_token_ids is None for e in entries["chosen"])
    assert all(e.logprobs is None for e in entries["plain"])
    assert len(chosen_only.output) == len(plain.output) == 3


def test_seeded_sampling_is_independent_of_batch_and_chunking(tiny: tuple[Path, Any]) -> None:
    """The sampler's RNG is keyed by (seed, position): the runner must pass each token's true
    position, whatever the batch composition, row or chunking."""
    path, reference = tiny
    params = SamplingParams(temperature=1.5, seed=1234, max_tokens=10)

    def run(chunk_size: int, companions: int) -> list[int]:
        driver = PlanDriver(tiny_runner(path), chunk_size=chunk_size)
        for i in range(companions):
            driver.add(f"c{i}", PROMPTS[i % 3], SamplingParams(temperature=1.0, seed=i))
        target = driver.add("t", PROMPTS[2], params)
        driver.run()
        return target.output

    alone = run(chunk_size=0, companions=0)
    # the first token is the draw at position len(prompt) (the tokens before it)
    state = SamplingState(4, 512)
    state.add_request(2, params, PROMPTS[2], [])
    logits = reference_logits(reference, PROMPTS[2])[-1:]
    first = state.sample(logits, torch.tensor([2]), torch.tensor([len(PROMPTS[2])]))
    assert alone[0] == int(first.token_ids[0])
    assert run(chunk_size=0, companions=3) == alone
    assert run(chunk_size=3, companions=2) == alone
    other_seed = PlanDriver(tiny_runner(path))
    other = other_seed.add("t", PROMPTS[2], params.model_copy(update={"seed": 99}))
    other_seed.run()
    assert other.output != alone  # the seed really drives the draw
