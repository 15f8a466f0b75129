"""Structured outputs through the scheduler core and the real model runner (SmolLM2, CPU).

Grammars are compiled exactly as the grammar service does (same job, same options, the served
tokenizer), then the scheduler fills bitmask rows each step and the worker applies them before
sampling. A constrained request must come out in its grammar and stop when the grammar ends;
an unconstrained request in the same batch must be untouched by its neighbours' masks.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from services.grammar.compiler_process import compile_grammar
from services.grammar.grammar_spec import compile_job
from services.grammar.tokenizer_identity import load_tokenizer_identity
from shared.protocol import GrammarRef, SamplingParams, SubmitRequest
from tests.support.engine import InProcessEngine

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]},
        "rank": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "rank"],
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=40)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def compiler(smollm2_dir: Path) -> Any:
    import xgrammar as xgr

    identity = load_tokenizer_identity(smollm2_dir)
    info = xgr.TokenizerInfo.deserialize_json(identity.info_json)
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


@pytest.fixture(scope="module")
def engine(smollm2_dir: Path) -> InProcessEngine:
    return InProcessEngine(smollm2_dir, num_blocks=128)


def chat(tokenizer: Any, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def submit(
    engine: InProcessEngine,
    compiler: Any,
    rid: str,
    prompt: list[int],
    kind: str = "",
    spec: str = "",
) -> None:
    grammar = None
    ref = None
    if kind:
        ref = GrammarRef(kind=kind, spec=spec, key=rid)  # type: ignore[arg-type]
        grammar = compile_grammar(compiler, compile_job(kind, spec))
    msg = SubmitRequest(
        request_id=rid, prompt_token_ids=prompt, sampling=GREEDY, reply_stream="r", grammar=ref
    )
    assert engine.scheduler.add_request(msg, grammar) is None


def test_constrained_and_free_requests_in_one_batch(
    engine: InProcessEngine, compiler: Any, tokenizer: Any
) -> None:
    question = chat(tokenizer, "Name a French city and give it a rank from 1 to 9, as JSON.")
    free_prompt = chat(tokenizer, "What is the capital of France?")
    submit(engine, compiler, "free-alone", free_prompt)
    alone = engine.run()["free-alone"]

    submit(engine, compiler, "json", question, "json_schema", json.dumps(SCHEMA))
    submit(engine, compiler, "choice", question, "choice", json.dumps(["yes", "no", "maybe"]))
    submit(engine, compiler, "regex", question, "regex", r"[A-Z][a-z]{2,8}, [0-9]{2}")
    submit(engine, compiler, "free", free_prompt)
    out = engine.run()

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for rid in ("json", "choice", "regex"):
        assert out[rid].finish_reason == "stop", (rid, tokenizer.decode(out[rid].token_ids))
        assert out[rid].token_ids[-1] == eos  # the grammar ended on the model's stop token
    text = {rid: tokenizer.decode(out[rid].token_ids[:-1]) for rid in ("json", "choice", "regex")}
    jsonschema.validate(json.loads(text["json"]), SCHEMA)
    assert text["choice"] in {"yes", "no", "maybe"}
    assert re.fullmatch(r"[A-Z][a-z]{2,8}, [0-9]{2}", text["regex"]), text["regex"]
    assert out["free"].token_ids == alone.token_ids  # neighbours' masks never leak
