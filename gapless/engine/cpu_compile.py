"""`--cpu-compile`: a decode step's decoder layers compiled on the CPU (issue 35).

Eagerly, one decode step of a small model is thousands of small torch ops (SmolLM2-135M: ~6,300 at one
request), each a few microseconds of dispatch, which together cost more than the GEMMs. `torch.compile`
(inductor's C++ code generation) turns each layer's norms, RoPE, activation and residual adds into a
few fused loops around the GEMM and attention calls. Decode batches only (`ForwardContext.is_decode`):
prefills are few and large, where dispatch does not count.

- **When**: at start-up (`warm_up`), on dummy decodes of one and of two rows on the reserved row, so
  that no request waits for a compile: one graph for a lone request, one for any larger batch (dynamic
  shapes over the batch and the context length).
- **Bounded and cached**: dynamo's recompile limit bounds the graphs (past it a call runs eagerly);
  inductor keeps its compiled kernels on disk (`TORCHINDUCTOR_CACHE_DIR`, by default under the system's
  temporary directory), so a later start with the same model and torch compiles in about half the time
  (dynamo still traces the layers: 316 s, then 155 s for the default model on a 2-core machine).
- **No compile after the warm-up** (the tests assert it), as long as the process keeps the torch thread
  count it started with: dynamo guards on it, and a change recompiles.
- **Fallback**: any error from the compiler (no C++ compiler, an op inductor cannot lower) is logged
  once and the engine decodes eagerly from then on; the eager path is always the same code.
- **Exactness**: the fused loops round differently from the eager ops (a norm's sum in another
  order), so tokens equal the eager engine's except at near-ties, as on a GPU (the tests count them).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.fx.experimental._config as fx_config

from gapless.engine.memory_plan import dummy_decode
from gapless.tensors import dataclass_to_device

if TYPE_CHECKING:  # (types only)
    from gapless.engine.runner import ModelRunner
    from gapless.model.decoder import DecoderBody, ForwardContext

log = logging.getLogger(__name__)

WARM_POSITION = 3  # the dummy decodes' position: a context of 4 keys, not 1 (which dynamo would specialize)


# sizes are not unified by value while tracing ("duck shaping"): a warm-up batch of 2 rows would share its
# symbol with a model of 2 KV heads, and the graph then holds only batches of 2
_NO_DUCK_SHAPES = fx_config.patch(use_duck_shape=False)  # type: ignore[attr-defined]  # (a config module's)


def _run_layers(body: DecoderBody, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
    return body.run_layers(x, ctx)


class CompiledLayers:
    """`DecoderBody.run_layers` through `torch.compile`, falling back to it for good after a compiler
    error. Holds no model: the body comes with each call (`DecoderBody.compiled_layers`)."""

    def __init__(self) -> None:
        self.compiled: Any = torch.compile(_run_layers, dynamic=True)
        self.failed: str | None = None  # the compiler's error, once one came
        self.runs = 0  # calls the compiled layers ran (warm-up included)

    def __call__(self, body: DecoderBody, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if self.failed is None:
            try:
                with _NO_DUCK_SHAPES:
                    out = self.compiled(body, x, ctx)
                self.runs += 1
                return out
            except Exception as e:  # (whatever inductor raises: its errors share no base class)
                first = next((line for line in str(e).splitlines() if line.strip()), "")
                self.failed = f"{type(e).__name__}: {first[:300]}"
                log.warning("cpu_compile: the compiler failed (%s); decoding eagerly", self.failed)
        return body.run_layers(x, ctx)


def warm_up(runner: ModelRunner) -> CompiledLayers | None:
    """Install compiled layers on `runner`'s model and compile them on dummy decodes of one and two rows
    (on the reserved row, writing only KV slot 0); returns them (`failed` says whether it worked). None
    for a mixture of experts, which stays eager: its CPU experts choose their tokens on the host
    (`gapless.model.moe.reference_experts`), a graph break in every layer."""
    if runner.model_config.num_experts:
        log.warning("cpu_compile: a mixture of experts decodes eagerly (its routing reads the host)")
        return None
    compiled = CompiledLayers()
    runner.model.model.compiled_layers = compiled
    vocab, rows, pad = runner.model_config.vocab_size, runner.max_running_requests, runner.pad_row
    log.info("cpu_compile: compiling the decode step (minutes the first time, cached on disk after)")
    start = time.perf_counter()
    for n in (1, 2):
        batch = dummy_decode(n, pad, rows, vocab, position=min(WARM_POSITION, runner.max_context - 1))
        runner.forward_hidden(dataclass_to_device(batch, runner.device))
    if compiled.failed is None:
        log.info("cpu_compile: the decode step compiled in %.1f s", time.perf_counter() - start)
    return compiled
