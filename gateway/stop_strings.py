"""StopStringMatcher: applies stop strings to streamed text exactly as the offline engine does,
without ever streaming text that a later match would have cut, in time linear in the text."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple


class StopMatch(NamedTuple):
    """What feed() releases: text safe to send now, and the stop string that ended it, if any."""

    text: str
    stop: str | None


@functools.lru_cache(maxsize=256)
def _failure_table(stop: str) -> tuple[int, ...]:
    """Knuth-Morris-Pratt: table[i] is the length of the longest proper prefix of stop[: i + 1]
    that is also its suffix. Cached: the n completions of a request share their stop strings."""
    table = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = table[k - 1]
        if stop[i] == stop[k]:
            k += 1
        table[i] = k
    return tuple(table)


class _StopScanner:
    """One stop string's KMP state over the text fed so far: `state` is the length of the
    longest suffix of the text that is a proper prefix of the stop string (exactly what must be
    held back), and each character costs amortised O(1)."""

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.table = _failure_table(stop)
        self.state = 0

    def advance(self, text: str, start: int) -> int | None:
        """Feed text[start:]; the index where the first match starts, if one ends in it."""
        stop, table, k = self.stop, self.table, self.state
        for i in range(start, len(text)):
            ch = text[i]
            while k and ch != stop[k]:
                k = table[k - 1]
            if ch == stop[k]:
                k += 1
            if k == len(stop):
                self.state = table[k - 1]
                return i + 1 - len(stop)
        self.state = k
        return None


class StopStringMatcher:
    """Accumulates one sequence's text and cuts it at the first stop string.

    Matching follows engine.llm: after each delta the text is searched for each stop string in
    the order given, and the first one found cuts the text before it (after it, with
    include_stop_str). Only new text is scanned, so a sequence costs O(text + stop strings)
    whatever their lengths. Invariant: the released text is always a prefix of the final text,
    because a suffix that could start a match is held until it either matches or cannot any more.
    """

    def __init__(self, stops: Sequence[str], include_stop_str: bool = False) -> None:
        self._scanners = [_StopScanner(s) for s in dict.fromkeys(s for s in stops if s)]
        self._include_stop_str = include_stop_str
        self.text = ""
        """All text fed so far (cut at the stop string once one matched)."""
        self.num_released = 0
        """Characters of text already released."""
        self.stop: str | None = None

    def feed(self, delta: str) -> StopMatch:
        """Add new text; release what can no longer be cut."""
        if self.stop is not None:
            return StopMatch("", self.stop)
        start = len(self.text)
        self.text += delta
        matches = [(scanner.stop, scanner.advance(self.text, start)) for scanner in self._scanners]
        for stop, cut in matches:
            if cut is not None:
                end = cut + len(stop) if self._include_stop_str else cut
                self.text = self.text[:end]
                self.stop = stop
                return StopMatch(self._release(len(self.text)), stop)
        held_back = max((scanner.state for scanner in self._scanners), default=0)
        return StopMatch(self._release(len(self.text) - held_back), None)

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
