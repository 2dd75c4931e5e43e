"""Stop strings in streamed text: ``StopTrimmer`` sends a row's text without the stop string
that ended it, holding back text that could be the start of one.

The engine keeps a stop string in its output; OpenAI's API leaves it out.
"""

from __future__ import annotations

from collections.abc import Sequence


class _PartialMatch:
    """How long a start of one stop string the text ends with, kept up to date as text comes.

    Each delta costs time in its own length only, whatever the length of the stop string or of
    the text so far (Knuth-Morris-Pratt): ``length`` is the longest prefix of ``stop`` that the
    text ends with, and each new character moves it in amortized constant time. The failure
    table is built only as far as ``length`` has reached, so a long stop string that the text
    never follows far costs nothing up front.
    """

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.length = 0
        # _borders[j]: the longest proper prefix of stop[: j + 1] that is also its suffix.
        self._borders: list[int] = [0]

    def _border(self, j: int) -> int:
        borders, stop = self._borders, self.stop
        while len(borders) <= j:
            i = len(borders)
            k = borders[i - 1]
            while k > 0 and stop[i] != stop[k]:
                k = borders[k - 1]
            borders.append(k + 1 if stop[i] == stop[k] else k)
        return borders[j]

    def feed(self, text: str) -> None:
        """Follow ``text``, appended to the text so far."""
        stop, first = self.stop, self.stop[0]
        k, i, n = self.length, 0, len(text)
        while i < n:
            if k == 0:
                # Nothing matched: skip to where the stop string could start (str.find, in C).
                i = text.find(first, i)
                if i < 0:
                    break
                k, i = 1, i + 1
                continue
            if k == len(stop):
                k = self._border(k - 1)
                continue
            ch = text[i]
            while k > 0 and stop[k] != ch:
                k = self._border(k - 1)
            if stop[k] == ch:
                k += 1
            i += 1
        self.length = k

    @property
    def held(self) -> int:
        """The longest end of the text that begins the stop string but is not all of it."""
        if self.length == len(self.stop):
            return self._border(self.length - 1)
        return self.length


class StopTrimmer:
    """Turns a row's text deltas into OpenAI's: without the stop string that ended the row.

    Text that could be the beginning of a stop string is held back until the next delta shows
    it is not.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.text = ""
        self.sent = 0
        self._matches = [_PartialMatch(s) for s in dict.fromkeys(self.stops) if s]

    def feed(self, delta: str, finish_reason: str | None) -> str:
        """Add the engine's delta; return the text that can be sent now."""
        self.text += delta
        for match in self._matches:
            match.feed(delta)
        end = len(self.text)
        if finish_reason == "stop":
            hits = [found for s in self.stops if (found := self.text.find(s)) >= 0]
            end = min(hits, default=end)
        elif finish_reason is None:
            end -= self._held()
        out = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out

    def _held(self) -> int:
        """Length of the longest end of the text that begins some stop string."""
        return max((match.held for match in self._matches), default=0)
