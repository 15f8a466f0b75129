"""A structured-output request resumed from its checkpoint: the real xgrammar matcher is
replayed over the generated tokens, so the next row allows what the grammar allows there; a
checkpoint the grammar rejects means a start from the prompt with a fresh matcher."""

from __future__ import annotations

from typing import Any

from shared.protocol import ProgressCheckpoint
from tests.unit.scheduler.structured_output.conftest import (
    COLON,
    EOS,
    HMM,
    KEY,
    LB,
    ONE,
    RB,
    TWO,
    X,
)
from tests.unit.scheduler.structured_output.test_scheduler_hooks import (
    ScriptedRun,
    scheduler,
    submit,
)


def checkpoint(tokens: list[int]) -> ProgressCheckpoint:
    return ProgressCheckpoint(request_id="g", num_prompt_tokens=2, output_token_ids=tokens)


def test_the_grammar_is_replayed_over_the_generated_tokens(compiled: Any) -> None:
    core = scheduler(vocab_size=13)
    assert core.add_request(submit("g", [HMM, HMM]), compiled, checkpoint([LB, KEY, COLON])) is None
    run = ScriptedRun(core, {"g": [TWO, ONE, RB, EOS]})
    run.run()
    assert run.outputs["g"] == [TWO, ONE, RB, EOS]  # deltas from output index 3 on
    assert [r["g"] for r in run.rows] == [{ONE, TWO}, {ONE, TWO, RB}, {ONE, TWO, RB}, {EOS}]
    assert (run.finals["g"].finish_reason, run.finals["g"].stop_token_id) == ("stop", EOS)


def test_a_checkpoint_the_grammar_rejects_starts_over_with_a_fresh_matcher(
    compiled: Any,
) -> None:
    core = scheduler(vocab_size=13)
    core.add_request(submit("g", [HMM, HMM]), compiled, checkpoint([LB, X]))
    request = core.get_request("g")
    assert request is not None and request.num_output_tokens == 0
    script = [LB, KEY, COLON, ONE, RB, EOS]
    run = ScriptedRun(core, {"g": list(script)})
    run.run()
    assert run.outputs["g"] == script and run.rows[0]["g"] == {LB}


def test_a_checkpoint_that_terminates_the_grammar_is_void(compiled: Any) -> None:
    core = scheduler(vocab_size=13)
    msg = submit("g", [HMM, HMM])
    msg.sampling.ignore_eos = True  # so the grammar, not the eos check, ends it
    core.add_request(msg, compiled, checkpoint([LB, KEY, COLON, ONE, RB, EOS]))
    request = core.get_request("g")
    assert request is not None and request.num_output_tokens == 0
