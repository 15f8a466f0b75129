"""The scheduler core with grammars: bitmask rows in plans, grammar advance on results.

The "worker" here is scripted: each request emits its script's tokens one per sampling step,
whatever the mask says, so a test can check both what the plan's row allows and what the
scheduler does with a token the grammar rejects. The grammar is real xgrammar (conftest).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from services.scheduler.config import SchedulerConfig
from services.scheduler.scheduler import Scheduler
from services.scheduler.structured_output import ReasoningConfig
from shared.protocol import (
    GrammarRef,
    RequestDelta,
    SampledTokens,
    SamplingParams,
    StepPlan,
    StepResult,
    SubmitRequest,
)
from tests.unit.scheduler.structured_output.conftest import (
    ALL,
    COLON,
    END,
    EOS,
    HMM,
    KEY,
    LB,
    ONE,
    RB,
    THINK,
    TWO,
    X,
)

GRAMMAR_REF = GrammarRef(kind="grammar", spec="(compiled in the fixture)", key="k")


def scheduler(**overrides: Any) -> Scheduler:
    options: dict[str, Any] = {"num_gpu_blocks": 64, "block_size": 4, "eos_token_ids": [EOS]}
    options.update(overrides)
    return Scheduler(SchedulerConfig(**options), "sched")


def submit(
    rid: str, prompt: list[int], grammar: bool = True, max_tokens: int = 16
) -> SubmitRequest:
    return SubmitRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=max_tokens),
        reply_stream="replies",
        grammar=GRAMMAR_REF if grammar else None,
    )


def rows_of(plan: StepPlan) -> dict[str, frozenset[int]]:
    if not plan.grammar_request_ids:
        assert plan.grammar_bitmask == b""
        return {}
    words = np.frombuffer(plan.grammar_bitmask, dtype="<i4").reshape(
        len(plan.grammar_request_ids), -1
    )
    return {
        rid: frozenset(b for b in range(32) if (int(words[i, 0]) & 0xFFFFFFFF) >> b & 1)
        for i, rid in enumerate(plan.grammar_request_ids)
    }


class ScriptedRun:
    def __init__(self, core: Scheduler, scripts: dict[str, list[int]]) -> None:
        self.core = core
        self.scripts = {rid: list(tokens) for rid, tokens in scripts.items()}
        self.rows: list[dict[str, frozenset[int]]] = []
        self.outputs: dict[str, list[int]] = {rid: [] for rid in scripts}
        self.finals: dict[str, RequestDelta] = {}

    def step(self) -> StepPlan | None:
        plan = self.core.schedule()
        if plan is None:
            return None
        self.rows.append(rows_of(plan))
        sampled = []
        for rid in plan.num_scheduled_tokens:
            request = self.core.requests[rid]
            if request.num_computed_tokens >= request.num_tokens:
                sampled.append(SampledTokens(request_id=rid, token_ids=[self.scripts[rid].pop(0)]))
        out = self.core.update_from_output(
            plan, StepResult(step_id=plan.step_id, worker_id="w", sampled=sampled)
        )
        for delta in (d for deltas in out.deltas.values() for d in deltas):
            self.outputs[delta.request_id].extend(delta.token_ids)
            if delta.finish_reason is not None:
                self.finals[delta.request_id] = delta
        return plan

    def run(self) -> None:
        while self.step() is not None:
            pass
        assert not self.core.has_work()


def test_a_constrained_request_gets_rows_and_stops_when_the_grammar_terminates(
    compiled: Any,
) -> None:
    core = scheduler()
    assert core.add_request(submit("g", [HMM, HMM]), compiled) is None
    assert core.add_request(submit("free", [HMM], grammar=False, max_tokens=3)) is None
    script = [LB, KEY, COLON, TWO, ONE, RB, EOS]
    run = ScriptedRun(core, {"g": script, "free": [X, X, X]})
    run.run()
    assert run.outputs["g"] == script
    assert (run.finals["g"].finish_reason, run.finals["g"].stop_token_id) == ("stop", EOS)
    assert run.outputs["free"] == [X, X, X] and run.finals["free"].finish_reason == "length"
    expected = [{LB}, {KEY}, {COLON}, {ONE, TWO}, {ONE, TWO, RB}, {ONE, TWO, RB}, {EOS}]
    assert [r["g"] for r in run.rows] == expected
    assert all("free" not in r for r in run.rows)  # unconstrained: never listed
    assert len(core.structured) == 0  # released with the request


def test_ignore_eos_does_not_keep_a_terminated_grammar_running(compiled: Any) -> None:
    core = scheduler()
    msg = submit("g", [HMM])
    msg.sampling.ignore_eos = True
    core.add_request(msg, compiled)
    run = ScriptedRun(core, {"g": [LB, KEY, COLON, ONE, RB, EOS, X]})
    run.run()
    assert run.outputs["g"] == [LB, KEY, COLON, ONE, RB, EOS]
    assert run.finals["g"].finish_reason == "stop"


def test_a_token_the_grammar_rejects_ends_the_request_with_an_error(compiled: Any) -> None:
    core = scheduler()
    core.add_request(submit("g", [HMM]), compiled)
    core.add_request(submit("free", [HMM], grammar=False, max_tokens=4), None)
    run = ScriptedRun(core, {"g": [LB, X, KEY], "free": [HMM] * 4})
    run.run()  # no exception: the engine keeps going
    final = run.finals["g"]
    assert final.finish_reason == "error" and final.error is not None and str(X) in final.error
    assert final.error_type is None  # the grammar allowed tokens: the engine's fault, a 500
    assert run.outputs["g"] == [LB]  # the rejected token is dropped
    assert run.outputs["free"] == [HMM] * 4


def test_a_grammar_no_token_can_continue_is_the_requests_fault() -> None:
    """After "{" this grammar needs "b", which no token of the vocabulary spells: the mask
    allows nothing, whatever is sampled is rejected, and the error is an invalid request
    (the gateway's 400), not an engine failure."""
    import xgrammar as xgr

    from tests.unit.scheduler.structured_output.conftest import VOCAB

    info = xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, stop_token_ids=[EOS])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    unspellable = compiler.compile_grammar('root ::= "{" "b"')
    core = scheduler()
    core.add_request(submit("g", [HMM]), unspellable)
    run = ScriptedRun(core, {"g": [LB, EOS, X]})
    run.run()
    final = run.finals["g"]
    assert run.rows[1]["g"] == frozenset()  # after "{": nothing allowed
    assert final.finish_reason == "error" and final.error_type == "invalid_request_error"
    assert final.error is not None and "cannot be completed" in final.error
    assert run.outputs["g"] == [LB]


def test_no_row_while_a_prompt_is_prefilled_in_chunks(compiled: Any) -> None:
    core = scheduler(max_num_batched_tokens=4)
    core.add_request(submit("g", [HMM] * 10), compiled)
    run = ScriptedRun(core, {"g": [LB, KEY, COLON, ONE, RB, EOS]})
    for _ in range(2):  # 4 + 4 of the 10 prompt tokens: nothing sampled, no row
        run.step()
    assert run.rows == [{}, {}]
    run.run()
    assert run.rows[2] == {"g": frozenset({LB})}
    assert run.finals["g"].finish_reason == "stop"


def test_reasoning_is_free_until_the_marker_then_constrained(compiled: Any) -> None:
    core = scheduler(reasoning=ReasoningConfig(end_token_ids=(END,)))
    core.add_request(submit("g", [THINK]), compiled)
    script = [HMM, X, END, LB, KEY, COLON, ONE, RB, EOS]
    run = ScriptedRun(core, {"g": script})
    run.run()
    assert run.outputs["g"] == script
    assert run.finals["g"].finish_reason == "stop"
    # Steps sampling HMM, X and END send no row (nothing restricted); then the grammar.
    assert [r.get("g", ALL) for r in run.rows[:4]] == [ALL, ALL, ALL, frozenset({LB})]


def test_a_grammar_request_without_its_grammar_is_refused(compiled: Any) -> None:
    delta = scheduler().add_request(submit("g", [HMM]), None)
    assert delta is not None and delta.finish_reason == "error"
    assert delta.error is not None and "grammar" in delta.error


@pytest.mark.parametrize("restart_after", [2, 4])
def test_a_worker_restart_keeps_the_grammar_in_step_with_the_outputs(
    compiled: Any, restart_after: int
) -> None:
    script = [LB, KEY, COLON, ONE, TWO, RB, EOS]
    plain = scheduler()
    plain.add_request(submit("g", [HMM, HMM]), compiled)
    reference = ScriptedRun(plain, {"g": script})
    reference.run()

    core = scheduler()
    core.add_request(submit("g", [HMM, HMM]), compiled)
    run = ScriptedRun(core, {"g": script})
    for _ in range(restart_after):
        run.step()
    core.reset_worker_state("w1")  # recompute from prompt + outputs, sent again as new
    run.run()
    assert run.outputs["g"] == script and run.finals["g"].finish_reason == "stop"
    assert [r["g"] for r in run.rows] == [r["g"] for r in reference.rows]


def test_with_drafts_on_the_worker_a_grammar_request_keeps_its_drafts_in_the_plan(
    compiled: Any,
) -> None:
    """Drafts on the worker (asynchronous scheduling): a constrained request's drafts still
    come back in its result and go out in the next plan, trimmed by its grammar, with a
    bitmask row each; an unconstrained one in the same step gets lookahead slots instead, and
    no plan goes out ahead while a grammar request runs."""
    core = scheduler(num_spec_tokens=3, spec_drafts_on_worker=True)
    core.add_request(submit("g", [HMM]), compiled)
    core.add_request(submit("free", [HMM], grammar=False), None)
    prefill = core.schedule()
    assert prefill is not None and not core.can_pipeline()
    sampled = [
        SampledTokens(request_id="g", token_ids=[LB], draft_token_ids=[KEY, COLON, X]),
        SampledTokens(request_id="free", token_ids=[X], draft_token_ids=[X, X]),
    ]
    core.update_from_output(
        prefill, StepResult(step_id=prefill.step_id, worker_id="w", sampled=sampled)
    )
    plan = core.schedule()
    assert plan is not None
    assert plan.spec_token_ids == {"g": [KEY, COLON]}  # X is cut: the grammar rejects it
    assert plan.spec_lookahead == {"free": 3}
    assert plan.num_scheduled_tokens == {"g": 3, "free": 4}
    assert [r for r in rows_of(plan)] == ["g"]
    assert len(plan.grammar_bitmask) // 4 == 3  # one row per draft, then the bonus row


def test_a_constrained_request_is_not_planned_past_its_token_in_flight(compiled: Any) -> None:
    """Plans go out ahead for free requests (async scheduling); a constrained request that
    arrives meanwhile may have its prefill planned with them, but its next row needs the token
    that prefill samples: no plan carries it again until that result is in. (Planned on with a
    row from the state before its first token, it was allowed that token again, sampled it,
    and failed with "the model produced token N, which the grammar does not allow".)"""
    core = scheduler()
    core.add_request(submit("free", [HMM], grammar=False, max_tokens=8))
    first = core.schedule()
    core.add_request(submit("g", [HMM, HMM]), compiled)
    second = core.schedule()
    third = core.schedule()
    assert first is not None and second is not None and third is not None
    assert rows_of(second) == {"g": frozenset({LB})}
    assert "g" not in third.num_scheduled_tokens and rows_of(third) == {}
    for plan, sampled in (
        (first, {"free": X}),
        (second, {"free": X, "g": LB}),
        (third, {"free": X}),
    ):
        tokens = [SampledTokens(request_id=rid, token_ids=[t]) for rid, t in sampled.items()]
        core.update_from_output(
            plan, StepResult(step_id=plan.step_id, worker_id="w", sampled=tokens)
        )
    fourth = core.schedule()
    assert fourth is not None and rows_of(fourth)["g"] == frozenset({KEY})
