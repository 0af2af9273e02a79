"""The tokenizer process's stage: each HTTP request's prompts become token ids (`PromptTokenizer`: chat
template, limits) and go to a scheduler (`TokenizerStage`: the router picks the data-parallel replica),
long ones tokenized on a background thread so they never hold up the others. It runs in the process of
`gapless.server.workers.text_worker`."""

from __future__ import annotations

import inspect
import queue
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import msgspec

from gapless.server import protocol as P
from gapless.server.errors import prompt_too_long
from gapless.server.images import to_wire
from gapless.server.router import Router
from gapless.server.tools import template_message
from gapless.server.workers.replica_report import apply_report
from gapless.server.workers.sockets import IDLE_POLL_MS, Sockets, replica_socket

if TYPE_CHECKING:  # imported where it runs, so importing this module loads no transformers
    from transformers import PreTrainedTokenizerBase

    from gapless.engine.images import ImagePrompter

INLINE_CHARS = 16_384  # a request with more text than this is tokenized on the background thread
NFC_MERGE = 4  # NFC composes at most this many code points into one (the longest canonical decomposition)
BUSY_POLL_MS = 5  # while the background thread works, the loop looks for its results this often


class _Refusal(Exception):
    """A prompt the tokenizer cannot pass on: the whole request is refused with this message (a 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class PromptTokenizer:
    """Turns one HTTP request's `TokenizeReq` into a `SchedReq` per engine request, or refuses the whole
    request (`Refused`) if any of its prompts cannot be served, so none of it reaches the scheduler.

    Text that cannot fit is refused before it is tokenized (a 10 MB prompt would hold the tokenizer for
    seconds and its memory for good). No token covers more characters than the longest vocabulary entry
    has (`max_token_chars`: special tokens included, and a byte-level entry's length counts its bytes,
    never fewer than the characters it decodes to), and the NFC normalisation some tokenizers apply merges
    at most NFC_MERGE characters into one: so a text longer than max_prompt_tokens * max_token_chars *
    NFC_MERGE characters needs more tokens than the context holds."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompter: ImagePrompter | None = None) -> None:
        """`prompter`: a vision-language model's processor, for chats with images."""
        self.tokenizer = tokenizer
        self.prompter = prompter
        self.max_token_chars = max(len(token) for token in tokenizer.get_vocab())
        # apply_chat_template's own arguments: chat_template_kwargs must not set them (tokenize=True, ...)
        # (but `tools`: the request's tools travel there, gapless.server.tools)
        self.reserved = frozenset(inspect.signature(tokenizer.apply_chat_template).parameters) - {"tools"}
        self.reserved |= {"messages"}

    def max_chars(self, max_prompt_tokens: int) -> int:
        return max_prompt_tokens * self.max_token_chars * NFC_MERGE

    def handle(self, req: P.TokenizeReq) -> list[P.Message]:
        """The request's `SchedReq`s (engine request i * n + j: prompt i, choice j), or one `Refused`."""
        try:
            made = [self.prompt(prompt, req) for prompt in req.prompts]
        except _Refusal as e:
            return [P.Refused(req.rids, str(e), param=e.param)]
        except Exception as e:  # noqa: BLE001 - a template or tokenizer error is the request's
            return [P.Refused(req.rids, f"could not tokenize the prompt: {e}", param="prompt")]
        n = len(req.params)
        return [
            P.SchedReq(rid, made[k // n][0], req.params[k % n], made[k // n][1], req.lora)
            for k, rid in enumerate(req.rids)
        ]

    def prompt(self, prompt: P.PromptIn, req: P.TokenizeReq) -> tuple[list[int], list[P.ImageIn] | None]:
        """A prompt's token ids (`prompt_ids`), or a chat with images through the model's processor, its
        placeholders expanded, and its images."""
        if prompt.images is None:
            return self.prompt_ids(prompt, req), None
        if self.prompter is None:
            raise _Refusal("this model takes no images (a text model)", "messages")
        from gapless.engine.image_io import open_image

        clash = sorted(set(req.chat_template_kwargs or ()) & self.reserved)
        if clash:
            raise _Refusal(f"chat_template_kwargs may not set {clash}", "chat_template_kwargs")
        chat = []
        for m in prompt.messages or ():
            msg = template_message(msgspec.structs.asdict(m))
            if m.parts is not None:
                msg["content"] = msg.pop("parts")
            chat.append(msg)
        limits = self.prompter.limits
        images = [open_image(b, f"messages (image {i})", limits) for i, b in enumerate(prompt.images)]
        ids, made = self.prompter.render(chat, images, req.chat_template_kwargs)
        if len(ids) > req.max_prompt_tokens:
            raise _Refusal(prompt_too_long(len(ids), req.max_prompt_tokens), "messages")
        return ids, to_wire(made)

    def prompt_ids(self, prompt: P.PromptIn, req: P.TokenizeReq) -> list[int]:
        """A prompt's token ids: given (the API server checked them), a chat rendered with the template,
        or text encoded; refused if empty or longer than the scheduler takes."""
        if prompt.token_ids is not None:
            return prompt.token_ids
        if prompt.messages is not None:  # the template places its own special tokens
            text, specials, param = self._render(prompt.messages, req.chat_template_kwargs), False, "messages"
        else:
            text, specials, param = prompt.text or "", True, "prompt"
        limit = self.max_chars(req.max_prompt_tokens)
        if len(text) > limit:
            raise _Refusal(
                f"{param} is {len(text)} characters, more than the {limit} that can fit in "
                f"{req.max_prompt_tokens} tokens with this tokenizer; it was not tokenized",
                param,
            )
        ids = self.tokenizer.encode(text, add_special_tokens=specials) if text else []
        if not ids:
            raise _Refusal(f"{param} is empty", param)
        if len(ids) > req.max_prompt_tokens:
            raise _Refusal(prompt_too_long(len(ids), req.max_prompt_tokens), param)
        return ids

    def _render(self, messages: list[P.ChatMessage], kwargs: dict[str, Any] | None) -> str:
        from gapless.engine.chat_template import NoChatTemplate, chat_text

        clash = sorted(set(kwargs or ()) & self.reserved)
        if clash:
            raise _Refusal(f"chat_template_kwargs may not set {clash}", "chat_template_kwargs")
        chat = [template_message(msgspec.structs.asdict(m)) for m in messages]
        try:
            return chat_text(self.tokenizer, chat, chat_template_kwargs=kwargs)
        except NoChatTemplate:
            raise _Refusal(
                "this model has no chat template, so it cannot take chat requests; "
                "send the prompt as text to /v1/completions instead",
                "messages",
            ) from None


def _text_chars(req: P.TokenizeReq) -> int:
    """How much text a request brings: what decides whether it is tokenized in the background."""
    return sum(len(p.text or "") + sum(len(m.content) for m in p.messages or ()) for p in req.prompts)


class _Background:
    """A thread that tokenizes the requests with much text, so that one long tokenization never holds up
    the others (the Rust tokenizer releases the GIL while it works). A daemon: a SIGTERM never waits for it.
    """

    def __init__(self, work: Callable[[P.TokenizeReq], list[P.Message]]) -> None:
        self.todo: queue.SimpleQueue[P.TokenizeReq] = queue.SimpleQueue()
        self.results: queue.SimpleQueue[tuple[P.TokenizeReq, list[P.Message]]] = queue.SimpleQueue()
        self.rids: set[str] = set()  # of the requests given to it and not yet taken back
        threading.Thread(target=self._run, args=(work,), name="gapless-tokenize", daemon=True).start()

    def _run(self, work: Callable[[P.TokenizeReq], list[P.Message]]) -> None:
        while True:
            req = self.todo.get()
            self.results.put((req, work(req)))

    def give(self, req: P.TokenizeReq) -> None:
        self.rids.update(req.rids)
        self.todo.put(req)

    def take(self) -> Iterator[tuple[P.TokenizeReq, list[P.Message]]]:
        """The requests it has finished, with their messages."""
        while not self.results.empty():
            req, out = self.results.get()
            self.rids.difference_update(req.rids)
            yield req, out


class TokenizerStage:
    """The tokenizer's part of a worker: each `TokenizeReq` becomes its `SchedReq`s (or one `Refused`),
    long ones on the background thread; aborts and stats requests follow the requests to the scheduler.
    With data-parallel replicas, `router` picks each request's replica, an abort follows its request
    there, and a stats request goes to every replica."""

    def __init__(self, tokenizer: PromptTokenizer, socks: Sockets, router: Router) -> None:
        self.tokenizer, self.socks, self.router = tokenizer, socks, router
        self.background = _Background(tokenizer.handle)
        self.aborted: set[str] = set()  # rids aborted while their request was in the background

    def poll_ms(self) -> int:
        """How long the worker may wait for a message: not long while the background thread works."""
        return BUSY_POLL_MS if self.background.rids else IDLE_POLL_MS

    def take(self, msg: P.Message) -> None:
        if isinstance(msg, P.TokenizeReq) and _text_chars(msg) > INLINE_CHARS:
            self.background.give(msg)
        elif isinstance(msg, P.TokenizeReq):
            self._send(self.tokenizer.handle(msg))
        elif isinstance(msg, P.ReplicaReport):
            apply_report(self.router, msg)
        elif isinstance(msg, P.Abort):  # in order behind its request, to its replica
            if msg.rid in self.background.rids:
                self.aborted.add(msg.rid)
            replica = self.router.replica_of(msg.rid)
            self.router.done(msg.rid)
            if replica is not None:
                self.socks.send(replica_socket(replica), msg)
        else:  # StatsReq: every replica answers
            for replica in range(self.router.replicas):
                self.socks.send(replica_socket(replica), msg)

    def _send(self, out: list[P.Message]) -> None:
        for msg in out:
            if isinstance(msg, P.SchedReq):
                self.socks.send(replica_socket(self.router.route(msg.rid, msg.prompt_ids)), msg)
            else:
                self.socks.send("api", msg)

    def drain(self) -> None:
        """Send on what the background thread finished (never what was aborted meanwhile)."""
        for req, out in self.background.take():
            if self.aborted.isdisjoint(req.rids):
                self._send(out)
            self.aborted.difference_update(req.rids)
