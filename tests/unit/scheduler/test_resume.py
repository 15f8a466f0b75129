"""A request taken over after a fault continues from its progress checkpoint: prompt +
generated tokens prefilled in one go, sampling at output index k, max_tokens counted from the
start, the same outputs as the run without the fault; a checkpoint that does not fit means a
start from the prompt."""

from __future__ import annotations

import pytest

from services.scheduler.config import SchedulerConfig
from services.scheduler.scheduler import Scheduler
from shared.protocol import ProgressCheckpoint, SubmitRequest
from tests.unit.scheduler.driver import Driver, submit
from tests.unit.scheduler.worker_double import VOCAB, WorkerDouble

PROMPT = [3, 4, 5, 6, 7, 8]
EOS = 2


def make() -> Driver:
    config = SchedulerConfig(
        block_size=4, num_gpu_blocks=64, max_model_len=64, vocab_size=VOCAB, eos_token_ids=[EOS]
    )
    return Driver(Scheduler(config, "s"), WorkerDouble(block_size=4))


def checkpoint_of(msg: SubmitRequest, tokens: list[int], **fields: object) -> ProgressCheckpoint:
    values: dict[str, object] = {
        "request_id": msg.request_id,
        "num_prompt_tokens": len(msg.prompt_token_ids),
        "output_token_ids": tokens,
    }
    values.update(fields)
    return ProgressCheckpoint(**values)  # type: ignore[arg-type]


def no_fault(msg: SubmitRequest) -> list[int]:
    d = make()
    assert d.scheduler.add_request(msg) is None
    d.run()
    return d.client.outputs[msg.request_id]


@pytest.mark.parametrize("k", [1, 5, 11])
def test_a_resumed_request_ends_with_the_outputs_of_the_run_without_the_fault(k: int) -> None:
    msg = submit("a", PROMPT, max_tokens=12)
    expected = no_fault(msg)
    assert len(expected) == 12
    d = make()  # another group's core
    d.client.outputs["a"] = list(expected[:k])  # what the client already has
    assert d.scheduler.add_request(msg, checkpoint=checkpoint_of(msg, expected[:k])) is None
    request = d.scheduler.get_request("a")
    assert request is not None and request.num_output_tokens == k
    first = d.step()
    assert first is not None
    (new,) = first.new_requests  # prompt + generated tokens, prefilled in one go
    assert list(new.token_ids) == PROMPT + expected[:k]
    assert new.num_prompt_tokens == len(PROMPT)
    assert first.num_scheduled_tokens["a"] == len(PROMPT) + k
    d.run()  # ClientView: each delta starts where the client's tokens end (no gap, no repeat)
    assert d.client.outputs["a"] == expected
    assert d.client.finish["a"] == "length"  # max_tokens counted from output index 0
    assert d.client.first["a"].start_index == k
    assert d.client.first["a"].num_prompt_tokens == 0  # the first delta went out before
    assert d.worker.steps == 12 - k  # one prefill + the decode steps left


def test_the_resumed_prefill_hits_the_prefix_cache() -> None:
    """The group taking the request over already caches its prompt (another request shared
    it): only the rest of prompt + generated tokens is computed."""
    msg = submit("a", [*PROMPT, 9, 10], max_tokens=12)
    expected = no_fault(msg)
    d = make()
    d.scheduler.add_request(submit("warm", [*PROMPT, 9, 10], max_tokens=1))
    d.run()
    d.client.outputs["a"] = list(expected[:6])
    d.scheduler.add_request(msg, checkpoint=checkpoint_of(msg, expected[:6]))
    first = d.step()
    assert first is not None and first.new_requests[0].num_computed_tokens == 8
    d.run()
    assert d.client.outputs["a"] == expected


VOID = {
    "another request": {"request_id": "b"},
    "another prompt": {"num_prompt_tokens": 3},
    "past the vocabulary": {"output_token_ids": [11, VOCAB]},
    "reaches max_tokens": {"output_token_ids": list(range(20, 32))},
    "finished on eos": {"output_token_ids": [11, EOS]},
    "empty": {"output_token_ids": []},
}


@pytest.mark.parametrize("fields", VOID.values(), ids=list(VOID))
def test_a_checkpoint_that_does_not_fit_means_a_start_from_the_prompt(
    fields: dict[str, object],
) -> None:
    msg = submit("a", PROMPT, max_tokens=12)
    expected = no_fault(msg)
    d = make()
    assert d.scheduler.add_request(msg, checkpoint=checkpoint_of(msg, [11, 12], **fields)) is None
    request = d.scheduler.get_request("a")
    assert request is not None and request.num_output_tokens == 0
    d.run()
    assert d.client.outputs["a"] == expected and d.client.first["a"].start_index == 0


def test_routed_expert_requests_start_from_the_prompt() -> None:
    msg = submit("a", PROMPT, max_tokens=12)
    msg.return_routed_experts = True
    d = make()
    d.scheduler.add_request(msg, checkpoint=checkpoint_of(msg, [11, 12]))
    request = d.scheduler.get_request("a")
    assert request is not None and request.num_output_tokens == 0
