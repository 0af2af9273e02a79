"""The text worker process: the tokenizer stage, the detokenizer stage or both in one process (the
process layout of `gapless.server.layout`)."""

from __future__ import annotations

from gapless.config import EngineConfig
from gapless.engine.heap import frozen_heap
from gapless.server import protocol as P
from gapless.server.router import Router
from gapless.server.workers.child import run_worker
from gapless.server.workers.detokenizer import DetokenizerStage
from gapless.server.workers.sockets import IDLE_POLL_MS, Endpoints, Sockets, replica_socket
from gapless.server.workers.tokenizer import PromptTokenizer, TokenizerStage

_FROM_SCHEDULER = (P.Updates, P.StatsOut)  # what the scheduler sends on: the detokenizer's messages


def text_worker_main(
    ends: Endpoints,
    cfg: EngineConfig,
    parent_pid: int,
    stages: tuple[str, ...],
    load_balance_method: str = "cache_aware",
) -> None:
    """A worker running the tokenizer stage, the detokenizer stage, or both (`stages`, in that order;
    see `gapless.server.layout`). Each stage binds its own address, so the API server and the scheduler
    send the same messages to the same places whatever the layout, and both stages run the same code
    alone or together; together, a message goes to the stage its type belongs to. The tokenizer stage
    routes each request to a data-parallel replica by `load_balance_method` (`gapless.server.router`)."""
    name = "+".join(stages)
    tokenize, detokenize = "tokenizer" in stages, "detokenizer" in stages
    binds = (ends.tokenizer,) * tokenize + (ends.detokenizer,) * detokenize
    push = {replica_socket(i): addr for i, addr in enumerate(ends.schedulers)} if tokenize else {}

    def body(socks: Sockets) -> None:
        from gapless.engine.images import image_prompter
        from gapless.model.source import load_tokenizer

        hf_tokenizer = load_tokenizer(cfg)
        router = Router(len(ends.schedulers), load_balance_method)
        prompter = image_prompter(cfg) if tokenize else None  # a vision-language model's processor
        tok = TokenizerStage(PromptTokenizer(hf_tokenizer, prompter), socks, router) if tokenize else None
        detok = DetokenizerStage(hf_tokenizer, socks) if detokenize else None
        with frozen_heap(collect=True):  # what start-up built lives as long as the process
            socks.send("api", P.Ready(name))
            while True:
                msg = socks.poll(tok.poll_ms() if tok is not None else IDLE_POLL_MS)
                if msg is not None:
                    if detok is not None and (tok is None or isinstance(msg, _FROM_SCHEDULER)):
                        detok.take(msg)
                    else:
                        assert tok is not None
                        tok.take(msg)
                if tok is not None:
                    tok.drain()

    run_worker(name, parent_pid, lambda: Sockets(binds, push, ends.apis), body)
