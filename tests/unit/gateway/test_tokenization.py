"""Prompt forms and the chat template, checked against transformers itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from services.gateway.api.errors import OpenAIError
from services.gateway.api.protocol_openai import ChatMessage
from services.gateway.plan.tokenization import (
    GENERIC_FAST_CLASSES,
    PromptTokenizer,
    PromptTooLong,
    tokenizer_class,
)


def messages(*pairs: tuple[str, str]) -> list[ChatMessage]:
    return [ChatMessage(role=role, content=content) for role, content in pairs]  # type: ignore[arg-type]


def reference_ids(
    tok: PromptTokenizer, conversation: list[dict[str, str]], **kw: bool
) -> list[int]:
    out = tok.hf.apply_chat_template(conversation, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_chat_template_matches_apply_chat_template(tokenizer: PromptTokenizer) -> None:
    chat = messages(
        ("system", "Be brief."),
        ("user", "Hi"),
        ("assistant", "Hello!"),
        ("user", "Capital of France?"),
    )
    got = tokenizer.chat_prompt(chat)
    conversation = [{"role": m.role, "content": m.content or ""} for m in chat]
    assert got.token_ids == reference_ids(tokenizer, conversation, add_generation_prompt=True)
    assert got.text.endswith("<|im_start|>assistant\n")
    # The template writes the special tokens itself; none are added twice.
    assert got.token_ids.count(tokenizer.hf.convert_tokens_to_ids("<|im_start|>")) == 5


def test_default_system_prompt_and_no_generation_prompt(tokenizer: PromptTokenizer) -> None:
    got = tokenizer.chat_prompt(messages(("user", "Hi")), add_generation_prompt=False)
    conversation = [{"role": "user", "content": "Hi"}]
    assert got.token_ids == reference_ids(tokenizer, conversation, add_generation_prompt=False)
    assert "You are a helpful AI assistant named SmolLM" in got.text


def test_text_parts_join_and_developer_is_system(tokenizer: PromptTokenizer) -> None:
    parts = ChatMessage.model_validate(
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    )
    dev = ChatMessage(role="developer", content="Rules.")
    got = tokenizer.chat_prompt([dev, parts])
    conversation = [{"role": "system", "content": "Rules."}, {"role": "user", "content": "a\nb"}]
    assert got.token_ids == reference_ids(tokenizer, conversation, add_generation_prompt=True)


def test_continue_final_message_leaves_the_turn_open(tokenizer: PromptTokenizer) -> None:
    chat = messages(("user", "Count"), ("assistant", "1, 2,"))
    got = tokenizer.chat_prompt(chat, add_generation_prompt=False, continue_final_message=True)
    assert got.text.endswith("1, 2,")


def test_completion_prompt_forms(tokenizer: PromptTokenizer) -> None:
    text = tokenizer.completion_prompt("Hello world")
    assert text.token_ids == tokenizer.hf("Hello world")["input_ids"]
    assert text.text == "Hello world"
    ids = tokenizer.completion_prompt(text.token_ids)
    assert ids.token_ids == text.token_ids and ids.text == "Hello world"


def test_token_bytes_rebuild_split_characters(tokenizer: PromptTokenizer) -> None:
    ids = tokenizer.encode("é😀", add_special_tokens=False)
    joined = b"".join(tokenizer.token_bytes(t) for t in ids)
    assert joined == "é😀".encode()
    assert tokenizer.token_text(tokenizer.hf.eos_token_id) == "<|im_end|>"


def test_model_without_chat_template_is_a_400(tokenizer: PromptTokenizer) -> None:
    saved = tokenizer.hf.chat_template
    tokenizer.hf.chat_template = None
    try:
        with pytest.raises(OpenAIError) as err:
            tokenizer.chat_prompt(messages(("user", "Hi")))
    finally:
        tokenizer.hf.chat_template = saved
    assert err.value.status == 400 and err.value.param == "messages"


def test_decode_matches_transformers(tokenizer: PromptTokenizer) -> None:
    ids = [*tokenizer.encode("Hi 😀 there", add_special_tokens=False), 2, 1]
    for skip in (True, False):
        assert tokenizer.decode(ids, skip) == tokenizer.hf.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("add_special_tokens", [True, False])
@pytest.mark.parametrize(
    "text",
    ["", "Hello world", "<|im_start|>user\nHi<|im_end|>", "é😀 naïve  spaces\n\ttabs", "a" * 5000],
)
def test_encode_equals_transformers(
    tokenizer: PromptTokenizer, text: str, add_special_tokens: bool
) -> None:
    """encode() calls the Rust batch encoder directly (it releases the GIL); the ids are the
    ones transformers' own encode gives, special tokens in the text included."""
    expected = tokenizer.hf.encode(text, add_special_tokens=add_special_tokens)
    assert tokenizer.encode(text, add_special_tokens=add_special_tokens) == expected


def test_a_prompt_past_the_token_limit_is_refused_with_its_exact_count(
    tokenizer: PromptTokenizer,
) -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 50
    count = len(tokenizer.encode(text))
    assert tokenizer.encode(text, token_limit=count) == tokenizer.encode(text)
    with pytest.raises(PromptTooLong) as err:
        tokenizer.encode(text, token_limit=count - 1)
    assert err.value.num_tokens == count
    with pytest.raises(PromptTooLong):
        tokenizer.completion_prompt(list(range(10, 30)), token_limit=19)


def test_a_generic_fast_tokenizer_loads_as_autotokenizer_would_without_torch(
    smollm2_dir: Path,
) -> None:
    """SmolLM2's tokenizer_config names TokenizersBackend: the gateway loads that class
    directly (AutoTokenizer's model-config lookup imports torch, seconds of every start) and
    gets the same tokenizer: same class, ids, chat template and special tokens."""
    assert tokenizer_class(smollm2_dir) in GENERIC_FAST_CLASSES
    text = "Héllo wörld, <|im_start|> 123"
    code = (
        "import sys, json\n"
        "from services.gateway.plan.tokenization import PromptTokenizer\n"
        f"tok = PromptTokenizer.from_dir({str(smollm2_dir)!r})\n"
        "print(json.dumps([type(tok.hf).__name__, 'torch' in sys.modules,\n"
        f"    tok.encode({text!r}), tok.hf.chat_template, tok.hf.all_special_tokens]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    name, torch_loaded, ids, template, specials = json.loads(out.stdout.splitlines()[-1])
    assert not torch_loaded
    reference = AutoTokenizer.from_pretrained(str(smollm2_dir))
    assert name == type(reference).__name__
    assert ids == reference(text)["input_ids"]
    assert template == reference.chat_template
    assert specials == reference.all_special_tokens


#: A tool-aware template of the usual shape (tools listed up front, an assistant's calls with
#: their arguments as JSON objects, a tool turn naming the call it answers), to show what the
#: gateway hands a template: the embedded model's own template ignores tools.
TOOL_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call {{ c.id }}>{{ c.function.name }}"
    "{{ c.function.arguments | tojson }}</call>{% endfor %}"
    "{% if m.tool_call_id %}<answers {{ m.tool_call_id }}>{% endif %}{% endfor %}"
)


def test_tools_calls_and_results_reach_the_template(smollm2_dir: Path) -> None:
    from services.gateway.api.protocol_openai import Tool

    hf = AutoTokenizer.from_pretrained(str(smollm2_dir))
    hf.chat_template = TOOL_TEMPLATE
    tok = PromptTokenizer(hf)
    params = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = [
        Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": params}})
    ]
    chat = [
        ChatMessage(role="user", content="Weather in Paris?"),
        ChatMessage.model_validate(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call_1", "function": {"name": "f", "arguments": '{"city": "Paris"}'}},
                    {"id": "call_2", "function": {"name": "f", "arguments": "not json"}},
                ],
            }
        ),
        ChatMessage(role="tool", content="18 C", tool_call_id="call_1"),
    ]
    text = tok.render_chat(chat, add_generation_prompt=False, tools=tools)
    listed = json.loads(text[len("<tools>") : text.index("</tools>")])
    assert listed == {"type": "function", "function": {"name": "f", "parameters": params}}
    # Arguments reach the template as the object (tojson writes it once, not a quoted string);
    # arguments that are not a JSON object stay the text the client sent.
    assert '<call call_1>f{"city": "Paris"}</call>' in text
    assert '<call call_2>f"not json"</call>' in text
    assert text.endswith("<|tool|>18 C<answers call_1>")
    assert tok.render_chat(chat[:1], add_generation_prompt=False) == "<|user|>Weather in Paris?"
