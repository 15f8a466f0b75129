"""Stop strings, matched across chunk boundaries and left out of the output.

Text arrives in pieces (one per token); a stop string may straddle pieces. The matcher keeps
back the longest tail of the unemitted text that could still grow into a stop string, and
searches held + new text together, so:
- no emitted text ever contains (the start of) a stop string that later completes, and
- the output ends right before the earliest stop string in the full text (or right after it,
  when the request asks for the stop string in the output).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StopCheck:
    text: str  # safe to emit now
    stopped: bool  # a stop string matched; `text` ends right before it


class StopStringMatcher:
    """`include`: the output ends right after the stop string instead (vLLM's
    include_stop_str_in_output); at one position the first listed string is the one matched."""

    def __init__(self, stops: list[str], include: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include = include
        self._held = ""
        self.stopped = False

    def feed(self, piece: str) -> StopCheck:
        if self.stopped:
            return StopCheck("", True)
        if not self.stops:
            return StopCheck(piece, False)
        text = self._held + piece
        found = [(i, stop) for stop in self.stops if (i := text.find(stop)) >= 0]
        if found:
            first, stop = min(found, key=lambda hit: hit[0])
            self.stopped = True
            self._held = ""
            return StopCheck(text[: first + len(stop) if self.include else first], True)
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
