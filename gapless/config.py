"""The engine's options in one dataclass, `EngineConfig`: every option, its default, its help (the field's
`metadata["help"]`, which the command line prints: `gapless.cli`) and its check. The server's own options
(host, port, API key) are its launcher's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from gapless import env

SCHEDULE_POLICIES = ("fcfs", "lpm")
CPU_WORKERS = ("auto", "inline", "thread", "process")
ATTENTION_BACKENDS = ("auto", "torch", "triton")  # see gapless.attention.make_backend
FUSED_KERNELS = ("auto", "torch", "triton")  # see gapless.model.fused.use_fused_kernels
SPECULATIVE_ALGORITHMS = ("ngram", "draft")  # gapless.engine.spec
# the KV cache's element types, by vLLM's names (gapless.memory.kv_pool.kv_cache_dtype): float8 e4m3's two
# and float8 e5m2's, each scaled per layer
E4M3_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")
E5M2_KV_CACHE_DTYPE = "fp8_e5m2"
FP8_KV_CACHE_DTYPES = (*E4M3_KV_CACHE_DTYPES, E5M2_KV_CACHE_DTYPE)
UNQUANTIZED_KV_CACHE_DTYPES = ("bfloat16", "bf16")  # (vLLM's name; SGLang's too, and its short one)
KV_CACHE_DTYPES = ("auto", *UNQUANTIZED_KV_CACHE_DTYPES, *FP8_KV_CACHE_DTYPES)
NO_CHUNKING = -1  # chunked_prefill_size (SGLang's): the budget the context length (`engine.preflight`)
# --load-format's values, vLLM's names (gapless.engine.preflight)
LOAD_FORMATS = ("auto", "dummy", "safetensors", "gguf", "bitsandbytes")
# --task's names (vLLM's and SGLang's too) and the task each means (gapless.engine.pooling)
TASK_NAMES = {
    "auto": "auto",
    "generate": "generate",
    "embed": "embed",
    "embedding": "embed",
    "score": "score",
    "rerank": "score",
    "classify": "score",
    "pooling": "pooling",
}
POOLING_TYPES = ("last", "mean", "cls")


DEFAULT_MAX_IMAGES = 8  # images per prompt (limit_mm_per_prompt)
DEFAULT_MAX_PIXELS = 4096 * 4096  # pixels per image (max_image_pixels)


def parse_limit_mm(text: str) -> int:
    """Images per prompt from vLLM's `--limit-mm-per-prompt` syntax: `image=N` or `{"image": N}`; other
    modalities are refused by name, but at 0 (`video=0`: none asked for)."""
    import json

    text = text.strip()
    try:
        pairs = json.loads(text) if text.startswith("{") else dict(p.split("=", 1) for p in text.split(","))
    except ValueError:
        raise ValueError(f'{text!r}: expected image=N or a JSON object such as {{"image": N}}') from None
    unknown = sorted(k for k, v in pairs.items() if k != "image" and str(v).strip() != "0")
    if unknown:
        raise ValueError(f"{text!r}: only images are taken (not {', '.join(unknown)})")
    try:
        n = int(pairs.get("image", DEFAULT_MAX_IMAGES))
    except (TypeError, ValueError):
        raise ValueError(f"{text!r}: the image count must be an integer") from None
    if n < 0:
        raise ValueError(f"{text!r}: the image count must be >= 0")
    return n


def option(default: Any = MISSING, help: str = "", *, factory: Callable[[], Any] | None = None) -> Any:  # noqa: A002
    """An `EngineConfig` field: its `default` (or a `factory` making it) and its `help`, one sentence or
    two that the command line prints for its flag (`field.metadata["help"]`)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


def _on_cuda(device: str) -> bool:
    """Whether `device` names CUDA (or "auto" picks it here). Imports torch: call only when it matters."""
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return device.startswith("cuda")


@dataclass
class EngineConfig:
    """Every engine option, with its default and its help; `__post_init__` checks them (a `ValueError`
    naming the option)."""

    model: str = option(
        help="a checkpoint directory, a GGUF file (or a directory holding one), a built-in name, or a "
        "Hugging Face id (gapless.model.source)"
    )
    device: str = option("auto", "auto: cuda when available, else cpu")
    dtype: str = option(
        "auto",
        "auto: checkpoint dtype on GPU (bfloat16 for a float16 int4 checkpoint torch's int4 decode GEMM "
        "takes), float32 on CPU",
    )
    kv_cache_dtype: str = option(
        "auto",
        "the KV cache's element type (vLLM's flag): auto: the checkpoint's own where its ModelOpt "
        "config names FP8 (as vLLM), else the model's dtype; bfloat16 (or SGLang's bf16): the model's "
        "dtype, whatever the checkpoint says; fp8 or fp8_e4m3: float8 e4m3 with per-layer k/v scales from "
        "the checkpoint (else 1.0), twice the tokens per byte; fp8_e5m2: float8 e5m2, scaled the same way "
        "(wider range, one mantissa bit fewer; any GPU, where e4m3 needs sm_89+)",
    )
    quantization: str | None = option(
        None,
        "the weights' quantized format (vLLM's names): fp8 quantizes a float checkpoint's linear layers "
        "to fp8 e4m3 at load (one scale per output row; activations per token), bitsandbytes to NF4 in "
        "blocks of 64 (vLLM's in-flight 4-bit), rtn to int8 or int4 by round-to-nearest (RTN_NUM_BITS, "
        "RTN_GROUP_SIZE), experts_int8 a mixture's experts alone to int8; None: the checkpoint's "
        "own (config.json's quantization_config: fp8, compressed-tensors, awq, gptq, modelopt, "
        "fbgemm_fp8, bitsandbytes, quark; or hf_quant_config.json, quantize_config.json, quant_config.json), "
        "else float; the checkpoint's own name, or vLLM's or SGLang's kernel for it (awq_marlin, "
        "awq_triton, gptq_marlin, gptq_bitblas, moe_wna16, ipex, modelopt_fp4, modelopt_mxfp8, w8a8_fp8, "
        "w8a8_int8), runs the checkpoint as it is (w8a8_fp8 quantizes a float one as fp8), as gguf does a "
        "GGUF file. A format the device cannot run is refused before any weight loads "
        "(gapless.model.quant.formats)",
    )
    load_format: str = option(
        "auto",
        "auto: the checkpoint's weights; dummy: random weights in the checkpoint's shape, none read (as "
        "vLLM's --load-format dummy: for benchmarks, with a config.json and a tokenizer only); "
        "safetensors, gguf or bitsandbytes (vLLM's names): auto, for a checkpoint of that kind (another is "
        "refused)",
    )
    page_size: int = option(1, "tokens per KV cache page; the prefix cache shares whole pages")
    radix_cache: bool = option(True, "reuse the KV cache of shared prompt prefixes (a radix tree)")
    chunked_prefill_size: int | None = option(
        None,
        "token budget of one prefill batch; longer prompts are chunked. None: chosen for the device "
        "at start-up (gapless.engine.defaults: 2048 on CPU; on CUDA by GPU memory, 16384 from 60 GiB "
        "up); -1 (SGLang's): no prompt chunked, the budget the context length",
    )
    max_running_requests: int = option(256, "most requests running (decoding) at once")
    kv_cache_tokens: int | None = option(
        None,
        "the KV cache's size in tokens; None: sized from mem_fraction_static (CUDA) or "
        "kv_cache_memory_gib (CPU); a number overrides that, on any device",
    )
    mem_fraction_static: float = option(
        0.85,
        "CUDA: share of the GPU's total memory for weights + KV cache (as SGLang's); the KV pool gets"
        " what the weights leave of it, less what the measured activation peak and the CUDA graphs "
        "need",
    )
    kv_cache_memory_gib: float | None = option(
        None,
        "CPU only: the KV cache's size in GiB; None: 4 (as vLLM's CPU backend), or half the available"
        " RAM where that is less. Never more than max_running_requests full rows can use",
    )
    attention_backend: str = option(
        "auto",
        "auto: triton on CUDA (when it imports), torch on CPU; torch: the reference; triton: the "
        "Triton kernels (on CPU only under TRITON_INTERPRET=1, for tests)",
    )
    fused_kernels: str = option(
        "auto",
        "the decoder's norms, RoPE + KV store and activations: auto: fused Triton kernels on CUDA "
        "when they agree with torch at start-up (else torch, with a logged reason), torch on CPU; "
        "torch; triton (on CPU only under TRITON_INTERPRET=1, for tests). Checked when the model is "
        "loaded",
    )
    cuda_graph_max_bs: int | None = option(
        None,
        "decode batches of up to this many requests replay CUDA graphs (padded to a captured size); "
        "0: off; None: 256 on CUDA with a kernel backend, off otherwise. On CPU a positive value runs"
        " the same padded static-buffer path eagerly (tests)",
    )
    piecewise_cuda_graph_max_tokens: int = option(
        0,
        "extend (prefill) batches of up to this many tokens run through piecewise CUDA graphs (the "
        "decoder captured between its attentions, `gapless.engine.piecewise_graph`; SGLang's flag); "
        "0: off, the default until a GPU run has measured them. On CPU a positive value runs the same"
        " padded pieces eagerly (tests)",
    )
    schedule_policy: str = option(
        "lpm", "which waiting request starts first: lpm (longest cached prefix) or fcfs"
    )
    max_model_len: int | None = option(
        None,
        "context length; None: the model's max_position_embeddings. More than that is refused unless "
        "GAPLESS_ALLOW_LONG_MAX_MODEL_LEN=1 (then with a warning)",
    )
    seed: int = option(0, "draws the seeds of requests that bring none, so a run is reproducible")
    overlap: bool = option(
        factory=lambda: not env.DISABLE_OVERLAP.get(),
        help="overlap scheduling: the host schedules batch N+1 and processes batch N-1 while the device "
        "runs N; its default is on unless GAPLESS_DISABLE_OVERLAP is",
    )
    cpu_worker: str = option(
        "auto",
        "where the device side runs on a CPU: inline, thread (a worker thread) or process (a device "
        "process); auto: the device process when overlapping on a machine with at least 4 cores, else"
        " inline",
    )
    cpu_compile: bool = option(
        False,
        "CPU: compile the decode step's decoder layers with torch.compile (inductor's C++ kernels) at "
        "start-up, a few fused kernels a layer instead of hundreds of small torch ops; minutes the first "
        "time, cached on disk after (gapless.engine.cpu_compile)",
    )
    device_threads: int | None = option(
        None,
        "torch threads of the device side; None: torch's default (a pinned device process: one per "
        "core it has)",
    )
    cpu_affinity: bool = option(
        True,
        "CPU device process: pin the host to one core and the device to the others (undone when it closes)",
    )
    chaos_seed: int | None = option(
        None,
        "testing only: seeded random delays on both sides of the device stream, and a runner that "
        "raises when a decode reads an unwritten future-token slot (a host sync per decode); see "
        "engine/stream/chaos.py",
    )
    trace_path: str | None = option(
        None, "write a Chrome/Perfetto trace of host and device spans here on shutdown"
    )
    revision: str | None = option(None, "a Hugging Face model's branch, tag or commit")
    download_dir: str | None = option(None, "where Hugging Face downloads go; None: the Hugging Face cache")
    tokenizer: str | None = option(
        None, "a separate tokenizer (path or Hugging Face id); None: the model's own"
    )
    chat_template: str | None = option(None, "a template file or the template itself; None: the tokenizer's")
    mmproj: str | None = option(
        None,
        "a GGUF model's vision projector file (llama.cpp's --mmproj); none: no projector (a text model); "
        "None: the one in the model file's directory, if any",
    )
    trust_remote_code: bool = option(
        False, "vLLM's flag, taken with a warning: gapless runs no code from a checkpoint, only its own"
    )
    generation_config: str = option(
        "auto",
        "sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty) of requests that "
        "leave them unset: auto: the checkpoint's generation_config.json (or a GGUF's sampling "
        "metadata); vllm: none (the library's defaults, as vLLM's --generation-config vllm); or a "
        "folder holding a generation_config.json",
    )
    task: str = option(
        "auto",
        "what the model serves: generate (text); embed (/v1/embeddings, and cosine /v1/score and "
        "/v1/rerank); score (a causal-LM reranker scored by score_token's logit: /v1/score, /v1/rerank); "
        "pooling (vLLM's --runner pooling): score with a score_token, else embed; auto: embed for a "
        "sentence-transformers checkpoint (modules.json), else generate. embedding, rerank and classify "
        "are names for embed, score, score",
    )
    pooling_type: str | None = option(
        None,
        "embed: which hidden states make the vector: last (the last token's), mean or cls (the first "
        "token's); None: the sentence-transformers pooling config's, else last",
    )
    normalize: bool | None = option(
        None,
        "embed: divide each vector by its L2 norm; None: as the sentence-transformers checkpoint says "
        "(a Normalize module), else on",
    )
    score_token: str | None = option(
        None, "score: the token whose logit at a pair's last token scores it, e.g. yes (its sigmoid)"
    )
    score_false_token: str | None = option(
        None,
        "score: a second token, e.g. no: the score is then the first's probability against it, "
        "sigmoid(logit(true) - logit(false)), as Qwen3-Reranker's",
    )
    score_template: str | None = option(
        None,
        "score: a file or the template itself, with {query} and {document}, that makes a pair's prompt; "
        "None: the checkpoint's score_template.txt, else the query then the document",
    )
    init_new_token_ratio: float = option(
        0.7,
        "scheduler tuning (SGLang's defaults): the expected share of max_tokens a request will really use",
    )
    min_new_token_ratio: float = option(0.14, "the lowest that expected share decays to")
    new_token_ratio_decay_steps: int = option(600, "steps over which the expected share decays to its lowest")
    speculative_algorithm: str | None = option(
        None,
        "speculative decoding (gapless.engine.spec): ngram drafts each request's next tokens from its"
        " own prompt and output (prompt lookup); draft runs a small model with the same tokenizer "
        "(speculative_draft_model); both verify the drafts in one forward of the target; None: off",
    )
    speculative_num_draft_tokens: int = option(
        4, "tokens drafted per request and step (the verify runs one more)"
    )
    speculative_draft_model: str | None = option(None, "the draft model of speculative_algorithm=draft")
    ngram_min: int = option(1, "shortest suffix of a request's tokens that ngram matches earlier in them")
    ngram_max: int = option(4, "longest such suffix (the longest that matches wins, then the latest match)")
    speculative_disable_batch_size: int = option(
        16,
        "decode batches larger than this run without drafts (verifying K+1 tokens per request stops paying)",
    )
    tensor_parallel_size: int = option(
        1,
        "tensor parallelism (gapless.engine.tp): the model split over this many ranks, one process "
        "each (gloo on the CPU, NCCL on CUDA: one GPU per rank), the scheduler running once, on rank "
        "0's node",
    )
    nnodes: int = option(1, "machines the ranks span (each runs tensor_parallel_size / nnodes of them)")
    node_rank: int = option(0, "this machine's place: 0 serves (HTTP, scheduler), the others run ranks only")
    dist_init_addr: str | None = option(
        None,
        "host:port where rank 0 listens for the others (needed with nnodes > 1; default there: "
        "torchrun's MASTER_ADDR:MASTER_PORT); None on one machine: a free local port",
    )
    dist_timeout: float = option(
        60.0,
        "seconds a rank waits for the others (start-up, each collective) before the engine ends with "
        "an error",
    )
    limit_mm_per_prompt: str = option(
        f"image={DEFAULT_MAX_IMAGES}",
        'images one prompt may bring (a vision-language model), in vLLM\'s syntax: image=N or {"image": N}',
    )
    max_image_pixels: int = option(
        DEFAULT_MAX_PIXELS, "the most pixels (width x height) an image may have, checked before it is decoded"
    )
    data_parallel_size: int = option(
        1,
        "data parallelism: engine replicas (a scheduler + model process each, on its own device or "
        "CPU cores) behind one API server, requests routed by --load-balance-method "
        "(gapless.server.router); server only",
    )

    enable_lora: bool = option(False, "serve LoRA adapters (PEFT) beside the base model (gapless.lora)")
    max_loras: int = option(4, "LoRA adapters resident on the device at once (their rows share a batch)")
    max_cpu_loras: int | None = option(
        None, "LoRA adapters kept read in host memory, least recently used out; None: max_loras"
    )
    max_lora_rank: int = option(64, "the highest LoRA rank an adapter may have (the device table's width)")
    lora_experts: bool = option(
        True,
        "a mixture of experts: hold LoRA slots for its experts too (max_loras x experts x both ranks of "
        "each projection: tens of GB on a 30B mixture at the defaults); off: adapters of the experts are "
        "refused by name, attention and dense layers still adapt",
    )

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name}={getattr(self, name)!r}: {why}")

        if self.page_size < 1:
            raise bad("page_size", "must be >= 1")
        if self.chunked_prefill_size not in (None, NO_CHUNKING) and self.chunked_prefill_size < 1:
            raise bad("chunked_prefill_size", f"must be >= 1, or {NO_CHUNKING}: no chunking")
        if self.max_running_requests < 1:
            raise bad("max_running_requests", "must be >= 1")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.page_size:
            raise bad("kv_cache_tokens", f"must hold at least one page ({self.page_size} tokens)")
        if self.kv_cache_memory_gib is not None and not self.kv_cache_memory_gib > 0:
            raise bad("kv_cache_memory_gib", "must be > 0")
        if not 0 < self.mem_fraction_static <= 1:  # (1: vLLM's whole GPU; the free memory still bounds it)
            raise bad("mem_fraction_static", "must be in (0, 1]")
        if self.load_format not in LOAD_FORMATS:
            raise bad("load_format", f"must be one of {LOAD_FORMATS}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise bad("attention_backend", f"must be one of {ATTENTION_BACKENDS}")
        self._check_kv_cache_dtype(bad)
        self._check_graphs(bad)
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise bad("schedule_policy", f"must be one of {SCHEDULE_POLICIES}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise bad("max_model_len", "must be >= 2")
        if self.cpu_worker not in CPU_WORKERS:
            raise bad("cpu_worker", f"must be one of {CPU_WORKERS}")
        if self.device_threads is not None and self.device_threads < 1:
            raise bad("device_threads", "must be >= 1")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise bad("device", "must be auto, cpu, cuda or cuda:N")
        self._check_speculative(bad)
        self._check_parallel(bad)
        self._check_lora(bad)
        self._check_task(bad)
        self._check_images(bad)

    def _check_lora(self, bad: Any) -> None:
        """The LoRA options' sizes in range."""
        if self.max_loras < 1:
            raise bad("max_loras", "must be >= 1")
        if not 1 <= self.max_lora_rank <= 512:
            raise bad("max_lora_rank", "must be in [1, 512]")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise bad("max_cpu_loras", f"must be >= max_loras ({self.max_loras})")

    def _check_task(self, bad: Any) -> None:
        """The pooling options (gapless.engine.pooling): a known task and pooling type (each name made
        gapless's), score tokens with the score task only, no speculative decoding for a pooling model."""
        if self.task not in TASK_NAMES:
            raise bad("task", f"must be one of {tuple(TASK_NAMES)}")
        self.task = TASK_NAMES[self.task]
        if self.pooling_type is not None:
            if self.pooling_type.lower() not in POOLING_TYPES:
                raise bad("pooling_type", f"must be one of {POOLING_TYPES}")
            self.pooling_type = self.pooling_type.lower()
        if self.task == "score" and self.score_token is None:
            raise bad("task", "score needs score_token (--score-token yes): the token whose logit scores")
        if self.score_token is None and self.score_false_token is not None:
            raise bad("score_false_token", "needs score_token, the true token")
        if self.score_token is not None and self.task not in ("score", "pooling", "auto"):
            raise bad("score_token", "is for task score (a causal-LM reranker)")
        if self.task in ("embed", "score", "pooling") and self.speculative_algorithm is not None:
            raise bad("speculative_algorithm", f"does not apply to a pooling model (task {self.task})")

    def _check_images(self, bad: Any) -> None:
        if self.max_image_pixels < 1:
            raise bad("max_image_pixels", "must be >= 1")
        try:
            parse_limit_mm(self.limit_mm_per_prompt)
        except ValueError as e:
            raise bad("limit_mm_per_prompt", str(e)) from None

    def _check_kv_cache_dtype(self, bad: Any) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise bad("kv_cache_dtype", f"must be one of {KV_CACHE_DTYPES}")

    def _check_graphs(self, bad: Any) -> None:
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 0:
            raise bad("cuda_graph_max_bs", "must be >= 0 (0 turns CUDA graphs off)")
        if self.piecewise_cuda_graph_max_tokens < 0:
            raise bad("piecewise_cuda_graph_max_tokens", "must be >= 0 (0 turns them off)")
        if self.cpu_compile and (self.enable_lora or self.tensor_parallel_size > 1):
            raise bad("cpu_compile", "runs without LoRA and with tensor_parallel_size 1 only for now")
        if self.piecewise_cuda_graph_max_tokens and self.tensor_parallel_size > 1:
            raise bad("piecewise_cuda_graph_max_tokens", "runs with tensor_parallel_size 1 only for now")

    def _check_parallel(self, bad: Any) -> None:
        """The parallelism options: at least one data-parallel replica; for tensor parallelism, sizes in
        range, ranks spread evenly over the nodes, an address where several nodes must meet (torchrun's
        MASTER_ADDR/MASTER_PORT when none is given)."""
        if self.data_parallel_size < 1:
            raise bad("data_parallel_size", "must be >= 1")
        if self.data_parallel_size > 1 and self.tensor_parallel_size > 1 and _on_cuda(self.device):
            raise bad(
                "data_parallel_size",
                "> 1 with tensor_parallel_size > 1 runs on the CPU only for now: on CUDA every replica's "
                "ranks would take the same GPUs",
            )
        if self.tensor_parallel_size < 1:
            raise bad("tensor_parallel_size", "must be >= 1")
        if self.nnodes < 1:
            raise bad("nnodes", "must be >= 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise bad("node_rank", f"must be in [0, nnodes) = [0, {self.nnodes})")
        if self.tensor_parallel_size % self.nnodes:
            raise bad("nnodes", f"must divide tensor_parallel_size ({self.tensor_parallel_size})")
        if not self.dist_timeout > 0:
            raise bad("dist_timeout", "must be > 0")
        if self.dist_init_addr is None and self.nnodes > 1 and (master := env.MASTER_ADDR.get()) is not None:
            self.dist_init_addr = f"{master}:{env.MASTER_PORT.get()}"
        if self.dist_init_addr is None:
            if self.nnodes > 1:
                raise bad("dist_init_addr", "is needed with nnodes > 1: rank 0's host:port")
            return
        host, _, port = self.dist_init_addr.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise bad("dist_init_addr", "must be host:port")

    def _check_speculative(self, bad: Any) -> None:
        "''The speculative-decoding options: a known algorithm, sizes in range, and no half-built mode.''"
        algo = self.speculative_algorithm
        if algo is not None and algo not in SPECULATIVE_ALGORITHMS:
            raise bad("speculative_algorithm", f"must be one of {SPECULATIVE_ALGORITHMS}")
        if (algo == "draft") != (self.speculative_draft_model is not None):
            raise bad(
                "speculative_draft_model",
                "is the draft model of speculative_algorithm='draft', which needs one and no other uses",
            )
        if not 1 <= self.speculative_num_draft_tokens <= 16:
            raise bad("speculative_num_draft_tokens", "must be in [1, 16]")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise bad("ngram_min", f"must be >= 1 and <= ngram_max ({self.ngram_max})")
        if self.ngram_max > 16:
            raise bad("ngram_max", "must be <= 16")
        if self.speculative_disable_batch_size < 0:
            raise bad("speculative_disable_batch_size", "must be >= 0 (0: never draft)")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(model=model, **kwargs)
