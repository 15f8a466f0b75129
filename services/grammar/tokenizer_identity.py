"""The served model's tokenizer as xgrammar sees it, and the hash that names it.

Grammars are compiled against an xgrammar TokenizerInfo built from the model's HF tokenizer,
with the vocabulary size of the model's lm_head (config.json `vocab_size`, which may exceed the
tokenizer's: bitmask rows must cover every logit) and the model's eos ids as stop tokens (the
ones the worker stops on). The hash of its serialization is part of every grammar key, so two
models never share a compiled grammar, and schedulers load the same TokenizerInfo from Redis.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class TokenizerIdentity:
    hash: str  # sha256 of info_json
    info_json: str  # xgrammar TokenizerInfo.serialize_json()
    vocab_size: int
    xgrammar_version: str


def xgrammar_version() -> str:
    return metadata.version("xgrammar")


def load_tokenizer_identity(hf_dir: Path) -> TokenizerIdentity:
    """Slow (loads the tokenizer, seconds): call off the event loop."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    config = _read_json(hf_dir / "config.json")
    generation = _read_json(hf_dir / "generation_config.json")
    vocab_size = int(config.get("vocab_size") or len(tokenizer))
    eos = set(_ids(config.get("eos_token_id")) + _ids(generation.get("eos_token_id")))
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer,
        vocab_size=vocab_size,
        stop_token_ids=sorted(eos) or None,  # None: xgrammar takes the tokenizer's eos
    )
    serialized = info.serialize_json()
    return TokenizerIdentity(
        hash=hashlib.sha256(serialized.encode()).hexdigest(),
        info_json=serialized,
        vocab_size=vocab_size,
        xgrammar_version=xgrammar_version(),
    )


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, list):
        return [int(v) for v in value]
    return [int(value)]
