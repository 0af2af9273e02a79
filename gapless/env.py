"""Every environment variable gapless reads, typed, in one place (`docs/environment.md` is their table).

Read one with `env.NAME.get()`: the variable's value, parsed, when it is set, else its default. Booleans
follow one rule: `1`, `true`, `yes` are on; `0`, `false`, `no` and the empty string are off (any case,
spaces around ignored); anything else is a `ValueError` that names the variable, as is any value its
type refuses. Values are read when asked for, not when this module is imported, so a test or a parent
process that sets a variable is seen by the next read.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

_ON = ("1", "true", "yes")
_OFF = ("0", "false", "no", "")


def parse_bool(raw: str) -> bool:
    """gapless's one rule for a boolean variable (see the module's docstring)."""
    value = raw.strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(f"not a boolean: use one of {', '.join(_ON)} (on) or {', '.join(_OFF[:-1])}, '' (off)")


def _one_of(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in choices:
            raise ValueError(f"not one of {', '.join(choices)}")
        return value

    return parse


def _at_least(low: int, raw: str) -> int:
    value = int(raw)
    if value < low:
        raise ValueError(f"below {low}")
    return value


def _optional_str(raw: str) -> str | None:
    return raw or None  # set but empty: as if unset


def _optional_in(low: int, high: int) -> Callable[[str], int | None]:
    """An integer in [low, high], or None where set but empty (as if unset)."""

    def parse(raw: str) -> int | None:
        if not raw.strip():
            return None
        value = int(raw)
        if not low <= value <= high:
            raise ValueError(f"not in [{low}, {high}]")
        return value

    return parse


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    """One environment variable: its `name`, the `default` when it is unset, how its text is parsed, and
    what `kind` of value and `meaning` the docs' table gives it."""

    name: str
    default: T
    parse: Callable[[str], T]
    kind: str
    meaning: str

    def get(self) -> T:
        """The variable's value now; a `ValueError` naming it if its text is not a value of its kind."""
        raw = os.environ.get(self.name)
        if raw is None:
            return self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            raise ValueError(f"environment variable {self.name}={raw!r}: {e}") from None


VARIABLES: dict[str, EnvVar] = {}  # every variable gapless reads, by name


def _var(name: str, default: T, parse: Callable[[str], T], kind: str, meaning: str) -> EnvVar[T]:
    assert name not in VARIABLES, name
    var = VARIABLES[name] = EnvVar(name, default, parse, kind, meaning)
    return var


def _bool(name: str, meaning: str) -> EnvVar[bool]:
    return _var(name, False, parse_bool, "boolean", meaning)


LOG_LEVELS = ("critical", "error", "warning", "info", "debug")

# gapless's own
DISABLE_OVERLAP = _bool(
    "GAPLESS_DISABLE_OVERLAP", "the default of `overlap` (`--disable-overlap`): on turns the overlap loop off"
)
PDL = _bool(
    "GAPLESS_PDL",
    "programmatic dependent launch of gapless's Triton kernels on sm_90+: each launched while the kernel "
    "before it still runs, its programs waiting on the SMs for that kernel's end (`gapless.pdl`)",
)
ALLOW_LONG_MAX_MODEL_LEN = _bool(
    "GAPLESS_ALLOW_LONG_MAX_MODEL_LEN",
    "allow a `--max-model-len` past the model's trained context (outputs beyond it may be wrong)",
)
CACHE = _var(
    "GAPLESS_CACHE",
    None,
    _optional_str,
    "path",
    "root of gapless's on-disk cache (default `~/.cache/gapless`)",
)
CPU_GEMM = _var(
    "GAPLESS_CPU_GEMM",
    "onednn",
    _one_of("onednn", "plain"),
    "`onednn` or `plain`",
    "CPU linear layers: `onednn` packs their weights for oneDNN, `plain` leaves them as loaded (comparisons)",
)
GGUF_WEIGHTS = _var(
    "GAPLESS_GGUF_WEIGHTS",
    "quantized",
    _one_of("quantized", "dequantize"),
    "`quantized` or `dequantize`",
    "a GGUF file's quantized matrices: kept quantized (on a one-rank CPU in its CPU layouts, on a GPU and "
    "across ranks on the int4/int8 path), or loaded as float weights (comparisons)",
)
GGUF_LAYOUT = _var(
    "GAPLESS_GGUF_LAYOUT",
    "auto",
    _one_of("auto", "mixed", "int4", "int8", "groups"),
    "`auto`, `mixed`, `int4`, `int8` or `groups`",
    "kept-quantized GGUF layers of int4 types on a one-rank CPU: `auto` is `int4` on an AVX-512 CPU, else "
    "`mixed`; `mixed`: gate/up as int4 and the rest as int8 rows; `int4`: int4 wherever exact (fewest "
    "bytes); `int8`: int8 rows everywhere; `groups`: every type in its own values and groups of 32 (Q8_0 "
    "and Q5 exact where int8 rows round them), as on a GPU, where each type always takes its own form",
)
GGUF_ACTIVATIONS = _var(
    "GAPLESS_GGUF_ACTIVATIONS",
    "int8",
    _one_of("int8", "bfloat16"),
    "`int8` or `bfloat16`",
    "kept-quantized GGUF layers held as int8 rows: their activations quantized to int8 per row (fbgemm's "
    "int8 GEMM, faster) or given as bfloat16 (the weight-only kernel)",
)
BNB_WEIGHTS = _var(
    "GAPLESS_BNB_WEIGHTS",
    "auto",
    _one_of("auto", "dequantize"),
    "`auto` or `dequantize`",
    "a bitsandbytes 4-bit checkpoint's weights: `auto` keeps them NF4/FP4 on CUDA (the int4 Triton GEMM "
    "with the codebook) and on a one-rank CPU where bitsandbytes is installed and its fused CPU kernel runs "
    "(AVX512-BF16), else float; `dequantize` always float (`gapless.model.quant.bnb`)",
)
INT4_KERNEL = _var(
    "GAPLESS_INT4_KERNEL",
    "auto",
    _one_of("auto", "triton", "tinygemm", "gemlite"),
    "`auto`, `triton`, `tinygemm` or `gemlite`",
    "int4/int8 weight-only layers on CUDA: `auto` holds torch's own int4 GEMM (`_weight_int4pack_mm`) for "
    "decode rows beside gapless's Triton GEMM for more, where tinygemm fits a layer and the GPU has room; "
    "or the one named, for every layer; on the CPU `auto` runs torch's CPU int4/int8 kernels where they "
    "take a layer, any name the reference path (`gapless.model.quant.int4_kernels`)",
)
INT4_SWAPPED = _bool(
    "GAPLESS_INT4_SWAPPED",
    "int4/int8 layers on gapless's Triton GEMM at up to 64 rows: W x^T tiles (the dequantized weights the "
    "tensor cores' first operand, from registers) instead of the one-row GEMV and x W^T tiles; never timed, "
    "so off (`gapless.model.quant.int4_triton`)",
)
DECODE_MAX_REGISTERS = _var(
    "GAPLESS_DECODE_MAX_REGISTERS",
    None,
    _optional_in(24, 255),
    "integer 24-255",
    "the Triton decode attention kernel's registers a thread capped at this (`DecodeTuning.max_registers`, "
    "Triton's `maxnreg`), so more programs fit an SM; unset: the compiler's choice. Never timed, so unset "
    "(`gapless.attention.triton_kernels`)",
)
DECODE_STAGES = _var(
    "GAPLESS_DECODE_STAGES",
    None,
    _optional_in(1, 8),
    "integer 1-8",
    "the Triton decode attention kernel's software-pipelining depth (`DecodeTuning.num_stages`); unset: 2. "
    "At 5 its loop keeps the next key block's copies in flight through a block's compute, for twice the "
    "shared memory. Never timed, so unset (`gapless.attention.triton_kernels`)",
)
FP8_DECODE = _var(
    "GAPLESS_FP8_DECODE",
    "auto",
    _one_of("auto", "launch", "program", "fp16"),
    "`auto`, `launch`, `program` or `fp16`",
    "FP8 layers' rows up to 128 on CUDA: their activations rounded to e4m3 by a launch before the GEMM, or "
    "by each of its programs, or not rounded: taken to float16 against the weights widened to float16 "
    "(W8A16, closer to the unquantized model); `auto`: in the one-row GEMV's registers, by each program "
    "of the swapped tiles, else by a launch (`gapless.model.quant.fp8_kernel`)",
)
FP8_GEMV_ROWS = _var(
    "GAPLESS_FP8_GEMV_ROWS",
    1,
    lambda raw: _at_least(0, raw),
    "integer >= 0",
    "FP8 layers on CUDA: up to this many rows the GEMM of a weight of at most 2^25 values runs as a GEMV "
    "on the CUDA cores instead of 16-row tensor-core tiles (0: never) (`gapless.model.quant.fp8_kernel`)",
)
FP8_SWAPPED = _bool(
    "GAPLESS_FP8_SWAPPED",
    "FP8 layers on CUDA at up to 16 rows: W x^T tiles (W's e4m3 tile the first operand of fp8's wgmma, x "
    "padded to 16 rows the second) in place of the one-row GEMV and the 16-row tiles; never timed, so off "
    "(`gapless.model.quant.fp8_kernel`)",
)
FP8_UNFUSED_ACTIVATION = _bool(
    "GAPLESS_FP8_UNFUSED_ACTIVATION",
    "FP8 layers on CUDA fed by a gated activation (an MLP's down projection) where the one-row GEMV runs: "
    "the fused activation's launch writes x first, as before; off (the default): the GEMV computes "
    "act(gate) * up as it loads x, the same bits, with no launch before it "
    "(`gapless.model.quant.fp8_gemv`)",
)
FP8_UNFUSED_NORM = _bool(
    "GAPLESS_FP8_UNFUSED_NORM",
    "FP8 layers on CUDA fed by an RMSNorm (qkv, an MLP's gate/up) where the one-row GEMV runs: the fused "
    "norm's launch writes x first, as before; off (the default): the GEMV adds the residual and norms x as "
    "it loads it, with no launch before it (`gapless.model.quant.fp8_gemv`)",
)
FP8_UNFUSED_ROUNDING = _bool(
    "GAPLESS_FP8_UNFUSED_ROUNDING",
    "FP8 layers on CUDA round their activations to e4m3 by a launch of their own before their tiles, as "
    "before; off (the default): the fused RMSNorm or gated activation before the layer rounds them as it "
    "writes them, the same bits, and the layer launches nothing (`gapless.model.quant.fp8_kernel`)",
)
API_KEY = _var("GAPLESS_API_KEY", None, _optional_str, "string", "the default of `gapless serve --api-key`")
LOG_LEVEL = _var(
    "GAPLESS_LOG_LEVEL",
    "info",
    _one_of(*LOG_LEVELS),
    " / ".join(LOG_LEVELS),
    "the default of `gapless serve --log-level`; the server sets it for the workers it starts",
)

# other libraries' variables that gapless reads too
RTN_NUM_BITS = _var(
    "RTN_NUM_BITS",
    8,
    int,
    "4 or 8",
    "vLLM's and SGLang's: the bits `--quantization rtn` rounds weights to (`gapless.model.quant.rtn`)",
)
RTN_GROUP_SIZE = _var(
    "RTN_GROUP_SIZE",
    128,
    int,
    "integer",
    "vLLM's and SGLang's: the inputs of a row that share a scale under `--quantization rtn`, a power of "
    "two; -1: one scale a row",
)
TRITON_INTERPRET = _bool(
    "TRITON_INTERPRET",
    "Triton's interpreter: gapless builds its Triton kernels for CPU tensors (read when they are imported)",
)
HF_HUB_OFFLINE = _bool(
    "HF_HUB_OFFLINE", "Hugging Face's offline mode: a hub model must already be in the local cache"
)
MASTER_ADDR = _var(
    "MASTER_ADDR",
    None,
    _optional_str,
    "host",
    "torch.distributed's rendezvous host: the default of `--dist-init-addr` with `--nnodes` > 1",
)
MASTER_PORT = _var("MASTER_PORT", 29500, int, "integer", "its port, with `MASTER_ADDR`")
