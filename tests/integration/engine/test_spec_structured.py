"""Structured outputs with drafts of every method (SmolLM2, scheduler core + model runner).

Drafts of a constrained request are validated by its grammar from the constraint start, each
draft gets its own bitmask row plus the bonus row, and only accepted tokens advance the grammar
(services/scheduler/structured_output). Greedy output with speculation must equal greedy output
without it, token for token, for n-gram, draft-model, EAGLE, EAGLE-3 and MTP drafts: with a
JSON-schema constraint batched with a free request, and with a reasoning-end marker (the
grammar starts after it; with n-gram drafts the marker falls inside a draft window).
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
from tests.support.spec_heads import (
    write_dflash_draft,
    write_eagle3_head,
    write_eagle_head,
    write_mtp_target,
)
from tests.support.tiny_llama import make_tiny_llama

pytestmark = pytest.mark.timeout(1800)

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "rank": {"type": "integer"}},
    "required": ["city", "rank"],
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
NGRAM = SpeculativeConfig(method="ngram", num_spec_tokens=4, prompt_lookup_min=1)
METHODS = ["ngram", "draft", "eagle", "eagle3", "mtp", "dflash"]
ANSWER = '{"city": "Paris", "rank": 3}'
FREE = "Repeat exactly: the cat sat on the warm mat next to the door."


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


@pytest.fixture(scope="module")
def drafters(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Per method: (its SpeculativeConfig, the target's (model, config) to serve). The model
    drafters are random (a tiny draft model with SmolLM2's vocabulary) or near-identity heads,
    saved as checkpoints in their users' formats (tests/support/spec_heads.py)."""
    root = tmp_path_factory.mktemp("structured_drafters")
    make_tiny_llama(root / "draft", seed=1, num_hidden_layers=1, vocab_size=49152)
    write_eagle_head(smollm2_dir, root / "eagle", identity=True)
    write_eagle3_head(smollm2_dir, root / "eagle3", identity=True)
    mtp = write_mtp_target(smollm2_dir, root / "mtp", identity=True)
    write_dflash_draft(smollm2_dir, root / "dflash", block_size=5)
    out: dict[str, Any] = {"ngram": (NGRAM, None)}
    for method in ("draft", "eagle", "eagle3", "dflash"):
        spec = SpeculativeConfig(method=method, model=str(root / method), num_spec_tokens=4)
        out[method] = (spec, None)
    spec = SpeculativeConfig(method="mtp", model=str(mtp), num_spec_tokens=4)
    out["mtp"] = (spec, load_model(mtp, torch.float32, "cpu"))
    return out


@pytest.fixture(scope="module")
def plain_json(
    smollm2_dir: Path, model_and_config: Any, tokenizer: Any, grammar: Any
) -> dict[str, list[int]]:
    run = Run(smollm2_dir, model_and_config, None)
    run.submit("json", chat(tokenizer, f"Reply with this JSON exactly: {ANSWER}"), grammar)
    run.submit("free", chat(tokenizer, FREE))
    return run.outputs()


@pytest.mark.parametrize("method", METHODS)
def test_json_schema_with_drafts_equals_without(
    smollm2_dir: Path,
    model_and_config: Any,
    tokenizer: Any,
    grammar: Any,
    drafters: dict[str, Any],
    plain_json: dict[str, list[int]],
    method: str,
) -> None:
    spec, served = drafters[method]
    run = Run(smollm2_dir, served or model_and_config, spec)
    run.submit("json", chat(tokenizer, f"Reply with this JSON exactly: {ANSWER}"), grammar)
    run.submit("free", chat(tokenizer, FREE))
    spec_out = run.outputs()
    assert spec_out == plain_json
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert spec_out["json"][-1] == eos
    jsonschema.validate(json.loads(tokenizer.decode(spec_out["json"][:-1])), SCHEMA)
    assert run.engine.scheduler.spec.stats.num_draft_tokens > 0
    if method == "ngram":  # copying drafts: the constrained request verified and accepted some
        assert run.windows.get("json"), "the constrained request verified no drafts"
        assert run.engine.scheduler.spec.stats.num_accepted_tokens > 0


@pytest.fixture(scope="module")
def reasoning_case(
    smollm2_dir: Path, model_and_config: Any, tokenizer: Any, grammar: Any
) -> tuple[ReasoningConfig, list[int], list[int], list[int]]:
    """(the reasoning config, its end marker, the prompt, the output without speculation)."""
    marker = tokenizer.encode(" nice.", add_special_tokens=False)  # two tokens
    assert len(marker) == 2
    reasoning = ReasoningConfig(
        end_token_ids=tuple(marker),
        start_token_ids=(tokenizer.convert_tokens_to_ids("<|im_start|>"),),
    )
    prompt = chat(tokenizer, f"Repeat exactly: The city is nice. {ANSWER}")
    run = Run(smollm2_dir, model_and_config, None, reasoning)
    run.submit("r", prompt, grammar)
    return reasoning, marker, prompt, run.outputs()["r"]


@pytest.mark.parametrize("method", METHODS)
def test_reasoning_marker_with_drafts(
    smollm2_dir: Path,
    model_and_config: Any,
    tokenizer: Any,
    grammar: Any,
    drafters: dict[str, Any],
    reasoning_case: tuple[ReasoningConfig, list[int], list[int], list[int]],
    method: str,
) -> None:
    reasoning, marker, prompt, plain = reasoning_case
    spec, served = drafters[method]
    run = Run(smollm2_dir, served or model_and_config, spec, reasoning)
    run.submit("r", prompt, grammar)
    tokens = run.outputs()["r"]
    assert tokens == plain
    assert run.engine.scheduler.spec.stats.num_draft_tokens > 0
    if method == "ngram":
        # The marker ended inside some verified draft window (not only in the bonus token).
        assert any(
            constraint_start(drafts, history=history, marker=marker, reasoning_in_play=True)
            <= len(drafts)
            for history, drafts in run.windows["r"]
        )
    # Free text up to the marker, then the grammar's JSON.
    text = tokenizer.decode(tokens[:-1])
    assert text.startswith("The city is nice.")
    jsonschema.validate(json.loads(text.split(" nice.", 1)[1]), SCHEMA)
