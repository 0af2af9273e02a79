"""Interactive chat in the terminal: `gapless chat [MODEL]`.

Drives an in-process `Engine` one step at a time, so each step's new tokens are shown as soon as they
are sampled (through `IncrementalDetokenizer`: whole characters only, stop strings cut). The
conversation is kept as chat messages and re-rendered with the tokenizer's chat template every turn;
the engine's prefix cache makes the repeated history cheap. `/reset` forgets the history, `/exit`,
`/quit` or end of input (Ctrl-D) quits, and Ctrl-C while a reply streams stops that reply. With a
vision-language model, `--image FILE` (repeatable) sends images with the first message (and again with the
first after `/reset`); the prefix cache keys them by content, so the history's images are not re-run.

The engine is imported where it is used, so the command line's parser (`add_chat_args`) loads no torch.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gapless.cli import add_engine_args, add_model_args, config_from_args
from gapless.sampling_params import SamplingParams

if TYPE_CHECKING:
    from gapless.config import EngineConfig
    from gapless.engine.engine import Engine
    from gapless.engine.images import PromptImage

EXIT_COMMANDS = ("/exit", "/quit")
RESET_COMMAND = "/reset"
HELP_TEXT = "commands: /reset (forget the conversation), /exit or /quit (or Ctrl-D); Ctrl-C stops a reply\n"


def end_of_turn_ids(tokenizer: Any) -> list[int]:
    """The special token the chat template closes an assistant turn with (ChatML's <|im_end|>, Llama
    3's <|eot_id|>), found by rendering a turn; [] when there is none or no template.

    Chat models stop on it, but not every checkpoint lists it among its EOS ids."""
    mark = "\x00reply\x00"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": mark}], tokenize=False
        )
    except Exception:  # no template, or one that insists on other roles: nothing to add
        return []
    if not isinstance(text, str) or mark not in text:
        return []
    after = tokenizer.encode(text.split(mark, 1)[1], add_special_tokens=False)
    special = set(tokenizer.all_special_ids)
    return [after[0]] if after and after[0] in special else []


@contextlib.contextmanager
def _ctrl_c_as_flag() -> Iterator[Callable[[], bool]]:
    """While inside, Ctrl-C sets a flag instead of raising: an interrupt landing inside an engine step
    would leave the engine's state half-moved (it then refuses to go on). Yields a check of the flag."""
    hit = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield hit.is_set  # signal handlers can only be set from the main thread
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: hit.set())
    try:
        yield hit.is_set
    finally:
        signal.signal(signal.SIGINT, previous)


@dataclass
class Turn:
    """What one reply produced: the text shown and how the request ended."""

    text: str
    prompt_tokens: int
    output_ids: list[int]
    finish_reason: str


@dataclass
class ChatSession:
    """A conversation with an engine: the message history and how to extend it by one reply. `images`
    (PIL images or paths, a vision-language model's) go with the conversation's first user message."""

    engine: Engine
    params: SamplingParams = field(default_factory=SamplingParams)
    system: str | None = None
    images: list[Any] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if not getattr(self.engine.tokenizer, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat template; chat needs one")
        if self.images:
            from gapless.engine.image_io import open_image

            limits = self.engine.image_prompter().limits  # (a ValueError for a text model)
            self.images = [open_image(im, f"--image {im}", limits) for im in self.images]
        stop_ids = self.params.stop_token_ids or []  # (a list already: SamplingParams normalises it)
        extra = [t for t in end_of_turn_ids(self.engine.tokenizer) if t not in stop_ids]
        if extra:  # a copy: the caller's params stay as they were
            self.params = dataclasses.replace(self.params, stop_token_ids=[*stop_ids, *extra])
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def prompt_ids(self, messages: list[dict[str, Any]] | None = None) -> list[int]:
        """The token ids of the conversation so far, ending with an open assistant turn."""
        return self.prompt(self.messages if messages is None else messages)[0]

    def prompt(self, messages: list[dict[str, Any]]) -> tuple[list[int], tuple[PromptImage, ...]]:
        """`messages`' token ids, ending with an open assistant turn, and their images (a vision-language
        model's processor renders them)."""
        if self.engine.vision is None:
            from gapless.engine.chat_template import render_chat

            return self.engine.tokenize(render_chat(self.engine.tokenizer, messages)[1]), ()
        from gapless.engine.image_io import split_chat

        prompter = self.engine.image_prompter()
        ids, images = prompter.render(*split_chat(messages, prompter.limits))
        return self.engine.tokenize(ids), images

    def user_message(self, text: str) -> dict[str, Any]:
        """The next user message: with the session's images if it is the conversation's first."""
        if not self.images or any(m["role"] == "user" for m in self.messages):
            return {"role": "user", "content": text}
        parts = [{"type": "image", "image": im} for im in self.images]
        return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}

    def send(self, user_text: str, write: Callable[[str], Any] = lambda s: None) -> Turn:
        """Add a user message, stream the reply through `write` delta by delta, and keep both in the
        history. Raises ValueError (history unchanged) when the conversation no longer fits."""
        from gapless.engine.detokenize import IncrementalDetokenizer

        messages = [*self.messages, self.user_message(user_text)]
        ids, images = self.prompt(messages)
        engine = self.engine
        req = engine.add_request(ids, self.params, images=images)
        detok = IncrementalDetokenizer(
            engine.tokenizer, skip_special_tokens=self.params.skip_special_tokens, stop=self.params.stop
        )
        seen = 0
        with _ctrl_c_as_flag() as interrupted:
            while not req.finished:
                if interrupted():  # stop this reply between steps, keep what was shown
                    engine.abort(req.rid)
                engine.step()
                if len(req.output_ids) > seen:
                    delta = detok.update(req.output_ids[seen:])
                    seen = len(req.output_ids)
                    if delta:
                        write(delta)
        delta = detok.update(req.output_ids[seen:]) + detok.finish()
        if delta:
            write(delta)
        self.messages = [*messages, {"role": "assistant", "content": detok.text}]
        return Turn(detok.text, len(ids), list(req.output_ids), req.finish_reason or "abort")


def run_chat(
    engine: Engine,
    params: SamplingParams | None = None,
    *,
    input_fn: Callable[[str], str] = input,
    write: Callable[[str], Any] | None = None,
    flush: Callable[[], Any] | None = None,
    system: str | None = None,
    prompt: str = ">>> ",
    images: list[Any] | None = None,
) -> ChatSession:
    """The read-reply loop until `/exit`, `/quit` or end of input; returns the session (its history).

    `input_fn(prompt)` reads a line (raises EOFError at the end), `write` shows text (default: stdout,
    flushed), `flush` (if given) is called after every delta so the reply streams through buffered
    output too. `images` go with the first message (`ChatSession`).
    """
    if write is None:
        write, flush = sys.stdout.write, sys.stdout.flush
    session = ChatSession(engine, params or SamplingParams(max_tokens=512), system, list(images or ()))

    def show(text: str) -> None:
        write(text)
        if flush is not None:
            flush()

    while True:
        try:
            line = input_fn(prompt)
        except EOFError:
            show("\n")
            break
        except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh prompt, as shells do
            show("\n")
            continue
        text = line.strip()
        if not text:
            continue
        if text in EXIT_COMMANDS:
            break
        if text == RESET_COMMAND:
            session.reset()
            show("(history cleared)\n")
            continue
        if text in ("/help", "/?"):
            show(HELP_TEXT)
            continue
        try:
            turn = session.send(line, show)
        except ValueError as e:  # the conversation outgrew the context: say so, keep the history
            show(f"error: {e}; /reset starts over\n")
            continue
        show("\n" if turn.finish_reason != "abort" else " [stopped]\n")
    return session


# ---------------------------------------------------------------------------- command line


def add_chat_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `chat` subcommand's options: the model, sampling, and every engine option as `serve` has
    them (`--device`, `--disable-overlap`, `--max-model-len`, `--seed`, ...)."""
    add_model_args(parser)
    parser.add_argument("--system", default=None, help="system prompt")
    parser.add_argument(
        "--image",
        action="append",
        default=None,
        metavar="FILE",
        help="an image sent with the first message (repeatable; a vision-language model's)",
    )
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument(
        "--max-tokens", type=int, default=512, help="longest reply, in tokens (default: 512)"
    )
    # left out: the checkpoint's default (its generation_config.json), else the library's, as the server's
    unset = "default: the checkpoint's, else"
    sampling.add_argument("--temperature", type=float, default=None, help=f"0 for greedy ({unset} 1)")
    sampling.add_argument(
        "--top-p", type=float, default=None, help=f"nucleus sampling's mass ({unset} 1: off)"
    )
    sampling.add_argument(
        "--top-k", type=int, default=None, help=f"sample among the k likeliest ({unset} -1: all)"
    )
    sampling.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    add_engine_args(parser)
    return parser


SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "stop")  # each a SamplingParams field


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    """The reply's sampling options; those not given stay unset (the checkpoint's defaults apply)."""
    return SamplingParams(**{name: getattr(args, name) for name in SAMPLING_FLAGS})


def chat_main(
    args: argparse.Namespace,
    *,
    input_fn: Callable[[str], str] = input,
    write: Callable[[str], Any] | None = None,
) -> int:
    """Run `gapless chat` for parsed `args`; returns the exit status: 2 for bad arguments, a checkpoint
    that cannot run, a device that is not there or an `--image` that cannot be sent, found before
    anything loads. The engine is shut down after."""
    from gapless.engine.engine import Engine
    from gapless.engine.preflight import check_engine_config

    try:
        params = sampling_from_args(args)
        # the model made local (fetched, downloaded) and checked: a model that cannot be is a ValueError
        cfg, _ = check_engine_config(config_from_args(args))
        images = _open_images(getattr(args, "image", None) or [], cfg)
    except ValueError as e:
        print(f"gapless chat: {e}", file=sys.stderr)
        return 2
    engine = Engine(cfg)
    try:
        (write or sys.stdout.write)(f"gapless chat: {engine.cfg.model} ({HELP_TEXT.rstrip()})\n")
        run_chat(engine, params, input_fn=input_fn, write=write, system=args.system, images=images)
    finally:
        engine.shutdown()
    return 0


def _open_images(paths: list[str], cfg: EngineConfig) -> list[Any]:
    """`--image` files opened and checked against the limits (`ImageError`, a ValueError, naming the
    flag); a ValueError if there are some and the model takes no images."""
    if not paths:
        return []
    from gapless.engine.image_io import ImageLimits, check_count, open_image
    from gapless.model.config import load_model_config

    if load_model_config(cfg.model).vision is None:
        raise ValueError(f"--image: {cfg.model} is a text model, it takes no images")
    limits = ImageLimits.of(cfg)
    images = [open_image(p, f"--image {p}", limits) for p in paths]
    check_count(len(images), limits, "--image")
    return images


def main(argv: list[str] | None = None) -> int:
    """`python -m gapless.chat [options]`, the same as `gapless chat`."""
    from gapless.__main__ import main as gapless_main

    return gapless_main(["chat", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
