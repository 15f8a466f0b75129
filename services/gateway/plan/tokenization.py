"""The model's tokenizer and chat template, and the prompt forms the API accepts.

The gateway owns tokenization (as vLLM's input processor does): schedulers and workers only ever
see token ids. A chat is rendered to text with the model's own template and then tokenized
without adding special tokens again, because the template already wrote them (a second BOS
would change the model's output).

Encoding goes to the Rust tokenizer's batch call (without offsets), which releases the GIL
while it works, so a large prompt tokenized on a worker thread leaves the event loop free
(planning_pool). With a length limit, a prompt that is too long is refused from the token
count alone: the ids of a 10 MB prompt (2 M tokens) are never turned into Python ints.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from services.gateway.api.errors import invalid_request
from services.gateway.api.protocol_openai import ChatMessage, Tool

log = logging.getLogger(__name__)


class PromptTooLong(Exception):
    """The text has more tokens than the caller's limit (the count is exact)."""

    def __init__(self, num_tokens: int) -> None:
        super().__init__(f"{num_tokens} tokens")
        self.num_tokens = num_tokens


@dataclass(frozen=True)
class TokenizedPrompt:
    token_ids: list[int]
    text: str  # the prompt as text: what the client sent, or the decoded ids (for echo; else "")


#: tokenizer_config.json classes that are transformers' generic fast tokenizer
#: (TokenizersBackend is its transformers 5 name, PreTrainedTokenizerFast an alias).
GENERIC_FAST_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def tokenizer_class(hf_dir: Path) -> str | None:
    """The `tokenizer_class` an HF directory's tokenizer_config.json names, if any."""
    path = Path(hf_dir) / "tokenizer_config.json"
    if not path.exists():
        return None
    name = json.loads(path.read_text()).get("tokenizer_class")
    return name if isinstance(name, str) else None


class PromptTokenizer:
    """Wraps a transformers tokenizer: encode, chat template, decode, per-token bytes."""

    def __init__(self, tokenizer: Any, source_dir: Path | None = None) -> None:
        self.hf = tokenizer
        self.source_dir = source_dir  # where from_dir loaded it from
        self.special_ids = frozenset(int(i) for i in tokenizer.all_special_ids)
        self._byte_decoder = _gpt2_byte_decoder() if _is_byte_level(tokenizer) else None
        self._added = {int(i): t.content for i, t in tokenizer.added_tokens_decoder.items()}
        self.token_bytes = lru_cache(maxsize=65536)(self._token_bytes)
        # The Rust tokenizer decodes the same text at a third of the cost of the transformers
        # wrapper (it runs twice per streamed token), unless the wrapper post-processes spaces.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        cleans = getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self._fast_decode = None if backend is None or cleans else backend.decode
        # transformers' own encode calls the same Rust batch encoder, then builds attention
        # masks and type ids for every token while holding the GIL (~0.2 s at 2 M tokens).
        self._encode_batch = None
        if backend is not None:
            self._encode_batch = getattr(backend, "encode_batch_fast", backend.encode_batch)

    @classmethod
    def from_dir(cls, hf_dir: Path) -> PromptTokenizer:
        if tokenizer_class(hf_dir) in GENERIC_FAST_CLASSES:
            # The class AutoTokenizer picks for these, without its model-config lookup, which
            # imports torch through transformers' config modules: ~3 s of every gateway start.
            from transformers import PreTrainedTokenizerFast

            return cls(PreTrainedTokenizerFast.from_pretrained(str(hf_dir)), Path(hf_dir))
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(hf_dir)), Path(hf_dir))

    # --- prompts ----------------------------------------------------------------------------

    def encode(
        self, text: str, add_special_tokens: bool = True, *, token_limit: int | None = None
    ) -> list[int]:
        """The token ids of `text`; PromptTooLong when there are more than `token_limit`."""
        if self._encode_batch is None:  # a slow (Python) tokenizer
            ids = list(self.hf.encode(text, add_special_tokens=add_special_tokens))
            if token_limit is not None and len(ids) > token_limit:
                raise PromptTooLong(len(ids))
            return ids
        (encoding,) = self._encode_batch([text], add_special_tokens=add_special_tokens)
        if token_limit is not None and len(encoding) > token_limit:
            raise PromptTooLong(len(encoding))
        return list(encoding.ids)

    def completion_prompt(
        self, prompt: str | list[int], *, token_limit: int | None = None, echo: bool = True
    ) -> TokenizedPrompt:
        """A completions prompt: text is tokenized with the tokenizer's special tokens (its BOS,
        if it has one); token ids are taken as they are, and decoded (for `echo`, the only
        reader of their text) once they are known to fit `token_limit`. Without echo their
        text is left empty: decoding 512 ids costs more than the rest of planning them."""
        if isinstance(prompt, str):
            return TokenizedPrompt(self.encode(prompt, token_limit=token_limit), prompt)
        if token_limit is not None and len(prompt) > token_limit:
            raise PromptTooLong(len(prompt))
        text = self.decode(prompt, skip_special_tokens=False) if echo else ""
        return TokenizedPrompt(list(prompt), text)

    def render_chat(
        self,
        messages: list[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[Tool] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The conversation as the model's template writes it. `tools` go to the template in
        OpenAI's form (a template that knows tools describes them to the model; one that does
        not ignores them), whatever the tool choice, as vLLM passes them."""
        if not getattr(self.hf, "chat_template", None):
            raise invalid_request("this model has no chat template", "messages")
        conversation = [_template_message(m) for m in messages]
        tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
        try:
            return str(
                self.hf.apply_chat_template(
                    conversation,
                    tools=tool_dicts,
                    tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    **(template_kwargs or {}),
                )
            )
        except Exception as exc:  # jinja TemplateError, the template's raise_exception()
            message = f"the chat template refused the messages: {exc}"
            raise invalid_request(message, "messages") from None

    def chat_prompt(
        self,
        messages: list[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        token_limit: int | None = None,
        tools: list[Tool] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> TokenizedPrompt:
        text = self.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            template_kwargs=template_kwargs,
        )
        ids = self.encode(text, add_special_tokens=False, token_limit=token_limit)
        return TokenizedPrompt(ids, text)

    # --- output -----------------------------------------------------------------------------

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._fast_decode is not None:
            return str(self._fast_decode(ids, skip_special_tokens=skip_special_tokens))
        return str(self.hf.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_strs(self, ids: list[int]) -> list[str]:
        """The tokenizer's own token strings (`Ġthe`), as vLLM's /tokenize returns them."""
        return [str(t) for t in self.hf.convert_ids_to_tokens(ids)]

    def token_text(self, token_id: int) -> str:
        """A token as text for logprobs: its bytes as UTF-8, with U+FFFD for a token that holds
        only part of a character (its `bytes` then carry the exact value)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def _token_bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        if self._byte_decoder is not None:
            piece = self.hf.convert_ids_to_tokens(token_id)
            if piece is not None and all(ch in self._byte_decoder for ch in piece):
                return bytes(self._byte_decoder[ch] for ch in piece)
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")


def _template_message(message: ChatMessage) -> dict[str, Any]:
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role, "content": message.content or ""}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.function.name,
                    "arguments": _arguments(call.function.arguments),
                },
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _arguments(text: str) -> Any:
    """A call's arguments as templates expect them: the JSON object itself (Qwen's and
    Llama's templates serialise it with `tojson`, which would quote the API's string form
    again), or the text as sent when it is not a JSON object (as vLLM does)."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)


def _gpt2_byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte-to-printable-character map used by byte-level BPE vocabularies."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}
