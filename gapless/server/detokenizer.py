"""Incremental detokenization for streaming: token ids in, text deltas out, stop strings honoured.

Two layers, each holding back only what it must:

1. Decoding. Byte-level BPE splits a multi-byte character ("é", "€", emoji, CJK) across tokens, and a
   decode that ends mid-character ends in U+FFFD. Each call decodes a bounded window of token ids,
   `ids[prefix:]`, and releases the part of it past what was released before, except a trailing run of
   U+FFFD, which may still turn into a real character when the next bytes arrive. Text before that run
   is final: appending bytes only changes how the last, incomplete sequence decodes. Once the window
   decodes cleanly (no trailing U+FFFD) it moves up: `prefix` to a few tokens before the end (the
   context that keeps decoders which strip a leading space, such as SentencePiece's, consistent) and
   `read` to the end. Every decode is over O(new tokens + a small constant) ids.

2. Stop strings. Text is never shown past the first occurrence of a stop string, and a tail that could
   be the start of one ("ab#" with stop "###") is held until the next text settles it. Only the held
   tail and the new text are searched: any occurrence that began in released text would have been a
   held tail. A match waits while a longer stop string that would start earlier is still possible
   (stops "b" and "abc", text "ab"), so the cut is always at the earliest occurrence.

The concatenation of every delta `update` and `finish` return is exactly
`tokenizer.decode(all_ids, skip_special_tokens=...)` cut before the first occurrence of any stop
string (OpenAI semantics: the stop string itself is not returned). That is `Engine.output_text`'s
text too, which decodes the output ids whole with the request's `skip_special_tokens`. The decoded
output is not conditioned on the prompt, for the same reason: `Engine.output_text` does not either.

One difference from the engine: it checks stop strings once per token in the listed order, so when
two of them complete in the same token it cuts at the first listed, where this cuts at the earliest,
and the stream can be shorter than `Engine.output_text`. It takes overlapping stop strings that appear
together in one token; neither text contains a stop string.

The guarantees hold for decoders whose output is a left-to-right function of the bytes (byte-level
BPE: Llama 3, Qwen, GPT-2, and this project's test tokenizer). SentencePiece's byte-fallback decoder
turns a whole run of byte tokens into U+FFFD when any of them is invalid, and `clean_up_tokenization_
spaces` rewrites text across token boundaries; for those the deltas are still whole characters, but
garbage bytes or cleaned-up spaces may come out differently from a one-shot decode.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

REPLACEMENT = "\ufffd"

# Tokens of context kept before the read offset after the window moves up. Enough for decoders that
# treat the first token of a decode specially (SentencePiece drops its leading space).
CONTEXT_TOKENS = 5
# Undecided tokens (past the read offset, decoding to a trailing U+FFFD) tolerated before the window is
# forced forward. A UTF-8 character is at most 4 bytes, so valid text never gets near this; a stream of
# invalid bytes does, and without the cap every call would re-decode all of it.
MAX_PENDING_TOKENS = 8


class IncrementalDetokenizer:
    """Streams the text of one request's output tokens, `update` by `update`, then `finish`.

    `tokenizer` is a Hugging Face tokenizer (anything with `decode(ids, skip_special_tokens=...)`).
    `stop` is the request's stop strings (`SamplingParams.stop`: a string, a list, or None).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        skip_special_tokens: bool = True,
        stop: str | Iterable[str] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        stops = [stop] if isinstance(stop, str) else list(stop or ())
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
        self.stop: tuple[str, ...] = tuple(dict.fromkeys(stops))  # unique, in the caller's order
        self._stop_hold = max((len(s) for s in self.stop), default=1) - 1  # longest proper prefix
        # all output ids seen (kept for `token_ids`; decodes only ever read a bounded tail of it)
        self._ids: list[int] = []
        # decoding layer: the window is ids[_prefix:]; ids before _read decode to final text, all of which
        # (and perhaps more) has been passed on: decode(ids[_prefix:])[:_released]
        self._prefix = 0
        self._read = 0
        self._released = 0
        # stop layer: decoded text not shown yet, because it may begin a stop string
        self._held = ""
        self._text_parts: list[str] = []
        self.stop_str_hit: str | None = None  # the stop string this detokenizer saw in the text
        self.finished = False

    # ------------------------------------------------------------------ public
    @property
    def stopped(self) -> bool:
        """True once a stop string appeared in the text: nothing after it is shown."""
        return self.stop_str_hit is not None

    @property
    def text(self) -> str:
        """Everything returned so far (the concatenation of all deltas)."""
        if len(self._text_parts) > 1:
            self._text_parts[:] = ["".join(self._text_parts)]
        return self._text_parts[0] if self._text_parts else ""

    @property
    def token_ids(self) -> list[int]:
        """Every output id passed to `update` (including any after a stop string)."""
        return list(self._ids)

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Add newly generated ids (any number, possibly none); return the text to show now.

        Never returns part of a character, text past a stop string, or a tail that may begin one.
        """
        if self.finished:
            raise RuntimeError("update() after finish()")
        if not new_token_ids:
            return ""
        self._ids.extend(int(t) for t in new_token_ids)
        if self.stopped:  # the text is over; later ids are kept but never decoded
            return ""
        return self._emit(self._decode_step(final=False))

    def finish(self, stop_str_hit: str | None = None) -> str:
        """End the request; return the text not shown yet.

        Pass the engine's `req.stop_str_hit` when it ended the request on a stop string: the text is
        then cut before that string (as `Engine.output_text` does). Otherwise (length, EOS, abort) the
        held-back text is flushed, including bytes that never formed a valid character (as U+FFFD).
        Calling it again returns "".
        """
        if self.finished:
            return ""
        if self.stopped:
            self.finished = True
            return ""
        tail = self._held + self._decode_step(final=True)
        self._held = ""
        out = self._stop_scan(tail)
        if out is None:  # no stop string of our own in the text: the engine's word decides
            out = tail
            if stop_str_hit is not None and stop_str_hit in tail:
                out = tail[: tail.find(stop_str_hit)]
                self.stop_str_hit = stop_str_hit
        self.finished = True
        return self._append(out)

    # ------------------------------------------------------------------ decoding layer
    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self._ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def _decode_step(self, *, final: bool) -> str:
        """Decoded text that became final since the last call (all of it when `final`)."""
        full = self._decode(self._prefix)
        end = len(full) if final else len(full.rstrip(REPLACEMENT))
        out = full[self._released : end]
        self._released = max(self._released, end)
        if final:
            return out
        if end == len(full):
            if len(self._ids) > self._read:
                self._advance()
        elif len(self._ids) - self._read > MAX_PENDING_TOKENS:
            out += self._force_advance(full)
        return out

    def _advance(self) -> None:
        """Everything decoded is final: start the window at the end, with a few tokens of context."""
        end = len(self._ids)
        start = max(self._read, end - CONTEXT_TOKENS)
        text = self._decode(start, end)
        # Prefer a context that starts on a character, not inside one (a byte-fallback decoder would
        # read the stray continuation bytes differently once more bytes follow). `_read` is one, and a
        # character starts at most 3 tokens back (4 bytes); byte-level decoding is right either way.
        for _ in range(3):
            if not text.startswith(REPLACEMENT) or start == self._read:
                break
            start -= 1
            text = self._decode(start, end)
        self._prefix, self._read, self._released = start, end, len(text)

    def _force_advance(self, full: str) -> str:
        """Too many undecided tokens (invalid bytes): commit at the last token boundary that splits the
        text cleanly, i.e. where decoding both sides separately gives the same text, so the bytes
        after it that may still complete a character stay undecided. Returns what that releases."""
        for k in range(len(self._ids) - 1, self._read, -1):
            right = self._decode(k)
            if right and full.endswith(right):
                left = self._decode(self._prefix, k)
                if left + right == full:
                    out = full[self._released : len(left)]
                    self._released = max(self._released, len(left)) - len(left)
                    self._prefix = self._read = k
                    return out
        return ""  # no clean boundary (a tokenizer whose decode is not byte-wise): keep waiting

    # ------------------------------------------------------------------ stop layer
    def _emit(self, decoded: str) -> str:
        """Pass newly decoded text through the stop-string filter; return what may be shown."""
        if not self.stop:
            return self._append(decoded)
        buf = self._held + decoded
        keep = self._longest_stop_prefix_suffix(buf)
        first = self._first_stop(buf)
        # A match is final unless a longer stop string that would start before it is still being
        # spelled out (stops "b" and "abc", text "ab": wait, "abc" may come and cut earlier).
        if first is not None and first[0] <= len(buf) - keep:
            self._held = ""
            self.stop_str_hit = first[1]
            return self._append(buf[: first[0]])
        self._held = buf[len(buf) - keep :]
        return self._append(buf[: len(buf) - keep])

    def _first_stop(self, buf: str) -> tuple[int, str] | None:
        """The earliest occurrence of a stop string in `buf` (the first listed on a tie), if any."""
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = buf.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def _stop_scan(self, buf: str) -> str | None:
        """If `buf` contains a stop string, record the first one and return the text before it."""
        first = self._first_stop(buf)
        if first is None:
            return None
        self.stop_str_hit = first[1]
        return buf[: first[0]]

    def _longest_stop_prefix_suffix(self, buf: str) -> int:
        """Length of the longest tail of `buf` that is a proper prefix of some stop string."""
        for n in range(min(self._stop_hold, len(buf)), 0, -1):
            tail = buf[len(buf) - n :]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def _append(self, delta: str) -> str:
        if delta:
            self._text_parts.append(delta)
        return delta
