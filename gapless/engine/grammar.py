"""Structured output: a request's grammar (xgrammar), compiled once per schema, and its matcher.

A request with `json_schema`, `regex`, `ebnf`, `choice` or `json_object` (`SamplingParams`) gets a
`GrammarState` when it is queued (`Grammars.state`): an xgrammar `GrammarMatcher` over the compiled
grammar, which is cached by (kind, canonical text), so a repeated schema compiles once. The matcher
accepts each output token when the scheduler processes it (`GrammarState.advance`), and fills the next
token's allowed set into a bitmask row when a batch's mask is made (`gapless.engine.scheduler.masks`),
which the device applies before sampling (`gapless.sampling.mask`).

The matcher only ever sees processed output tokens, and a request's output is never taken back: a token
sampled for a request that finished meanwhile is dropped before it reaches the matcher, and retraction
drains the batches in flight before it sends a request back, keeping its output. So the matcher is right
as it is when a retracted request resumes: no rollback and no rebuild.

JSON is compact (xgrammar's `any_whitespace=False`): free whitespace between tokens would let a model
pad forever instead of closing its object. A grammar that reaches its end allows only the request's stop
tokens; it ends the request ("stop") even where those do not (`ignore_eos`).

`check_structured` compiles the grammar without a tokenizer (cheap, and possible in the API server), so
a bad schema, regex or grammar is refused before a request is queued, naming the field.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from gapless.sampling_params import SamplingParams

if TYPE_CHECKING:  # both imported when first needed: the API server checks grammars without torch
    import torch
    import xgrammar

CACHE_SIZE = 256  # compiled grammars kept (LRU); xgrammar's compiler caches its own work as well
_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\] \S+:\d+: ")  # "[15:39:43] /project/cpp/x.cc:83: "


def _source(name: str, value: Any) -> tuple[str, str]:
    """The grammar of structured-output field `name` as (kind, text) for xgrammar: a JSON schema's
    canonical JSON text, a regex, or an EBNF grammar (choices become an EBNF alternation of literals)."""
    if name == "json_object":
        return "json", '{"type": "object"}'
    if name == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from None
        if not isinstance(value, (dict, bool)):
            raise ValueError(f"json_schema must be a JSON object, got {type(value).__name__}")
        return "json", json.dumps(_no_control_chars(value), sort_keys=True)
    if name == "choice":
        return "ebnf", "root ::= " + " | ".join(f"({json.dumps(c, ensure_ascii=False)})" for c in value)
    return name, value  # regex, ebnf


def _no_control_chars(schema: Any) -> Any:
    """`schema` with each length-bounded plain string given the equivalent pattern that also keeps out
    control characters: xgrammar 0.2.8's rule for a string with minLength/maxLength lets raw control
    characters through, which JSON forbids (its plain-string rule is right)."""
    if isinstance(schema, list):
        return [_no_control_chars(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _no_control_chars(v) for k, v in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and bounded and not {"pattern", "format", "enum", "const"} & out.keys():
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = rf'^[^"\\\u0000-\u001f]{{{low},{high}}}$'
    return out


def _grammar(kind: str, text: str, field: str) -> xgrammar.Grammar:
    """xgrammar's `Grammar` of (kind, text); its refusal a ValueError naming `field`."""
    import xgrammar as xgr

    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(text, any_whitespace=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        return xgr.Grammar.from_ebnf(text)
    except Exception as e:  # noqa: BLE001 - whatever xgrammar refuses is the request's mistake
        message = _XGRAMMAR_PREFIX.sub("", str(e).strip())
        raise ValueError(f"{field} cannot be compiled: {message}") from None


def check_structured(params: SamplingParams, field: str | None = None) -> None:
    """Raise ValueError naming `field` (default: the params' own field) when `params`' structured-output
    constraint cannot be compiled."""
    spec = params.structured
    if spec is not None:
        name, value = spec
        try:
            source = _source(name, value)
        except ValueError as e:
            raise ValueError(str(e).replace(name, field or name, 1)) from None
        _grammar(*source, field=field or name)


class GrammarState:
    """One request's matcher. `advance` takes each processed output token; `fill` writes the next
    token's allowed set into a bitmask row."""

    def __init__(
        self, matcher: xgrammar.GrammarMatcher, after: bytes | None = None, vocab: list[bytes] | None = None
    ) -> None:
        self.matcher = matcher
        self.ended = False  # the grammar is complete (or refused a token): the request stops
        # `grammar_after` as bytes, and each token's bytes: until the output holds them, the grammar waits
        # (its tokens are free); matched on text, since a tokenizer may spell "</think>" several ways
        self.after, self.vocab, self.tail = after or None, vocab or [], b""
        # (ngram_min, ngram_max) once the request drafts under its grammar (gapless.engine.spec.grammar)
        self.ngram: tuple[int, int] | None = None

    def advance(self, token: int) -> bool:
        """Accept `token`; True when the grammar has ended, so the request must stop. A token the grammar
        refuses (only possible if it was sampled without the mask) ends it too."""
        if self.after is not None:
            piece = self.vocab[token] if token < len(self.vocab) else b""
            self.tail = (self.tail + piece)[-(len(self.after) + len(piece)) :]
            if self.after in self.tail:
                self.after = None
            return False
        if not self.ended and (not self.matcher.accept_token(token) or self.matcher.is_terminated()):
            self.ended = True
        return self.ended

    def fill(self, bits: torch.Tensor, index: int) -> None:
        """Row `index` of `bits` (int32 [m, words], all allowed) = the tokens the grammar allows next."""
        if not self.ended and self.after is None:
            self.matcher.fill_next_token_bitmask(bits, index)

    def fill_run(self, bits: torch.Tensor, index: int, drafts: list[int]) -> None:
        """Rows `index`, `index + 1`, ... of `bits`: the tokens allowed at each position of a verify whose
        inputs after the first are `drafts` (row o: after drafts[:o]); the rows after a draft the grammar
        refuses or ends on stay all allowed (`gapless.engine.spec.grammar`). The matcher is rolled back:
        it keeps only the processed tokens `advance` took."""
        self.fill(bits, index)
        if self.ended or self.after is not None:
            return
        taken = 0
        for o, token in enumerate(drafts, 1):
            if not self.matcher.accept_token(token):
                break
            taken += 1
            if self.matcher.is_terminated():
                break
            self.matcher.fill_next_token_bitmask(bits, index + o)
        if taken:
            self.matcher.rollback(taken)


class Grammars:
    """Compiles requests' grammars against the engine's tokenizer (lazily: xgrammar is imported with the
    first constrained request) and keeps the compiled ones by (kind, text)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Iterable[int]) -> None:
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._vocab: list[bytes] = []  # each token's bytes (xgrammar's decoded vocabulary)
        self._compiled: OrderedDict[tuple[str, str], xgrammar.CompiledGrammar] = OrderedDict()

    def _compile(self, kind: str, text: str, field: str) -> xgrammar.CompiledGrammar:
        key = (kind, text)
        compiled = self._compiled.get(key)
        if compiled is not None:
            self._compiled.move_to_end(key)
            return compiled
        grammar = _grammar(kind, text, field)  # refuses a bad one, naming the field
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_ids or None
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            self._vocab = list(info.decoded_vocab)
        compiled = self._compiler.compile_grammar(grammar)
        self._compiled[key] = compiled
        if len(self._compiled) > CACHE_SIZE:
            self._compiled.popitem(last=False)
        return compiled

    def state(self, params: SamplingParams, stop_ids: Iterable[int]) -> GrammarState | None:
        """The matcher of a request queued with `params` and `stop_ids` (None: its output is free), or
        ValueError naming the field whose grammar cannot be compiled. The grammar ends on the request's
        stop tokens, else (`ignore_eos` with none) on EOS."""
        spec = params.structured
        if spec is None:
            return None
        import xgrammar as xgr

        compiled = self._compile(*_source(*spec), field=spec[0])
        stops = sorted(stop_ids) or self.eos_ids
        after = params.grammar_after.encode() if params.grammar_after else None
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops or None)
        return GrammarState(matcher, after, self._vocab)

    def allocated(self) -> int:
        """Compiled grammars kept."""
        return len(self._compiled)


def check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    """ValueError naming logit_bias when one of its token ids is outside the vocabulary."""
    bad = [t for t in params.logit_bias or () if t >= vocab_size]
    if bad:
        raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
