"""Incremental detokenization: token ids in, text deltas out, stop strings honoured.

One `IncrementalDetokenizer` per request turns its output ids into text wherever text is needed: the
scheduler (`StopStrings`, to stop a request on a stop string), the server's detokenizer process and the
chat (to stream it), and `Engine.output_text` (all at once). Two layers, each holding back only what it
must:

1. Decoding. Byte-level BPE splits a multi-byte character ("é", "€", emoji, CJK) across tokens, and a
   decode that ends mid-character ends in U+FFFD. Each step decodes a bounded window of token ids,
   `ids[prefix:]`, and settles the part of it past what was settled before, except a trailing run of
   U+FFFD, which may still turn into a real character when the next bytes arrive. Text before that run
   is final: appending bytes only changes how the last, incomplete sequence decodes. Once the window
   decodes cleanly (no trailing U+FFFD), `read` moves to the end, and once the window is long enough
   `prefix` moves to a few tokens before the end (the context that keeps decoders which strip a
   leading space, such as SentencePiece's, consistent). Every decode is over O(new tokens + a small
   constant) ids, and a step of one token costs about one decode.

2. Stop strings (`gapless.engine.stop`, where the rule is written down). With stop strings, ids are
   decoded one token at a time, however many arrive together, since the rule is per token; the
   settled text goes through a `StopMatcher`, which holds back a tail that could begin a stop string.

A server step brings new tokens for every running request at once. `update_many` is `update` over all of
them, its decodes made together: one call into the tokenizer's Rust decoder for the step's windows
(`Decoder.many`), not one Python-wrapped `tokenizer.decode` per request; requests with stop strings take
one token a round, as their rule requires. (`update` keeps its own loop: one request's update through
`update_many` costs twice as much, and the scheduler's stop-string check runs it per token.)

The concatenation of every delta `update` and `finish` return is `tokenizer.decode(all_ids,
skip_special_tokens=...)`, cut as the stop rule says (OpenAI semantics: the stop string itself is not
returned); without stop strings, exactly the one-shot decode.

The guarantees hold for decoders whose output is a left-to-right function of the bytes (byte-level
BPE: Llama 3, Qwen, GPT-2, and this project's test tokenizer). SentencePiece's byte-fallback decoder
turns a whole run of byte tokens into U+FFFD when any of them is invalid, and `clean_up_tokenization_
spaces` rewrites text across token boundaries; for those the deltas are still whole characters, but
garbage bytes or cleaned-up spaces may come out differently from a one-shot decode. Where a request
stops, and its text with stop strings, are still the same for every user: each runs this code on the
same ids, one token at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol
from weakref import WeakKeyDictionary

from gapless.engine.request import Req
from gapless.engine.stop import StopMatcher

REPLACEMENT = "\ufffd"

# Tokens of context kept when the window moves up. Enough for decoders that treat the first token of a
# decode specially (SentencePiece drops its leading space).
CONTEXT_TOKENS = 4
# A window that decodes cleanly moves up once it spans more than this many tokens: until then a step
# costs one short decode, not two (moving up decodes the new window once to find its offset).
WINDOW_TOKENS = 8
# Undecided tokens (past the read offset, decoding to a trailing U+FFFD) tolerated before the window is
# forced forward. A UTF-8 character is at most 4 bytes, so valid text never gets near this; a stream of
# invalid bytes does, and without the cap every call would re-decode all of it.
MAX_PENDING_TOKENS = 8


class TokenDecoder(Protocol):
    """What the detokenizer needs of a tokenizer (a Hugging Face tokenizer is one)."""

    # transformers declares `str | list[str]` (a list for a batch of id lists); one id list decodes to a str
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str | list[str]: ...


def _text(decoded: str | list[str]) -> str:
    """The text of one id list's decode (`TokenDecoder.decode` of a flat list is a str)."""
    if not isinstance(decoded, str):
        raise TypeError(f"decoding one list of token ids gave {type(decoded).__name__}, not str")
    return decoded


class Decoder:
    """`tokenizer.decode`, one id list at a time (`one`) or many in one call (`many`).

    A Hugging Face fast tokenizer's `decode` is its Rust decoder behind a layer of Python (argument
    conversion, keyword handling, an optional clean-up of spaces), which costs more than the decode of a
    few tokens itself. Where that layer changes nothing (the tokenizer's class keeps transformers' own
    `decode`, and `clean_up_tokenization_spaces` is off, as for Llama 3, Qwen and byte-level BPE
    tokenizers generally), this calls the Rust decoder directly, and `many` decodes a whole list in one
    call (`tokenizers.Tokenizer.decode_batch`). A sample of ids is decoded both ways first; any
    difference, or any other tokenizer, keeps `tokenizer.decode`. `Decoder.of` keeps one per tokenizer.
    """

    _made: WeakKeyDictionary[Any, Decoder] = WeakKeyDictionary()

    def __init__(self, tokenizer: TokenDecoder, rust: bool = True) -> None:
        self.tokenizer = tokenizer
        self.backend = _rust_decoder(tokenizer) if rust else None

    @classmethod
    def of(cls, tokenizer: TokenDecoder) -> Decoder:
        """The decoder of `tokenizer`, made once (its check decodes a sample); a tokenizer that cannot be
        weakly referenced keeps its own `decode`, without the check."""
        try:
            decoder = cls._made.get(tokenizer)
        except TypeError:
            return cls(tokenizer, rust=False)
        if decoder is None:
            decoder = cls._made[tokenizer] = cls(tokenizer)
        return decoder

    def one(self, ids: list[int], skip_special_tokens: bool) -> str:
        if self.backend is not None:
            return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return _text(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def many(self, seqs: list[list[int]], skip_special_tokens: bool) -> list[str]:
        if self.backend is not None:
            return self.backend.decode_batch(seqs, skip_special_tokens=skip_special_tokens)
        return [_text(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)) for ids in seqs]


def _rust_decoder(tokenizer: TokenDecoder) -> Any:
    """The `tokenizers.Tokenizer` whose `decode` gives exactly `tokenizer.decode`'s text, or None."""
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:
        return None
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        return None
    cls = type(tokenizer)
    if not (
        cls.decode is PreTrainedTokenizerBase.decode
        and cls._decode is PreTrainedTokenizerFast._decode
        and not tokenizer.clean_up_tokenization_spaces
    ):
        return None
    backend = tokenizer.backend_tokenizer
    # every id of a small vocabulary, else a spread of it, special tokens included, in short runs
    n = len(tokenizer)
    ids = sorted({*range(min(n, 512)), *range(0, n, max(1, n // 512)), *tokenizer.all_special_ids})
    sample = [ids[i : i + 3] for i in range(0, len(ids), 3)]
    for skip in (True, False):
        if backend.decode_batch(sample, skip_special_tokens=skip) != [
            tokenizer.decode(s, skip_special_tokens=skip) for s in sample
        ]:
            return None
    return backend


class IncrementalDetokenizer:
    """Streams the text of one request's output tokens, `update` by `update`, then `finish`.

    `stop` is the request's stop strings (`SamplingParams.stop`: a string, a list, or None).
    """

    def __init__(
        self,
        tokenizer: TokenDecoder,
        *,
        skip_special_tokens: bool = True,
        stop: str | Iterable[str] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.decoder = Decoder.of(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.matcher = StopMatcher(stop)
        # all output ids seen (decodes only ever read a bounded tail of it)
        self._ids: list[int] = []
        # the window is ids[_prefix:]; ids before _read decode to final text, all of which (and perhaps
        # more) has been settled: decode(ids[_prefix:])[:_settled]
        self._prefix = 0
        self._read = 0
        self._settled = 0
        # the window is long and decodes cleanly: move it up (`_advance`) before the next decode
        self._advance_due = False
        self._text_parts: list[str] = []
        self.finished = False

    # ------------------------------------------------------------------ public
    @property
    def stop_str_hit(self) -> str | None:
        """The stop string the text ended on, if any."""
        return self.matcher.hit

    @property
    def stopped(self) -> bool:
        """True once a stop string appeared in the text: nothing after it is shown."""
        return self.matcher.hit is not None

    @property
    def text(self) -> str:
        """Everything returned so far (the concatenation of all deltas)."""
        if len(self._text_parts) > 1:
            self._text_parts[:] = ["".join(self._text_parts)]
        return self._text_parts[0] if self._text_parts else ""

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Add newly generated ids (any number, possibly none); return the text to show now.

        Never returns part of a character, text past a stop string, or a tail that may begin one.
        """
        if self.finished:
            raise RuntimeError("update() after finish()")
        step = 1 if self.matcher.stops else max(1, len(new_token_ids))  # the stop rule is per token
        out = []
        for i in range(0, len(new_token_ids), step):
            self._ids.extend(int(t) for t in new_token_ids[i : i + step])
            if not self.stopped:  # after a stop, ids are kept but never decoded
                out.append(self.matcher.feed(self._settle(self._decode(self._prefix), final=False)))
                if self._advance_due:
                    self._advance()
        return self._append("".join(out))

    def finish(self) -> str:
        """End the request; return the text not shown yet: the held-back text, including bytes that
        never formed a valid character (as U+FFFD), cut before a stop string if one is in it. Calling
        it again returns ""."""
        if self.finished:
            return ""
        self.finished = True
        if self.stopped:
            return ""
        return self._append(self.matcher.flush(self._settle(self._decode(self._prefix), final=True)))

    # ------------------------------------------------------------------ decoding
    def _decode(self, start: int, end: int | None = None) -> str:
        return self.decoder.one(self._ids[start:end], self.skip_special_tokens)

    def _settle(self, full: str, *, final: bool) -> str:
        """The text of `full`, the window's decode (`ids[_prefix:]`), that became final since the last call
        (all of it when `final`). Moving the window up, when it is long and decodes cleanly, is left due
        (`_advance_due`) for the caller, who may decode the new window's start with other requests'."""
        end = len(full) if final else len(full.rstrip(REPLACEMENT))
        out = full[self._settled : end]
        self._settled = max(self._settled, end)
        if final:
            return out
        if end == len(full):  # all of the window is final
            self._read = len(self._ids)
            self._advance_due = self._read - self._prefix > WINDOW_TOKENS
        elif len(self._ids) - self._read > MAX_PENDING_TOKENS:
            out += self._force_advance(full)
        return out

    def _window(self) -> list[int]:
        """The ids whose decode `_settle` takes: the window, `ids[_prefix:]`."""
        return self._ids[self._prefix :]

    def _advance_window(self) -> list[int]:
        """The ids whose decode `_advance` starts from."""
        return self._ids[len(self._ids) - CONTEXT_TOKENS :]

    def _advance(self, text: str | None = None) -> None:
        """The window is long and all of it final: start it a few tokens of context before the end.
        `text`: the decode of `_advance_window()`, when the caller made it."""
        self._advance_due = False
        end = len(self._ids)
        start = end - CONTEXT_TOKENS
        if text is None:
            text = self._decode(start, end)
        # Prefer a context that starts on a character, not inside one (a byte-fallback decoder would
        # read the stray continuation bytes differently once more bytes follow). A character starts at
        # most 3 tokens back (4 bytes); byte-level decoding is right either way.
        for _ in range(3):
            if not text.startswith(REPLACEMENT) or start == self._prefix:
                break
            start -= 1
            text = self._decode(start, end)
        self._prefix, self._settled = start, len(text)

    def _force_advance(self, full: str) -> str:
        """Too many undecided tokens (invalid bytes): commit at the last token boundary that splits the
        text cleanly, i.e. where decoding both sides separately gives the same text, so the bytes
        after it that may still complete a character stay undecided. Returns what that settles."""
        for k in range(len(self._ids) - 1, self._read, -1):
            right = self._decode(k)
            if right and full.endswith(right):
                left = self._decode(self._prefix, k)
                if left + right == full:
                    out = full[self._settled : len(left)]
                    self._settled = max(self._settled, len(left)) - len(left)
                    self._prefix = self._read = k
                    return out
        return ""  # no clean boundary (a tokenizer whose decode is not byte-wise): keep waiting

    def _append(self, delta: str) -> str:
        if delta:
            self._text_parts.append(delta)
        return delta


def detokenize(
    tokenizer: TokenDecoder, ids: Sequence[int], *, stop: Iterable[str] | None, skip_special_tokens: bool
) -> str:
    """The whole text of `ids` at once: with stop strings, exactly what a stream of them shows (the ids
    go through one at a time); without, the one-shot decode."""
    det = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens, stop=stop)
    return det.update(ids) + det.finish()


def update_many(dets: Sequence[IncrementalDetokenizer], new_ids: Sequence[Sequence[int]]) -> list[str]:
    """`det.update(ids)` for each detokenizer and its new ids (one step's, for many requests), with their
    decodes made together: the ids go in rounds, all of a request's at once without stop strings and one
    a round with them (the stop rule is per token), and each round decodes every window in one call per
    tokenizer and `skip_special_tokens` setting (`Decoder.many`), then the windows that move up in one
    more. A request's ids after a stop string are kept but never decoded."""
    todo: list[tuple[int, Sequence[int]]] = []
    for i, (det, ids) in enumerate(zip(dets, new_ids, strict=True)):
        if det.finished:
            raise RuntimeError("update() after finish()")
        if len(ids):
            todo.append((i, ids))
    out = [""] * len(dets)
    while todo:
        decode, later = [], []
        for i, ids in todo:
            det = dets[i]
            if det.matcher.stops and not det.stopped and len(ids) > 1:  # one token this round
                later.append((i, ids[1:]))
                ids = ids[:1]
            det._ids.extend(int(t) for t in ids)
            if not det.stopped:
                decode.append(i)
        windows = _decode_grouped(dets, decode, IncrementalDetokenizer._window)
        for i in decode:
            det = dets[i]
            out[i] += det.matcher.feed(det._settle(windows[i], final=False))
        due = [i for i in decode if dets[i]._advance_due]
        for i, text in _decode_grouped(dets, due, IncrementalDetokenizer._advance_window).items():
            dets[i]._advance(text)
        todo = later
    return [det._append(text) for det, text in zip(dets, out)]


def _decode_grouped(
    dets: Sequence[IncrementalDetokenizer],
    which: list[int],
    window: Callable[[IncrementalDetokenizer], list[int]],
) -> dict[int, str]:
    """The decode of `window(dets[i])` for each i in `which`: one `Decoder.many` call per decoder and
    `skip_special_tokens` setting (a server has one tokenizer, so one or two calls)."""
    groups: dict[tuple[int, bool], list[int]] = {}
    for i in which:
        groups.setdefault((id(dets[i].decoder), dets[i].skip_special_tokens), []).append(i)
    texts: dict[int, str] = {}
    for (_, skip), members in groups.items():
        decoded = dets[members[0]].decoder.many([window(dets[i]) for i in members], skip)
        texts.update(zip(members, decoded, strict=True))
    return texts


class StopStrings:
    """The scheduler's stop-string check: a detokenizer per request with stop strings, fed each token
    as it is processed (a few tokens decoded per token, never the whole output)."""

    def __init__(self, tokenizer: TokenDecoder) -> None:
        self.tokenizer = tokenizer
        # held weakly: an entry goes with its request however that ends (an abort included)
        self._detoks: WeakKeyDictionary[Req, IncrementalDetokenizer] = WeakKeyDictionary()

    def check(self, req: Req, tok: int, last: bool) -> str | None:
        """Feed the request's new token `tok`; return the stop string its text ended on, if any.
        `last`: the request ends with this token anyway (EOS, a stop token, its length), so all of its
        text is settled and is searched too."""
        det = self._detoks.get(req)
        if det is None:
            p = req.params
            det = self._detoks[req] = IncrementalDetokenizer(
                self.tokenizer, skip_special_tokens=p.skip_special_tokens, stop=p.stop
            )
        det.update([tok])
        if last:
            det.finish()
        if last or det.stopped:
            del self._detoks[req]
        return det.stop_str_hit
