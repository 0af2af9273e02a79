"""Stop strings: where a request's text ends. The rule lives here and nowhere else.

The rule (OpenAI's, as vLLM and SGLang apply it, made exact):
- A request stops at the first output token after which its *settled* text contains one of its stop
  strings. The settled text is the decoded output less the bytes that may still become a character
  (`IncrementalDetokenizer` decides which; at the end of a request all of it is settled).
- Its text ends right before the earliest occurrence of any stop string in that text; of two starting
  at the same place, the shorter (the one the text contained first). The stop string and everything
  after it are never shown.

`StopMatcher` applies the rule to text that arrives in pieces. `IncrementalDetokenizer` feeds it the
text each token settles, one token at a time, and every user of stop strings goes through that pair:
the scheduler (which stops the request), the server's detokenizer and the chat (which stream the
text), and `Engine.output_text`. Fed the same ids, they reach the same token, the same stop string and
the same text, however the ids were batched.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def find_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """The earliest occurrence of a stop string in `text` (the shorter of two starting together)."""
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i, len(s)) < (best[0], len(best[1]))):
            best = (i, s)
    return best


class StopMatcher:
    """One request's stop strings over its settled text, piece by piece: shows what no stop string can
    take back, holds the tail that could begin one, and cuts at the first stop string found.

    Only the held tail and the new piece are searched: an occurrence that began in text already shown
    would have begun with a tail that was held instead."""

    def __init__(self, stop: str | Iterable[str] | None) -> None:
        stops = [stop] if isinstance(stop, str) else list(stop or ())
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(stops))  # unique, in the caller's order
        self._max_held = max((len(s) for s in self.stops), default=1) - 1  # longest proper prefix
        self._held = ""  # settled text not shown yet: it may begin a stop string
        self.hit: str | None = None  # the stop string the text ended on

    def feed(self, text: str) -> str:
        """Take newly settled text; return what may be shown now ("" once a stop string was found)."""
        if self.hit is not None:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        found = find_stop(buf, self.stops)
        if found is not None:
            self._held, self.hit = "", found[1]
            return buf[: found[0]]
        keep = self._prefix_tail(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def flush(self, text: str = "") -> str:
        """The request is over: feed the last settled text and show the held tail (no stop string
        begins in it after all)."""
        out = self.feed(text) + self._held
        self._held = ""
        return out

    def _prefix_tail(self, buf: str) -> int:
        """Length of the longest tail of `buf` that is a proper prefix of some stop string."""
        for n in range(min(self._max_held, len(buf)), 0, -1):
            tail = buf[len(buf) - n :]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0
