"""StopStringMatcher: applies stop strings to streamed text exactly as the offline engine does,
without ever streaming text that a later match would have cut."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class StopMatch(NamedTuple):
    """What feed() releases: text safe to send now, and the stop string that ended it, if any."""

    text: str
    stop: str | None


def _held_back_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop string: it
    may yet become a match, so it must not be sent."""
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest


class StopStringMatcher:
    """Accumulates one sequence's text and cuts it at the first stop string.

    Matching follows engine.llm: after each delta the whole text is searched for each stop
    string in the order given, and the first one found cuts the text before it. Invariant: the
    released text is always a prefix of the final text, because a suffix that could start a
    match is held until it either matches or cannot any more.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.text = ""
        """All text fed so far (cut at the stop string once one matched)."""
        self.num_released = 0
        """Characters of text already released."""
        self.stop: str | None = None

    def feed(self, delta: str) -> StopMatch:
        """Add new text; release what can no longer be cut."""
        if self.stop is not None:
            return StopMatch("", self.stop)
        self.text += delta
        for stop in self.stops:
            cut = self.text.find(stop)
            if cut != -1:
                self.text = self.text[:cut]
                self.stop = stop
                return StopMatch(self._release(len(self.text)), stop)
        return StopMatch(
            self._release(len(self.text) - _held_back_len(self.text, self.stops)), None
        )

    def flush(self, delta: str = "") -> str:
        """The sequence ended without a stop string: release the held text plus delta (the
        engine does not search the detokenizer's final flush for stop strings either)."""
        if self.stop is not None:
            return ""
        self.text += delta
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        released = self.text[self.num_released : end]
        self.num_released = max(self.num_released, end)
        return released
