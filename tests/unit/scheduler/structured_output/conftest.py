"""A real xgrammar grammar over a tiny readable vocabulary, with reasoning markers.

The vocabulary is a RAW one of whole words, so a test reads as the token stream it is. The
grammar accepts exactly `{ "a" : [12]+ }` then the stop token.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

VOCAB = ["<eos>", "<think>", "</think>", "hmm", "{", "}", '"a"', ":", "1", "2", "</", "think>", "x"]
EOS, THINK, END, HMM, LB, RB, KEY, COLON, ONE, TWO, END_A, END_B, X = range(len(VOCAB))
GRAMMAR = 'root ::= "{" "\\"a\\"" ":" [12]+ "}"'
ALL = frozenset(range(32))  # an all-allowed row: every bit of the one word set


@pytest.fixture(scope="session")
def compiled() -> Any:
    import xgrammar as xgr

    info = xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, stop_token_ids=[EOS])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    return compiler.compile_grammar(GRAMMAR)


def allowed(rows: np.ndarray, i: int) -> frozenset[int]:
    """Token ids row i allows (bits of its single word; ALL when unrestricted)."""
    word = int(rows[i, 0]) & 0xFFFFFFFF
    return frozenset(b for b in range(32) if word >> b & 1)
