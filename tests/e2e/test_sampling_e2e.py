"""Sampling through the real mesh (gateway + scheduler + worker processes, the openai client).

- Batch invariance: Gumbel-max noise is keyed by (seed, position, token id) only, so a seeded
  request samples the same tokens alone, in a batch of 8 concurrent requests (seeded and
  unseeded, chat and completions), and in another arrival order; the scheduler's step count
  proves the batch really ran together.
- Reproducibility: a fresh mesh (new processes, new Redis) gives the same seeded outputs.
- n > 1: the choices of one request share the prompt's KV blocks (the scheduler's prefix-hit
  counter grows by the prompt's full blocks for every choice but the first) and each choice i
  equals a separate request with seed + i.
- Logprobs: OpenAI-shaped through the openai client, and equal to log_softmax of transformers'
  fp32 logits on prompt + generated tokens.
- An unseeded request's drawn seed is in the gateway's JSON log, and reproduces the output.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from tests.e2e.conftest import E2E_ENV
from tests.support.mesh import Mesh

pytestmark = pytest.mark.e2e

# One torch thread: on a shared machine two OpenMP threads fighting for cores run ~10x slower.
ENV = {**E2E_ENV, "MESHLLM_NUM_THREADS": "1"}
FIXED = {"ignore_eos": True}  # every output runs to max_tokens: lengths known in advance
TOL = 1e-4

TARGET: dict[str, Any] = {
    "kind": "chat",
    "messages": [{"role": "user", "content": "Write a short poem about autumn leaves."}],
    "temperature": 0.9,
    "top_p": 0.95,
    "seed": 4242,
    "max_tokens": 16,
    "logprobs": True,
    "top_logprobs": 2,
}
OTHERS: list[dict[str, Any]] = [
    {"kind": "chat", "messages": [{"role": "user", "content": "Describe a city at night."}],
     "temperature": 0.7, "seed": 1, "max_tokens": 24},
    {"kind": "chat", "messages": [{"role": "user", "content": "Name three colors."}],
     "temperature": 1.0, "max_tokens": 20},
    {"kind": "completion", "prompt": "Once upon a time, a fox", "temperature": 0.9, "seed": 7,
     "max_tokens": 24, "logprobs": 1},
    {"kind": "completion", "prompt": "The weather today is", "temperature": 0.8,
     "max_tokens": 12},
    {"kind": "chat", "messages": [{"role": "user", "content": "What is 2 + 2?"}],
     "temperature": 0.0, "max_tokens": 24},
    {"kind": "completion", "prompt": "def add(a, b):", "temperature": 0.5, "top_k": 20,
     "seed": 3, "max_tokens": 20},
    {"kind": "chat", "messages": [{"role": "user", "content": "Tell me about cats."}],
     "temperature": 1.0, "top_p": 0.9, "max_tokens": 24},
]  # fmt: skip


@dataclass(frozen=True)
class Output:
    text: str
    tokens: tuple[str, ...]  # the logprobs' token texts (empty when not asked for)
    logprobs: tuple[float, ...]


@pytest.fixture(scope="module")
def mesh(smollm2_dir: Path) -> Iterator[Mesh]:
    with Mesh(env=ENV) as m:
        yield m


# --- helpers ---------------------------------------------------------------------------------


EXTRA = ("top_k",)  # vLLM's sampling parameters: the openai client sends them in extra_body


async def _one(client: openai.AsyncOpenAI, model: str, spec: dict[str, Any]) -> Any:
    body = {k: v for k, v in spec.items() if k != "kind" and k not in EXTRA}
    extra = {**FIXED, **{k: v for k, v in spec.items() if k in EXTRA}}
    if spec["kind"] == "chat":
        return await client.chat.completions.create(model=model, extra_body=extra, **body)
    return await client.completions.create(model=model, extra_body=extra, **body)


def _output(resp: Any) -> Output:
    choice = resp.choices[0]
    if hasattr(choice, "message"):
        entries = choice.logprobs.content if choice.logprobs else []
        return Output(
            choice.message.content,
            tuple(e.token for e in entries),
            tuple(e.logprob for e in entries),
        )
    lp = choice.logprobs
    return Output(
        choice.text,
        tuple(lp.tokens) if lp else (),
        tuple(lp.token_logprobs) if lp else (),
    )


def run_all(mesh: Mesh, specs: list[dict[str, Any]]) -> list[Any]:
    """Send every request at once (in list order) and wait for all responses."""

    async def go() -> list[Any]:
        client = openai.AsyncOpenAI(base_url=mesh.api, api_key="x", max_retries=0, timeout=300)
        try:
            model = (await client.models.list()).data[0].id
            return list(await asyncio.gather(*(_one(client, model, s) for s in specs)))
        finally:
            await client.close()

    return asyncio.run(go())


def steps_run(mesh: Mesh) -> int:
    return int(mesh.admin_state("scheduler")["steps_run"])


def assert_same(a: Output, b: Output) -> None:
    assert a.text == b.text
    assert a.tokens == b.tokens
    assert a.logprobs == pytest.approx(b.logprobs, abs=TOL)


# --- batch invariance and reproducibility ----------------------------------------------------


def test_seeded_request_is_batch_and_order_invariant(mesh: Mesh) -> None:
    (alone,) = run_all(mesh, [TARGET])
    alone_out = _output(alone)
    assert len(alone_out.tokens) == TARGET["max_tokens"]

    before = steps_run(mesh)
    first = run_all(mesh, [TARGET, *OTHERS])
    steps_first = steps_run(mesh) - before
    last = run_all(mesh, [*reversed(OTHERS), TARGET])

    assert_same(_output(first[0]), alone_out)
    assert_same(_output(last[-1]), alone_out)
    # Seeded neighbours are batch invariant too.
    assert _output(first[1]).text == _output(last[-2]).text  # OTHERS[0]
    assert_same(_output(first[3]), _output(last[-4]))  # OTHERS[2], with logprobs
    # They really ran together: one request after another would take a step per token.
    total_tokens = sum(s["max_tokens"] for s in [TARGET, *OTHERS])
    assert steps_first < total_tokens / 2, (steps_first, total_tokens)


def test_a_different_seed_gives_a_different_output(mesh: Mesh) -> None:
    a, b = run_all(mesh, [TARGET, {**TARGET, "seed": TARGET["seed"] + 1}])
    assert _output(a).text != _output(b).text


def test_a_fresh_mesh_reproduces_seeded_outputs(mesh: Mesh) -> None:
    """Everything is rebuilt (processes, Redis, KV cache, prefix cache): only the seeds and the
    weights are shared, and they alone decide the tokens."""
    specs = [TARGET, OTHERS[0], OTHERS[2], OTHERS[5]]
    here = [_output(r) for r in run_all(mesh, specs)]
    with Mesh(env=ENV) as fresh:
        there = [_output(r) for r in run_all(fresh, specs)]
    for a, b in zip(here, there, strict=True):
        assert_same(a, b)


# --- n > 1 -----------------------------------------------------------------------------------


def test_n_choices_share_the_prompt_and_equal_separate_requests(
    mesh: Mesh, client: openai.OpenAI, model_name: str
) -> None:
    n, seed = 3, 777
    # A prompt that starts with a fresh token sequence: no earlier request cached any of it.
    prompt = (
        f"Note {uuid.uuid4().hex}: once upon a time in a faraway kingdom there lived a king "
        "who had three daughters, and each of them loved the sea more than anything else"
    )
    params = {"temperature": 0.8, "max_tokens": 10, "extra_body": FIXED}
    block_size = mesh.admin_state("scheduler")["worker"]["block_size"]
    hits_before = mesh.admin_state("scheduler")["scheduler"]["prefix_cache_hits"]
    resp = client.completions.create(model=model_name, prompt=prompt, n=n, seed=seed, **params)
    hits = mesh.admin_state("scheduler")["scheduler"]["prefix_cache_hits"] - hits_before
    prompt_len = resp.usage.prompt_tokens
    assert prompt_len > 2 * block_size
    assert hits == (n - 1) * (prompt_len // block_size) * block_size

    texts = [c.text for c in sorted(resp.choices, key=lambda c: c.index)]
    assert len(set(texts)) == n
    for i in range(n):
        alone = client.completions.create(model=model_name, prompt=prompt, seed=seed + i, **params)
        assert alone.choices[0].text == texts[i], f"choice {i}"


# --- logprobs --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(smollm2_dir: Path) -> Iterator[tuple[Any, Any]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    yield model, AutoTokenizer.from_pretrained(smollm2_dir)
    torch.set_num_threads(threads)


def reference_logprobs(
    model: Any, prompt: list[int], max_tokens: int
) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens (through EOS, as `ignore_eos` does: no stop, no EOS ban),
    and log_softmax (fp32) of its logits on prompt + those tokens at each position that
    predicted one of them: [max_tokens, vocab]."""
    gen: list[int] = []
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = model(torch.tensor([prompt + gen])).logits[0, -1]
            gen.append(int(logits.argmax()))
        logits = model(torch.tensor([prompt + gen])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : len(prompt) - 1 + len(gen)]
    assert logprobs.argmax(dim=-1).tolist() == gen
    return gen, logprobs


def test_completion_logprobs_equal_transformers(
    client: openai.OpenAI, model_name: str, reference: tuple[Any, Any]
) -> None:
    model, tok = reference
    prompt, k, max_tokens = "The three primary colors are", 3, 10
    resp = client.completions.create(
        model=model_name, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=k,
        extra_body=FIXED,
    )  # fmt: skip
    prompt_ids = tok(prompt)["input_ids"]
    assert resp.usage.prompt_tokens == len(prompt_ids)
    gen, ref = reference_logprobs(model, prompt_ids, max_tokens)
    lp = resp.choices[0].logprobs
    # OpenAI's legacy shape: parallel lists, one entry per generated token.
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == max_tokens
    assert lp.tokens == [tok.decode([t]) for t in gen]
    assert "".join(lp.tokens) == resp.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(max_tokens)]
    for j, token in enumerate(gen):
        assert lp.token_logprobs[j] == pytest.approx(ref[j, token].item(), abs=TOL)
        top = ref[j].topk(k)
        expected = {
            tok.decode([t]): v
            for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)
        }
        assert lp.top_logprobs[j].keys() == expected.keys(), j
        for text, value in expected.items():
            assert lp.top_logprobs[j][text] == pytest.approx(value, abs=TOL)


def test_echo_with_logprobs_scores_the_prompt_as_transformers(
    client: openai.OpenAI, model_name: str, reference: tuple[Any, Any]
) -> None:
    """lm-eval's loglikelihood request (echo, logprobs, max_tokens 1): every prompt token but
    the first gets its logprob given the tokens before it, streamed or not, and n > 1
    choices score it alike."""
    model, tok = reference
    prompt, k = "The capital of France is Paris, and the capital of Italy is Rome", 2
    ids = tok(prompt)["input_ids"]
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    args: dict[str, Any] = {
        "model": model_name, "prompt": prompt, "max_tokens": 1, "temperature": 0, "echo": True,
        "logprobs": k, "extra_body": FIXED,
    }  # fmt: skip
    resp = client.completions.create(n=2, **args)
    streamed = [c for c in client.completions.create(stream=True, **args) if c.choices]
    echoed = streamed[0].choices[0]
    assert echoed.text == prompt
    for lp in [c.logprobs for c in resp.choices] + [echoed.logprobs]:
        assert lp is not None
        assert lp.tokens[: len(ids)] == [tok.decode([t]) for t in ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for p, token in enumerate(ids[1:]):
            assert lp.token_logprobs[p + 1] == pytest.approx(ref[p, token].item(), abs=TOL)
            top = ref[p].topk(k)
            assert list(lp.top_logprobs[p + 1]) == [tok.decode([t]) for t in top.indices]
    whole = resp.choices[0]
    assert whole.text.startswith(prompt) and len(whole.logprobs.tokens) == len(ids) + 1
    assert whole.logprobs.text_offset[: len(ids)] == [
        sum(len(t) for t in whole.logprobs.tokens[:i]) for i in range(len(ids))
    ]


def test_chat_logprobs_equal_transformers(
    client: openai.OpenAI, model_name: str, reference: tuple[Any, Any]
) -> None:
    model, tok = reference
    messages = [{"role": "user", "content": "Name a large animal."}]
    k, max_tokens = 3, 10
    resp = client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=max_tokens, temperature=0,
        logprobs=True, top_logprobs=k, extra_body=FIXED,
    )  # fmt: skip
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tok(text, add_special_tokens=False)["input_ids"]
    assert resp.usage.prompt_tokens == len(prompt_ids)
    gen, ref = reference_logprobs(model, prompt_ids, max_tokens)
    content = resp.choices[0].logprobs.content
    assert len(content) == max_tokens
    for j, (entry, token) in enumerate(zip(content, gen, strict=True)):
        assert bytes(entry.bytes) == tok.decode([token]).encode(), j
        assert entry.token == tok.decode([token])
        assert entry.logprob == pytest.approx(ref[j, token].item(), abs=TOL)
        top = ref[j].topk(k)
        assert [bytes(t.bytes) for t in entry.top_logprobs] == [
            tok.decode([t]).encode() for t in top.indices.tolist()
        ], j
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            top.values.tolist(), abs=TOL
        )


# --- the drawn seed --------------------------------------------------------------------------


def logged_seed(mesh: Mesh, request_id: str) -> int:
    for line in mesh.tail("gateway", lines=100_000).splitlines():
        if not line.startswith("{"):
            continue
        entry = json.loads(line)
        if entry.get("request_id") == request_id and "seed" in entry:
            return int(entry["seed"])
    raise AssertionError(f"no seed logged for {request_id}")


def test_an_unseeded_requests_logged_seed_reproduces_it(
    mesh: Mesh, client: openai.OpenAI, model_name: str
) -> None:
    params = {"prompt": "My favourite fruit is", "temperature": 1.0, "max_tokens": 10, "n": 2}
    first = client.completions.create(model=model_name, extra_body=FIXED, **params)
    seed = logged_seed(mesh, first.id)
    again = client.completions.create(model=model_name, seed=seed, extra_body=FIXED, **params)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert texts[0] != texts[1]  # choice i runs with seed + i


# --- vLLM's extra parameters -----------------------------------------------------------------


def _ids(logprobs: Any) -> list[int]:
    """Generated token ids, read from logprobs named `token_id:<id>`."""
    tokens = logprobs.tokens if hasattr(logprobs, "tokens") else [e.token for e in logprobs.content]
    return [int(t.removeprefix("token_id:")) for t in tokens]


def _greedy(client: openai.OpenAI, model_name: str, prompt: str, **extra: Any) -> Any:
    return client.completions.create(
        model=model_name, prompt=prompt, max_tokens=12, temperature=0, logprobs=0,
        extra_body={**FIXED, "return_tokens_as_token_ids": True, **extra},
    )  # fmt: skip


def test_prompt_logprobs_equal_transformers(
    client: openai.OpenAI, model_name: str, reference: tuple[Any, Any]
) -> None:
    """vLLM's `prompt_logprobs` (no echo): the choice's prompt_logprobs hold each prompt token
    after the first with its logprob, its rank, and the top-k alternatives, as transformers'
    log-softmax gives them; chat has them at the body's top level."""
    model, tok = reference
    prompt, k = "The capital of France is Paris, and the capital of Italy is Rome", 2
    ids = tok(prompt)["input_ids"]
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    resp = client.completions.create(
        model=model_name, prompt=prompt, max_tokens=1, temperature=0,
        extra_body={"prompt_logprobs": k},
    )  # fmt: skip
    got = resp.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for p, token in enumerate(ids[1:]):
        entry = got[p + 1]
        own = entry[str(token)]
        assert own["logprob"] == pytest.approx(ref[p, token].item(), abs=TOL)
        assert own["decoded_token"] == tok.decode([token])
        low = int((ref[p] > ref[p, token] + TOL).sum()) + 1
        high = int((ref[p] >= ref[p, token] - TOL).sum())
        assert low <= own["rank"] <= high, p
        top = ref[p].topk(k)
        for t in top.indices.tolist():
            assert entry[str(t)]["logprob"] == pytest.approx(ref[p, t].item(), abs=TOL)
        assert set(entry) <= {str(token), *map(str, top.indices.tolist())}
    chat = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
        extra_body={"prompt_logprobs": 0},
    )  # fmt: skip
    assert chat.usage is not None
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens


def test_bad_words_ban_a_word_only_where_it_would_complete(
    client: openai.OpenAI, model_name: str, reference: tuple[Any, Any]
) -> None:
    """A two-token word the greedy output contains: with it banned, the output is the same up
    to the word's first token, then takes transformers' best token other than its second."""
    model, tok = reference
    prompt = "The capital of France is"
    gen = _ids(_greedy(client, model_name, prompt).choices[0].logprobs)
    j = next(
        i for i in range(1, len(gen) - 1)
        if tok.convert_ids_to_tokens(gen[i]).startswith("Ġ")
        and tok(" " + tok.decode(gen[i : i + 2]).lstrip(), add_special_tokens=False)["input_ids"]
        == gen[i : i + 2]
    )  # fmt: skip
    word = tok.decode(gen[j : j + 2]).strip()
    banned = _ids(_greedy(client, model_name, prompt, bad_words=[word]).choices[0].logprobs)
    assert banned[: j + 1] == gen[: j + 1]
    prompt_ids = tok(prompt)["input_ids"]
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids + gen[: j + 1]])).logits[0, -1].float()
        logits[gen[j + 1]] = float("-inf")
    assert banned[j + 1] == int(logits.argmax())


def test_allowed_token_ids_hold_the_output_to_them(
    client: openai.OpenAI, model_name: str, reference: tuple[Any, Any]
) -> None:
    model, tok = reference
    prompt = "Is the sky blue? Answer:"
    allowed = [tok(w, add_special_tokens=False)["input_ids"][0] for w in (" yes", " no", " maybe")]
    out = _ids(_greedy(client, model_name, prompt, allowed_token_ids=allowed).choices[0].logprobs)
    assert set(out) <= set(allowed)
    with torch.inference_mode():
        logits = model(torch.tensor([tok(prompt)["input_ids"]])).logits[0, -1].float()
    assert out[0] == allowed[int(logits[allowed].argmax())]


def test_truncated_prompt_equals_its_tail_sent_as_ids(
    client: openai.OpenAI, model_name: str, reference: tuple[Any, Any]
) -> None:
    _, tok = reference
    prompt = "One two three four five six seven eight nine ten eleven twelve"
    ids = tok(prompt)["input_ids"]
    cut = _greedy(client, model_name, prompt, truncate_prompt_tokens=5)
    tail = _greedy(client, model_name, ids[-5:])  # type: ignore[arg-type]
    assert cut.usage is not None and cut.usage.prompt_tokens == 5
    assert cut.choices[0].text == tail.choices[0].text


def test_stop_string_and_special_tokens_kept_when_asked(
    client: openai.OpenAI, model_name: str, reference: tuple[Any, Any]
) -> None:
    _, tok = reference
    prompt = "The capital of France is"
    base = _greedy(client, model_name, prompt).choices[0].text
    stop = base.split()[1]  # a word the output is known to contain
    kept = _greedy(client, model_name, prompt, include_stop_str_in_output=True)
    cut = client.completions.create(
        model=model_name, prompt=prompt, max_tokens=12, temperature=0, stop=[stop],
        extra_body={**FIXED, "include_stop_str_in_output": True},
    )  # fmt: skip
    assert kept.choices[0].text == base
    assert cut.choices[0].text == base[: base.index(stop) + len(stop)]
    chat = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Say hi."}], max_tokens=40,
        temperature=0, logprobs=True,
        extra_body={**FIXED, "skip_special_tokens": False, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    out = _ids(chat.choices[0].logprobs)
    assert chat.choices[0].message.content == tok.decode(out, skip_special_tokens=False)
    assert "<|im_end|>" in chat.choices[0].message.content  # ignore_eos: it runs past its end


def test_cache_salt_keeps_prefix_caches_apart(client: openai.OpenAI, model_name: str) -> None:
    """The same prompt hits the cache only under the salt it was computed with."""
    prompt = "A long and specific preamble for the cache salt test. " * 6 + str(uuid.uuid4())

    def cached(**extra: Any) -> int:
        resp = client.completions.create(
            model=model_name, prompt=prompt, max_tokens=1, extra_body=extra
        )
        assert resp.usage is not None and resp.usage.prompt_tokens_details is not None
        return resp.usage.prompt_tokens_details.cached_tokens or 0

    assert cached() == 0
    assert cached() > 0  # the plain prompt is cached now
    assert cached(cache_salt="tenant-a") == 0  # not for another tenant
    assert cached(cache_salt="tenant-a") > 0
    assert cached(cache_salt="tenant-b") == 0
