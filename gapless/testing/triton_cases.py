"""What the sm_90 compile harness (`gapless.testing.triton_compile`) launches, by group: each builder
returns its cases by name, each a call of the engine's own launchers on CPU tensors that only carry
shapes (under the harness's `Compiler` every launch compiles and returns). `GROUPS`: the builders by
group name."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any
from unittest import mock

import torch

# families whose fused kernels differ: RMSNorm arithmetic (Llama, Gemma, OLMo 2), q/k norms (Qwen3,
# OLMo 2), activations (SiLU; GeLU(tanh) in Gemma); each in both half-precision dtypes
FAMILIES = ("llama", "qwen3", "gemma2", "olmo2")
DTYPES = (torch.bfloat16, torch.float16)


def attention_cases() -> dict[str, Callable[[], object]]:
    from gapless.attention import selfcheck, triton_kernels
    from gapless.attention.triton_backend import TritonBackend

    # the backend refuses CPU tensors unless built for the interpreter; here they only carry shapes
    compile_only = type("CompileOnly", (TritonBackend,), {"interpreted": True})
    # the decode kernel five times: split (the probe's long context; the last split merges), whole (one
    # split), and with the GPU sweep's options (`DecodeTuning`): its whole key blocks unmasked, an fp8
    # cache's values read a byte at a time (the default reads them in pairs, by PTX's conversion), and
    # pipelined 5 stages deep (`GAPLESS_DECODE_STAGES`)
    tunings = (
        triton_kernels.DecodeTuning(whole_blocks=True),
        triton_kernels.DecodeTuning(values_in_pairs=False),
        triton_kernels.DecodeTuning(num_stages=5),
    )
    backends = (compile_only(), compile_only(num_splits=1), *(compile_only(decode_tuning=t) for t in tunings))

    def run(probe: selfcheck.Probe) -> None:
        for name, (prefix_lens, extend_lens) in selfcheck.CASES.items():
            spans = selfcheck.SPANS.get(name, ())
            q, k, v, meta = selfcheck.batch(probe, prefix_lens, extend_lens, torch.device("cpu"), 0, spans)
            for backend in backends if name == "decode" else backends[:1]:
                scales = probe.kv_scales(torch.device("cpu"))
                backend.forward(
                    q, k, v, backend.prepare(meta), probe.head_dim**-0.5, **probe.layer(), **scales
                )

    probes = [
        selfcheck.Probe(8, 2, head_dim, dtype, window, softcap)
        for dtype in (torch.float32, torch.bfloat16, torch.float16)
        for head_dim in (64, 128)
        for window, softcap in ((None, None), (24, 30.0))
    ]
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):  # fp8 KV under bf16 and fp16 q, plain and windowed
        probes += [
            selfcheck.Probe(8, 2, 64, torch.bfloat16, kv_dtype=fp8),
            selfcheck.Probe(8, 2, 128, torch.bfloat16, 24, 30.0, fp8),
            selfcheck.Probe(8, 2, 128, torch.float16, kv_dtype=fp8),
        ]
    return {f"attention {p}": partial(run, p) for p in probes}


def model_kernel_cases() -> dict[str, Callable[[], object]]:
    from gapless.config import EngineConfig
    from gapless.engine.runner import ModelRunner
    from gapless.model import fused
    from gapless.model.fused import triton_kernels
    from gapless.testing.checkpoints import cached_checkpoint

    def run(family: str, dtype: torch.dtype) -> None:
        cfg = EngineConfig(
            model=str(cached_checkpoint(family)),
            device="cpu",
            dtype=str(dtype).removeprefix("torch."),
            fused_kernels="torch",
            attention_backend="torch",
            kv_cache_tokens=64,
        )
        model = ModelRunner(cfg).model
        fused.set_fused(model, triton_kernels)  # the start-up check's probes, each through the kernels
        for probe in fused._probes(model, torch.device("cpu")).values():
            probe()
        if family == "qwen3" and dtype == torch.bfloat16:  # the store into an fp8 (e4m3, e5m2) cache
            for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
                fused._probes(model, torch.device("cpu"), fp8)["qk_norm_rope_store"]()

    return {
        f"model kernels {family} {dtype}": partial(run, family, dtype)
        for family in FAMILIES
        for dtype in DTYPES
    }


def sampling_cases() -> dict[str, Callable[[], object]]:
    from gapless.sampling import triton_nucleus, triton_penalties, triton_sample

    g = torch.Generator().manual_seed(0)
    batch, vocab = 3, 2000
    logits = torch.randn(batch, vocab, generator=g)
    temperature, top_p, min_p = torch.tensor([0.7, 0.0, 1.2]), torch.tensor([0.9, 1.0, 0.5]), torch.zeros(3)
    top_k, seeds, steps = torch.tensor([5, vocab, 40]), torch.tensor([1, 2, -3]), torch.tensor([0, 4, 9])
    counts = torch.randint(0, 3, (4, vocab), generator=g, dtype=torch.int32)
    prompt, rows = torch.rand(4, vocab, generator=g) < 0.3, torch.tensor([3, 0, 1])
    factors, draw_args = torch.ones(batch), (temperature, top_k, top_p, min_p, seeds, steps)

    def draw(dtype: torch.dtype, need: tuple[bool, bool, bool]) -> object:
        return triton_sample.draw(logits.to(dtype), *draw_args, need)

    def penalties(dtype: torch.dtype) -> object:
        return triton_penalties.apply_penalties(
            logits.to(dtype), counts, prompt, rows, factors, factors, factors
        )

    return {
        **{
            f"sampling draw {dtype} filters {need}": partial(draw, dtype, need)
            for dtype in (torch.float32, *DTYPES)
            for need in ((False, False, False), (True, True, True))
        },
        **{f"sampling penalties {dtype}": partial(penalties, dtype) for dtype in (torch.float32, *DTYPES)},
        "sampling nucleus": lambda: triton_nucleus.nucleus_floor(logits, torch.tensor([0.9, 0.5, 1.0])),
    }


def moe_cases() -> dict[str, Callable[[], object]]:
    from gapless.model import moe_triton
    from gapless.model.moe import WeightQuant

    def run(dtype: torch.dtype, lora: bool, quant: str = "") -> object:
        from types import SimpleNamespace

        from gapless.lora.table import ExpertLoRA

        g = torch.Generator().manual_seed(0)
        tokens, hidden, inter, experts, top_k, rank = 5, 64, 48, 4, 2, 16
        x = torch.randn(tokens, hidden, generator=g).to(dtype)
        w13 = torch.randn(experts, 2 * inter, hidden, generator=g).to(dtype)
        w2 = torch.randn(experts, hidden, inter, generator=g).to(dtype)
        weights = torch.rand(tokens, top_k, generator=g)
        ids = torch.randint(0, experts, (tokens, top_k), generator=g)
        adapters = None
        if lora:  # the experts' LoRA path: each GEMM's output kept whole, the gathered kernels' deltas
            shapes = {"gate_up_proj": (hidden, 2 * inter), "down_proj": (inter, hidden)}
            tables = {
                k: (torch.zeros(2, experts, rank, i).to(dtype), torch.zeros(2, experts, o, rank).to(dtype))
                for k, (i, o) in shapes.items()
            }
            table = SimpleNamespace(kernel=True, token_slots=torch.tensor([0, -1, 1, 0, -1]))
            adapters = ExpertLoRA(table, tables)  # type: ignore[arg-type]  # a stand-in for LoRATable
        scales: Any = None
        if quant == "fp8":  # `--quantization fp8`'s experts: e4m3 weights, a float32 scale per expert row
            w13, w2 = w13.to(torch.float8_e4m3fn), w2.to(torch.float8_e4m3fn)
            scales = ((torch.ones(experts, 2 * inter, 1), hidden), (torch.ones(experts, hidden, 1), inter))
        elif quant == "gguf":  # a GGUF file's under bfloat16: gate/up 4 bits g32, down 8 bits g16 (Q4_K_M's
            # Q6_K), fractional zeros held in float16 (`int4.zeros_dtype`)
            w13 = torch.zeros(experts, hidden * 4 // 32, 2 * inter, dtype=torch.int32)
            w2 = torch.zeros(experts, inter * 8 // 32, hidden, dtype=torch.int32)
            s13, s2 = torch.ones(experts, hidden // 32, 2 * inter), torch.ones(experts, inter // 16, hidden)
            scales = (
                WeightQuant(s13.to(dtype), 32, s13.half(), 4),
                WeightQuant(s2.to(dtype), 16, s2.half(), 8),
            )
        elif quant:  # an int4/int8 checkpoint's experts: packed words, group-wise scales and zeros of 16; or
            # a codebook's (GGUF IQ4's): 4 bits, each value a lookup in its levels, no zeros; int4's with
            # act-order (gate/up's x gathered in each expert's order; GGUF's cases are 4-bit without)
            bits, levels = (4, torch.zeros(16)) if quant == "codebook" else (int(quant[3:]), None)
            w13 = torch.zeros(experts, hidden * bits // 32, 2 * inter, dtype=torch.int32)
            w2 = torch.zeros(experts, inter * bits // 32, hidden, dtype=torch.int32)
            s13, s2 = torch.ones(experts, hidden // 16, 2 * inter), torch.ones(experts, inter // 16, hidden)
            zeros = (None, None) if levels is not None else (s13.to(dtype), s2.to(dtype))
            order = torch.arange(hidden, dtype=torch.int32).repeat(experts, 1) if quant == "int4" else None
            scales = tuple(
                WeightQuant(s.to(dtype), 16, z, bits, levels, order=o)
                for s, z, o in zip((s13, s2), zeros, (order, None))
            )
        return moe_triton.fused_experts(x, w13, w2, weights, ids, adapters, scales)

    cases = [(False, q) for q in ("", "fp8", "int4", "int8")] + [(True, ""), (True, "int4")]
    built: dict[str, Callable[[], object]] = {
        f"moe {dtype}{' lora' if lora else ''}{' ' + quant if quant else ''}": partial(
            run, dtype, lora, quant
        )
        for dtype in DTYPES
        for lora, quant in cases
    }
    kinds = ("gguf", "codebook")  # (bfloat16's alone: a GPU's dtype)
    return built | {f"moe torch.bfloat16 int {k}": partial(run, torch.bfloat16, False, k) for k in kinds}


def lora_cases() -> dict[str, Callable[[], object]]:
    from gapless.lora import triton_kernels

    def run(dtype: torch.dtype) -> object:
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(5, 64, generator=g).to(dtype), torch.randn(5, 96, generator=g).to(dtype)
        a, b = torch.randn(3, 24, 64, generator=g).to(dtype), torch.randn(3, 96, 24, generator=g).to(dtype)
        return triton_kernels.add_lora(y, x, a, b, torch.tensor([0, -1, 2, 1, 0]))

    return {f"lora {dtype}": partial(run, dtype) for dtype in DTYPES}


def fp8_cases() -> dict[str, Callable[[], object]]:
    from gapless.model.quant import fp8_kernel
    from gapless.model.quant.base import PendingNorm

    def run(
        rows: int,
        dtype: torch.dtype,
        block: bool | tuple[int, int],
        by: str = "launch",
        gated: str | None = None,
        norm: str | None = None,
        **settings: Any,
    ) -> object:
        """One GEMM of `rows` rows (scales per row; True: per [128, 128] block; or per `block`), x as `by`
        says up to DECODE_ROWS rows (0 unless set: x rounded in the loop), `fp8_kernel`'s `settings`
        (DECODE_ROWS, DECODE_TILES, GEMV_ROWS, SWAPPED_ROWS: 0, the tiles, unless set, GEMV_TILES) set for
        it; `gated`: x a gated activation's input, `norm` (an arithmetic): x an RMSNorm's, and residual."""
        n, k, w = 96, 256, torch.zeros(96, 256).to(torch.float8_e4m3fn)
        rps, group = (128, 128) if block is True else block or (1, 0)
        scale = torch.ones(-(-n // rps), k // group if group else 1)
        x, bias = torch.zeros(rows, k * (2 if gated else 1), dtype=dtype), torch.zeros(n, dtype=dtype)
        normed = PendingNorm(x, x.clone(), bias.new_zeros(k), 1e-6, norm, x.clone()) if norm else None
        settings = {"DECODE_ROWS": 0, "DECODE_X": by, "GEMV_ROWS": 0, "SWAPPED_ROWS": 0, **settings}
        with mock.patch.multiple(fp8_kernel, **settings):
            return fp8_kernel.fp8_gemm(x, w, scale, rps, group, group or 128, bias, gated=gated, norm=normed)

    mx = (1, 32)  # MXFP8's scales: a row's and 32 inputs'
    scales = lambda block: "mxfp8" if block == mx else "block" if block else "channel"  # noqa: E731
    cases: dict[str, Callable[[], object]] = {
        f"fp8 gemm {rows} rows {dtype} {scales(block)}": partial(run, rows, dtype, block)
        for rows in (1, 40, 200)  # each tile shape (`fp8_kernel._tiles`)
        for dtype in DTYPES
        for block in (False, True, mx)
    }
    decode: dict[str, Any] = {"DECODE_ROWS": 128}  # x (`DECODE_X`): by a launch, by each program; fp16
    # the sweep's 64-row decode tiles (fp8's wgmma), the swapped tiles (W x^T, `SWAPPED_ROWS`)
    wider: tuple[tuple[str, str, Any], ...] = (
        ("64-row tiles", "DECODE_TILES", (64, 64, 4, 4)),
        ("swapped", "SWAPPED_ROWS", 16),
    )
    for dtype, by in ((dtype, by) for dtype in DTYPES for by in ("launch", "program", "fp16")):
        for rows in (1, 40):  # a decode's 16-row tiles, a small batch's 64-row ones
            name = f"fp8 gemm {rows} rows {dtype} channel, decode x {by}"
            cases[name] = partial(run, rows, dtype, False, by, **decode)
        for tag, setting, value in wider:
            name = f"fp8 gemm 1 rows {dtype} channel, decode x {by}, {tag}"
            cases[name] = partial(run, 1, dtype, False, by, **{setting: value}, **decode)
        # the GEMV on the CUDA cores (`GEMV_ROWS`), per-channel, block and MXFP8's scales, two steps at
        # once, and its loads through asynchronous copies three iterations deep
        for unroll, stages, block in ((1, 1, False), (1, 1, True), (2, 1, False), (1, 3, False), (1, 1, mx)):
            name = f"fp8 gemv 1 rows {dtype} {scales(block)}, decode x {by}, unroll {unroll}, stages {stages}"
            tiles = (64, 4, unroll, stages)
            cases[name] = partial(run, 1, dtype, block, by, GEMV_ROWS=1, GEMV_TILES=tiles, **decode)
        if by != "launch":  # the GEMV making a gated activation's output as it loads x
            act = "silu" if by == "program" else "gelu_pytorch_tanh"
            name = f"fp8 gemv 1 rows {dtype} channel, decode x {by}, gated {act}"
            cases[name] = partial(run, 1, dtype, False, by, act, GEMV_ROWS=1, **decode)
            kind = "llama" if by == "program" else "gemma"  # (or an RMSNorm's, adding the residual)
            name = f"fp8 gemv 1 rows {dtype} channel, decode x {by}, normed {kind}"
            cases[name] = partial(run, 1, dtype, False, by, norm=kind, GEMV_ROWS=1, **decode)
    for dtype in DTYPES:  # x written by the fused norm and SiLU·mul (8B's widths): rounded for FP8's tiles,
        # or in an int4 act-order layer's column order
        cases[f"fp8 rounding in the norm and activation {dtype}"] = partial(_written_before, dtype, 128)
        cases[f"act-order x from the norm and activation {dtype}"] = partial(_written_before, dtype, 0)
    return cases


def _written_before(dtype: torch.dtype, group: int) -> None:
    from gapless.model.fused.triton_kernels import act_and_mul, rms_norm

    order, order_down = (None, None) if group else (torch.arange(4096), torch.arange(12288))
    rms_norm(x := torch.zeros(2, 4096, dtype=dtype), x[0], 1e-6, "llama", x, group, order)
    act_and_mul(torch.zeros(2, 2 * 12288, dtype=dtype), "silu", group, order_down)


def int4_cases() -> dict[str, Callable[[], object]]:
    from gapless.model.quant.int4_triton import choose_config, w4a16_matmul

    def run(dtype: torch.dtype, bits: int, m: int, variant: str) -> object:
        k, n, group = 512, 256, 16 if "g16" in variant else 32 if "fractional" in variant else 128
        x, qweight = torch.zeros(m, k, dtype=dtype), torch.zeros(k * bits // 32, n, dtype=torch.int32)
        scales, flags = torch.zeros(k // group, n, dtype=dtype), ("ptx_values", "factored", "swapped")
        config = choose_config(m, n, k, group)._replace(**{f: f.split("_")[0] in variant for f in flags})
        config = config._replace(block_m=1 if "gemv" in variant else 16) if m == 1 else config
        config = config._replace(num_stages=3) if "stages" in variant else config
        if "fractional" in variant:  # (a GGUF layer's zeros: float16 beside bf16 scales, no PTX values)
            zeros = scales.half() if dtype == torch.bfloat16 else scales
            return w4a16_matmul(x, qweight, scales, zeros, group, bits, config, integer_zeros=False)
        levels = torch.zeros(1 << bits) if "codebook" in variant else None  # (bitsandbytes' NF4, FP4)
        return w4a16_matmul(x, qweight, scales, scales, group, bits, config, levels=levels)

    # decode (16-row tiles, K split, PTX values; the GEMV: PTX, 3 stages, factored; W x^T), prefill; 4, 8
    # bits; a GGUF layer's fractional zeros in groups of 32 at 1, 16 and 256 rows, and of 16 (Q6_K's, Q2_K's);
    # a codebook's values (NF4's) at 1, 16 and 256 rows, NVFP4's groups of 16
    cases = (
        (4, 1, ""), (4, 1, "gemv"), (4, 1, "ptx"), (4, 1, "gemv ptx"), (4, 1, "gemv ptx stages"),
        (4, 1, "gemv factored"), (4, 16, ""), (4, 16, "ptx swapped"), (4, 256, ""), (8, 1, ""),
        (8, 1, "gemv"), (8, 1, "gemv factored"), (8, 16, "swapped"), (4, 1, "gemv ptx fractional"),
        (4, 16, "fractional"), (4, 256, "fractional"), (8, 1, "gemv fractional g16"),
        (4, 16, "fractional g16"), (4, 1, "gemv codebook"), (4, 16, "codebook"), (4, 256, "codebook"),
        (4, 1, "gemv codebook g16"),
    )  # fmt: skip
    return {
        f"int{bits} gemm {dtype} m={m}{' ' + variant if variant else ''}": partial(
            run, dtype, bits, m, variant
        )
        for dtype in DTYPES
        for bits, m, variant in cases
        if dtype == torch.bfloat16 or "fractional" not in variant  # (a GGUF layer's: bf16, a GPU's dtype)
    }


GROUPS: dict[str, Callable[[], dict[str, Callable[[], object]]]] = {
    "attention": attention_cases,
    "model": model_kernel_cases,
    "sampling": sampling_cases,
    "moe": moe_cases,
    "fp8": fp8_cases,
    "int4": int4_cases,
    "lora": lora_cases,
}
