"""How deeply arrays and objects nest in a JSON text, measured on the raw bytes.

Python's `json.loads` and every recursive walk over its result (pydantic, jsonschema, our own
checks) fail with RecursionError near a thousand levels, and get slow well before. Services
that take JSON from outside (the gateway's request bodies, the grammar service's specs) refuse
deep nesting with this scan first, before anything is parsed into Python objects.

The scan is linear, vectorised with numpy over fixed-size chunks (bounded temporary memory),
and stops at the first level past the limit. Brackets inside strings do not count: a quote
opens or closes a string unless an odd run of backslashes precedes it. A chunk without quotes
or backslashes (the inside of a long prompt) is settled with two byte searches. Text that is
not valid JSON still gets an answer (brackets are counted in order); the parser refuses it
afterwards.
"""

from __future__ import annotations

import numpy as np

QUOTE, BACKSLASH = 0x22, 0x5C
OPENERS, CLOSERS = (0x5B, 0x7B), (0x5D, 0x7D)  # [ {   ] }
#: Bytes scanned per numpy pass: bounds the scan's temporary memory to a few MB.
CHUNK = 1 << 18


def nesting_exceeds(text: bytes, limit: int) -> bool:
    """True when arrays and objects in `text` nest more than `limit` levels deep.

    `[]` and `{}` are one level, `{"a": [1]}` two, a scalar zero."""
    if text.count(b"[") + text.count(b"{") <= limit:  # the common case, at memchr speed
        return False
    scan = _Scan()
    view = memoryview(text)
    for start in range(0, len(text), CHUNK):
        if scan.exceeds(view[start : start + CHUNK], limit):
            return True
    return False


class _Scan:
    """The state carried from one chunk to the next."""

    def __init__(self) -> None:
        self.in_string = False
        self.odd_backslashes = 0  # 1 when an odd run of backslashes ends the previous chunk
        self.depth = 0

    def exceeds(self, chunk: memoryview, limit: int) -> bool:
        raw = chunk.tobytes()
        if b'"' not in raw and b"\\" not in raw:
            self.odd_backslashes = 0
            if self.in_string:
                return False
            return self._brackets(np.frombuffer(raw, dtype=np.uint8), None, limit)
        codes = np.frombuffer(raw, dtype=np.uint8)
        n = len(codes)
        index = np.arange(n, dtype=np.int32)
        is_backslash = codes == BACKSLASH
        # Backslashes in a row up to and including position i (only the parity matters; the
        # carried run continues a run that starts the chunk).
        last_other = np.maximum.accumulate(np.where(is_backslash, -1, index))
        run = index - last_other + np.where(last_other < 0, self.odd_backslashes, 0)
        before = np.empty(n, dtype=np.int32)  # the run just before position i
        before[0] = self.odd_backslashes
        before[1:] = run[:-1] * is_backslash[:-1]
        delimiter = (codes == QUOTE) & (before % 2 == 0)
        toggles = np.cumsum(delimiter, dtype=np.int32)
        # Inside a string at i: an odd number of delimiters before i (the delimiter itself is
        # not a bracket, so counting it inclusively does no harm).
        inside = (toggles + self.in_string) % 2 == 1
        self.in_string = bool((int(toggles[-1]) + self.in_string) % 2)
        self.odd_backslashes = int(run[-1]) % 2 if is_backslash[-1] else 0
        return self._brackets(codes, inside, limit)

    def _brackets(self, codes: np.ndarray, inside: np.ndarray | None, limit: int) -> bool:
        opens = (codes == OPENERS[0]) | (codes == OPENERS[1])
        closes = (codes == CLOSERS[0]) | (codes == CLOSERS[1])
        if inside is not None:
            opens &= ~inside
            closes &= ~inside
        steps = opens.astype(np.int32) - closes.astype(np.int32)
        running = np.cumsum(steps, dtype=np.int64) + self.depth
        if len(running) and int(running.max()) > limit:
            return True
        self.depth = int(running[-1]) if len(running) else self.depth
        return False
