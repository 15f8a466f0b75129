"""Incremental detokenization for streaming: text out as tokens come in, never half a character.

Byte-level BPE splits one character over several tokens (an emoji is 3 tokens in SmolLM2), and
decoding a prefix of them yields U+FFFD. So text is emitted only once the decoded window no
longer ends in U+FFFD; until then it is held back. Decoding works on a short sliding window
(vLLM's prefix/read offsets) rather than the whole output, so each token costs O(window), and
the window starts inside the prompt so that tokenizers which drop a leading space at the start
of a decode (SentencePiece) render the first output token as it reads in context.

Invariant: the concatenation of everything `push` and `flush` returned equals
`tokenizer.decode(output_ids, skip_special_tokens)` for byte-level tokenizers (special tokens
are skipped unless the request says otherwise, as in vLLM).
"""

from __future__ import annotations

from services.gateway.plan.tokenization import PromptTokenizer

#: Prompt tokens kept as left context for the first decodes (vLLM uses 5).
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: PromptTokenizer, prompt_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix = 0  # start of the decode window
        self._read = len(self._ids)  # tokens before this are already emitted as text

    def push(self, token_id: int) -> str:
        """Add one output token; return the text it completes (often "", while held back)."""
        self._ids.append(token_id)
        emitted = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        window = self._tok.decode(self._ids[self._prefix :], self._skip)
        if len(window) > len(emitted) and not window.endswith(REPLACEMENT):
            self._prefix, self._read = self._read, len(self._ids)
            return window[len(emitted) :]
        return ""

    def flush(self) -> str:
        """At the end of the output: whatever was held back (a dangling partial character
        comes out as U+FFFD, as a full decode would render it)."""
        emitted = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        window = self._tok.decode(self._ids[self._prefix :], self._skip)
        self._prefix = self._read = len(self._ids)
        return window[len(emitted) :] if len(window) > len(emitted) else ""
