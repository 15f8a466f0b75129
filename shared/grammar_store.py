"""Where compiled grammars live in Redis, and how an entry is encoded.

The grammar service writes, schedulers read (their ACL user may only read
`meshllm:*:grammar:*`). Two kinds of keys:
- `meshllm:<cluster>:grammar:<key>`: one compiled grammar (xgrammar's serialized JSON, which
  leaves the tokenizer out), `key` = sha256 of (kind, spec, tokenizer hash, xgrammar version);
- `meshllm:<cluster>:grammar:tokenizer:<hash>`: the serialized xgrammar TokenizerInfo those
  grammars were compiled against, stored once, so a scheduler deserializes grammars without
  loading the tokenizer itself.

An entry names its xgrammar version and tokenizer hash: xgrammar refuses to deserialize across
versions, so a reader checks them first and reports a clear mismatch instead. Nothing here
imports xgrammar or redis.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

ENTRY_FORMAT = 1


class GrammarEntryError(ValueError):
    """A stored entry that cannot be used: wrong format, or not msgpack at all."""


@dataclass(frozen=True)
class GrammarEntry:
    kind: str
    compiled: str  # xgrammar CompiledGrammar.serialize_json()
    tokenizer_hash: str
    xgrammar_version: str

    def encode(self) -> bytes:
        return msgpack.packb(
            {
                "format": ENTRY_FORMAT,
                "kind": self.kind,
                "compiled": self.compiled,
                "tokenizer": self.tokenizer_hash,
                "xgrammar": self.xgrammar_version,
            }
        )

    @classmethod
    def decode(cls, raw: bytes) -> GrammarEntry:
        try:
            data = msgpack.unpackb(raw)
        except Exception as exc:
            raise GrammarEntryError(f"not a grammar entry: {exc}") from None
        if not isinstance(data, dict) or data.get("format") != ENTRY_FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise GrammarEntryError(f"grammar entry format {found!r}, expected {ENTRY_FORMAT}")
        try:
            return cls(
                kind=str(data["kind"]),
                compiled=str(data["compiled"]),
                tokenizer_hash=str(data["tokenizer"]),
                xgrammar_version=str(data["xgrammar"]),
            )
        except KeyError as exc:
            raise GrammarEntryError(f"grammar entry lacks {exc}") from None


class GrammarKeys:
    """Redis key names of the grammar cache of one cluster."""

    def __init__(self, cluster: str = "default") -> None:
        self.prefix = f"meshllm:{cluster}:grammar"

    def grammar(self, key: str) -> str:
        return f"{self.prefix}:{key}"

    def tokenizer(self, tokenizer_hash: str) -> str:
        return f"{self.prefix}:tokenizer:{tokenizer_hash}"
