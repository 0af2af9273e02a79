"""Messages between the server's processes, as msgspec structs encoded with msgpack.

    API server --TokenizeReq/Abort/StatsReq--> tokenizer --SchedReq/Abort/StatsReq--> scheduler
    scheduler --Updates/StatsOut--> detokenizer --Deltas/StatsOut--> API server
    tokenizer --Refused--> API server
    any worker --ReqError/Ready/Failed--> API server
    scheduler replica --ReplicaReport--> tokenizer (data parallelism: what the router needs to know)
    API server 0 --Serve--> API server k (`--api-server-count`: start serving HTTP)

Every control message from the API server travels through the tokenizer, so an abort can never
overtake the request it aborts. With several API server processes (`--api-server-count N`), what goes
back to "the API server" goes to the one that submitted the request (`api_server_of`, `to_api_servers`);
`Ready` and `Failed` go to API server 0, the one that started the others. Decoding is typed: a peer can
only ever produce these structs (no pickle, no arbitrary objects), and a malformed frame raises
`msgspec.DecodeError`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from gapless.sampling_params import SamplingParams


class ChatMessage(msgspec.Struct):
    role: str
    content: str
    # tool calling (gapless.server.tools): an assistant's calls, a tool result's call id and name
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    # a message with images: its parts in order, text ({"type": "text", "text": ...}) and {"type": "image"}
    parts: list[dict[str, str]] | None = None


class ImageChat(msgspec.Struct):
    """A chat with images: its messages (image parts in `ChatMessage.parts`) and the images' encoded
    bytes, in order, checked by the API server (`gapless.engine.image_io`)."""

    messages: list[ChatMessage]
    images: list[bytes]


class PromptIn(msgspec.Struct):
    """One prompt as the client gave it: text, token ids, or a chat to render with the chat template
    (with `images`: a vision-language model's, through its processor)."""

    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    images: list[bytes] | None = None


class TensorBytes(msgspec.Struct):
    dtype: str  # torch's name without "torch."
    shape: list[int]
    data: bytes


class ImageIn(msgspec.Struct):
    """One image of a prompt, processed (`gapless.engine.images.PromptImage`)."""

    start: int
    length: int
    key: int
    inputs: list[TensorBytes]


class LoRAIn(msgspec.Struct):
    """The LoRA adapter a request runs with (`gapless.lora.LoRARequest`'s fields)."""

    name: str
    id: int
    path: str


class TokenizeReq(msgspec.Struct, tag=True):
    """One HTTP request's engine requests, tokenized together so that all of them reach the scheduler or
    none does. Engine request `rids[i * n + j]` is prompt i's choice j, sampled with `params[j]`
    (n = len(params)); each distinct prompt crosses the socket, and is tokenized, once."""

    rids: list[str]
    prompts: list[PromptIn]
    params: list[SamplingParams]
    max_prompt_tokens: int  # the longest prompt the scheduler takes (its context holds one more token)
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the chat template
    lora: LoRAIn | None = None  # the adapter every one of them runs with; None: the base model


class SchedReq(msgspec.Struct, tag=True):
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    images: list[ImageIn] | None = None
    lora: LoRAIn | None = None


class Abort(msgspec.Struct, tag=True):
    rid: str


class StatsReq(msgspec.Struct, tag=True):
    ticket: int
    api_server: int = 0  # the API server process that asked: its answer goes back there


Stats = dict[str, float | int | str]  # the engine's counters (`Engine.get_stats`) and the integrity check


class StatsOut(msgspec.Struct, tag=True):
    ticket: int
    stats: Stats
    api_server: int = 0  # the asking StatsReq's


class ReqUpdate(msgspec.Struct):
    """New tokens of one request since its last update (and its end, when finished)."""

    rid: str
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    # set on a request's first update only (later ones keep the defaults): what the detokenizer needs to
    # know of it
    stop: list[str] | None = None
    skip_special_tokens: bool = True
    # with prompt_logprobs, on the request's first update: the prompt, the first scored position, and per
    # scored position (logprob, rank, [(id, logprob)] top k)
    prompt_ids: list[int] | None = None
    prompt_logprobs_start: int = 1
    prompt_logprobs: list[tuple[float, int, list[tuple[int, float]]]] | None = None
    # a pooling model's request, on its last update: its embedding or [score] (gapless.engine.pooling)
    pooled: list[float] | None = None


class Updates(msgspec.Struct, tag=True):
    updates: list[ReqUpdate]


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    top: list[tuple[str, int, float]]  # (text, id, logprob), most likely first


class PromptLogprobs(msgspec.Struct):
    """A prompt's tokens and logprobs, decoded: what echo and the prompt-logprob fields answer with."""

    text: str  # the prompt's token ids decoded
    ids: list[int]
    tokens: list[str]  # each token's text
    start: int  # the first scored position; `logprobs`, `ranks` and `top` start there
    logprobs: list[float]
    ranks: list[int]
    top: list[list[tuple[str, int, float]]]  # (text, id, logprob), most likely first


class ReqDelta(msgspec.Struct):
    """What the API server streams: text decoded since the last delta."""

    rid: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    prompt: PromptLogprobs | None = None  # on the first delta, when the request asked for prompt logprobs
    pooled: list[float] | None = None  # a pooling model's request, on its last delta: embedding or [score]


# What accumulates when deltas are merged: a field added to ReqDelta that grows token by token belongs here
_JOINED = frozenset({"text", "token_ids", "logprobs"})


def merge_deltas(first: ReqDelta, later: ReqDelta) -> ReqDelta:
    """One delta of a request saying what `first` and then `later` say: text, tokens and logprobs
    joined; every other field (the counts, the finish reason, a field only one of them carries) the
    later's where it has one. What a stream sends when its client is behind (`Group.next_deltas`)."""
    values = {}
    for name in first.__struct_fields__:
        a, b = getattr(first, name), getattr(later, name)
        if name in _JOINED and a is not None and b is not None:
            values[name] = a + b
        else:
            values[name] = a if b is None else b
    return ReqDelta(**values)


class Deltas(msgspec.Struct, tag=True):
    deltas: list[ReqDelta]


class ReqError(msgspec.Struct, tag=True):
    """A request refused by a worker (bad prompt, too long, ...): `status` is the HTTP status to answer."""

    rid: str
    message: str
    status: int = 400
    param: str | None = None


class Refused(msgspec.Struct, tag=True):
    """The tokenizer refused a whole HTTP request (`TokenizeReq.rids`) before any of it reached the
    scheduler: one message, so the API server closes all of its engine requests at once."""

    rids: list[str]
    message: str
    status: int = 400
    param: str | None = None


class SchedulerInfo(msgspec.Struct):
    """What the scheduler tells the API server once, when ready: for `/v1/models` and the ready line."""

    max_context: int
    kv_tokens: int
    device: str
    vocab_size: int
    chunked_prefill_size: int  # as chosen for the device (gapless.engine.defaults), for the ready line
    weights: str = ""  # the weights' format and bytes (gapless.model.quant.weights_summary)
    quantization: str | None = None  # the layers' quantized format(s) (RunnerInfo's)
    weight_formats: dict[str, int] = msgspec.field(default_factory=dict)  # format -> layers holding it
    # a pooling model's (gapless.engine.pooling): its task (embed, score) and whether vectors are
    # normalized, and a phrase for the ready line; "generate" for a generative model
    task: str = "generate"
    normalize: bool = False
    pooling: str = ""
    # a vision-language model: images per prompt and pixels per image it takes; (0, 0): a text model
    image_limits: tuple[int, int] = (0, 0)
    kv_cache: str = ""  # the KV cache's element type and bytes per token (KVPool.summary)


class ReplicaReport(msgspec.Struct, tag=True):
    """A data-parallel replica's news for the router in the tokenizer (`gapless.server.router`): its KV
    size once, when ready, then the requests that left it (finished, or refused when added)."""

    replica: int
    done: list[str]
    kv_tokens: int | None = None


class Ready(msgspec.Struct, tag=True):
    worker: str
    info: SchedulerInfo | None = None  # the scheduler's; the other workers send none


class Failed(msgspec.Struct, tag=True):
    """A worker's failure, with its traceback. `refusal`: a ValueError's message (the configuration or
    checkpoint refused, as a worker found while it started): the server prints that line alone."""

    worker: str
    error: str
    refusal: str = ""


class Serve(msgspec.Struct, tag=True):
    """API server 0 to another API server process, once every worker is ready: serve HTTP, with what the
    scheduler reported and every process's pid (for `/debug/state`)."""

    info: SchedulerInfo
    worker_pids: dict[str, int]


Message = (
    (TokenizeReq | SchedReq | Abort | StatsReq | StatsOut | Updates | Deltas | ReqError | Refused)
    | Ready
    | Failed
    | ReplicaReport
    | Serve
)


def request_id(api_server: int, base: str) -> str:
    """The rid prefix of an HTTP request's engine requests, from the API server process that submits it:
    `base` for API server 0, `k.base` for API server k (`base` has no dot)."""
    return f"{api_server}.{base}" if api_server else base


def api_server_of(rid: str) -> int:
    """The API server process that submitted engine request `rid` (`request_id`)."""
    head, dot, _ = rid.partition(".")
    return int(head) if dot else 0


def to_api_servers(msg: Message, count: int) -> list[tuple[int, Message]]:
    """Where a worker's message to "the API server" goes when there are `count` API server processes:
    (index, message) pairs. A `Deltas` is split by the requests' API servers (one message to each that
    has deltas in it, in their order); a refusal, an error or stats go to the one that asked; `Ready` and
    `Failed` to API server 0."""
    if count == 1:
        return [(0, msg)]
    if isinstance(msg, Deltas):
        split: dict[int, list[ReqDelta]] = {}
        for d in msg.deltas:
            split.setdefault(api_server_of(d.rid), []).append(d)
        return [(k, Deltas(deltas)) for k, deltas in split.items()]
    if isinstance(msg, ReqError):
        return [(api_server_of(msg.rid), msg)]
    if isinstance(msg, Refused):  # one HTTP request's rids: one API server's
        return [(api_server_of(msg.rids[0]) if msg.rids else 0, msg)]
    if isinstance(msg, StatsOut):
        return [(msg.api_server, msg)]
    return [(0, msg)]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(frame: bytes) -> Message:
    return _decoder.decode(frame)
