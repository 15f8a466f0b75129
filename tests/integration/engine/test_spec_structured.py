"""Structured outputs with n-gram drafts (SmolLM2, scheduler core + model runner).

Drafts of a constrained request are validated by its grammar from the constraint start, each
draft gets its own bitmask row plus the bonus row, and only accepted tokens advance the grammar
(services/scheduler/structured_output). Greedy output with speculation must equal greedy output
without it, token for token: with a JSON-schema constraint batched with a free request, and
with a reasoning-end marker that falls inside a draft window (the grammar starts after it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from services.grammar.compiler_process import compile_grammar
from services.grammar.grammar_spec import compile_job
from services.grammar.tokenizer_identity import load_tokenizer_identity
from services.scheduler.structured_output import ReasoningConfig, constraint_start
from services.worker.loader import load_model
from services.worker.spec import SpeculativeConfig
from shared.protocol import GrammarRef, SamplingParams, StepPlan, SubmitRequest
from tests.support.engine import InProcessEngine

pytestmark = pytest.mark.timeout(900)

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "rank": {"type": "integer"}},
    "required": ["city", "rank"],
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
NGRAM = SpeculativeConfig(method="ngram", num_spec_tokens=4, prompt_lookup_min=1)
ANSWER = '{"city": "Paris", "rank": 3}'


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def grammar(smollm2_dir: Path) -> Any:
    import xgrammar as xgr

    identity = load_tokenizer_identity(smollm2_dir)
    info = xgr.TokenizerInfo.deserialize_json(identity.info_json)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    return compile_grammar(compiler, compile_job("json_schema", json.dumps(SCHEMA)))


@pytest.fixture(scope="module")
def model_and_config(smollm2_dir: Path) -> Any:
    return load_model(smollm2_dir, torch.float32, "cpu")


def chat(tokenizer: Any, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


class Run:
    """One engine run; records, for every plan that verifies drafts, each request's verified
    tokens and its drafts (read from the worker's batch before the step runs)."""

    def __init__(
        self,
        smollm2_dir: Path,
        model_and_config: Any,
        spec: SpeculativeConfig | None,
        reasoning: ReasoningConfig | None = None,
    ) -> None:
        options = {"reasoning": reasoning} if reasoning else None
        self.engine = InProcessEngine(
            smollm2_dir,
            model_and_config=model_and_config,
            speculative=spec,
            scheduler_options=options,
        )
        self.windows: dict[str, list[tuple[list[int], list[int]]]] = {}
        runner = self.engine.runner
        execute = runner.execute

        def recording(plan: StepPlan) -> Any:
            for rid, drafts in plan.spec_token_ids.items():
                self.windows.setdefault(rid, []).append((runner.batch.tokens_of(rid), drafts))
            return execute(plan)

        runner.execute = recording  # type: ignore[method-assign]

    def submit(self, rid: str, prompt: list[int], grammar: Any = None) -> None:
        ref = GrammarRef(kind="json_schema", spec=json.dumps(SCHEMA), key=rid) if grammar else None
        msg = SubmitRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=GREEDY, reply_stream="r", grammar=ref
        )
        assert self.engine.scheduler.add_request(msg, grammar) is None

    def outputs(self) -> dict[str, list[int]]:
        return {rid: gen.token_ids for rid, gen in self.engine.run().items()}


def test_json_schema_with_drafts_equals_without(
    smollm2_dir: Path, model_and_config: Any, tokenizer: Any, grammar: Any
) -> None:
    constrained = chat(tokenizer, f"Reply with this JSON exactly: {ANSWER}")
    free = chat(tokenizer, "Repeat exactly: the cat sat on the warm mat next to the door.")
    outs = []
    for spec in (None, NGRAM):
        run = Run(smollm2_dir, model_and_config, spec)
        run.submit("json", constrained, grammar)
        run.submit("free", free)
        outs.append((run.outputs(), run))
    (plain, _), (spec_out, spec_run) = outs
    assert spec_out == plain
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert spec_out["json"][-1] == eos
    jsonschema.validate(json.loads(tokenizer.decode(spec_out["json"][:-1])), SCHEMA)
    assert spec_run.windows.get("json"), "the constrained request verified no drafts"
    assert spec_run.engine.scheduler.spec.stats.num_accepted_tokens > 0


def test_reasoning_marker_inside_a_draft_window(
    smollm2_dir: Path, model_and_config: Any, tokenizer: Any, grammar: Any
) -> None:
    marker = tokenizer.encode(" nice.", add_special_tokens=False)  # two tokens
    assert len(marker) == 2
    reasoning = ReasoningConfig(
        end_token_ids=tuple(marker),
        start_token_ids=(tokenizer.convert_tokens_to_ids("<|im_start|>"),),
    )
    prompt = chat(tokenizer, f"Repeat exactly: The city is nice. {ANSWER}")
    outs = []
    for spec in (None, NGRAM):
        run = Run(smollm2_dir, model_and_config, spec, reasoning)
        run.submit("r", prompt, grammar)
        outs.append((run.outputs()["r"], run))
    (plain, _), (tokens, spec_run) = outs
    assert tokens == plain
    # The marker ended inside some verified draft window (not only in the bonus token).
    assert any(
        constraint_start(drafts, history=history, marker=marker, reasoning_in_play=True)
        <= len(drafts)
        for history, drafts in spec_run.windows["r"]
    )
    # Free text up to the marker, then the grammar's JSON.
    text = tokenizer.decode(tokens[:-1])
    assert text.startswith("The city is nice.")
    jsonschema.validate(json.loads(text.split(" nice.", 1)[1]), SCHEMA)
