"""Stop strings, matched across chunk boundaries and left out of the output.

Text arrives in pieces (one per token); a stop string may straddle pieces. The matcher keeps
back the longest tail of the unemitted text that could still grow into a stop string, and
searches held + new text together, so:
- no emitted text ever contains (the start of) a stop string that later completes, and
- the output ends right before the earliest stop string in the full text.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StopCheck:
    text: str  # safe to emit now
    stopped: bool  # a stop string matched; `text` ends right before it


class StopStringMatcher:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def feed(self, piece: str) -> StopCheck:
        if self.stopped:
            return StopCheck("", True)
        if not self.stops:
            return StopCheck(piece, False)
        text = self._held + piece
        first = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if first >= 0:
            self.stopped = True
            self._held = ""
            return StopCheck(text[:first], True)
        keep = self._partial_tail(text)
        self._held = text[len(text) - keep :] if keep else ""
        return StopCheck(text[: len(text) - keep], False)

    def flush(self) -> str:
        """The held-back tail, at the end of an output that did not stop on a string."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_tail(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        return max(partial_tail(text, stop) for stop in self.stops)


def partial_tail(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`: what a
    reader of streamed text holds back until the next piece says whether the marker comes
    (stop strings; the tags of reasoning and tool calls)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
