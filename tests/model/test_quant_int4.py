"""Weight-only int4/int8 checkpoints kept quantized (`gapless.model.quant.int4`, `int4_triton`): each
layout's unpacking against the element formula its writer documents, the Triton GEMM under the
interpreter against the dequantized matmul (and compiled for sm_90), tensor-parallel pieces against the
whole layer, whole-model greedy tokens against transformers on the same weights dequantized, and
unsupported schemes refused in one line before any weight is read. (Mixtures of experts:
test_quant_int4_moe.py.)"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from gapless import LLM, SamplingParams
from gapless.model import layers, loader, parallel
from gapless.model.moe import Experts
from gapless.model.quant import split_k, weights_held, weights_summary
from gapless.model.quant.formats import QuantFormatError
from gapless.model.quant.int4 import Int4LinearMethod, install
from gapless.model.quant.int4_configs import int4_spec_from_config
from gapless.model.quant.int4_layouts import AWQ_ORDER, Int4Spec, Unpacked, pack_int32, unpack, unpack_int32
from gapless.model.quant.int4_triton import (
    GEMV_PROGRAMS_PER_SM,
    GemmConfig,
    choose_config,
    nibble_dots,
    ptx_values,
    swapped,
    w4a16_matmul,
)
from gapless.testing.hf_reference import check_greedy, hf_greedy, make_prompts
from gapless.testing.quant_checkpoints import (
    layout_label,
    layout_tensors,
    quantization_config,
    quantize,
    write_quantized,
)
from gapless.testing.triton_compile import compile_cases, compile_child

MAX_NEW = 8
# the Triton GEMM runs on CUDA where there is one, else under the interpreter (tests/conftest.py sets it)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# the reference path, exact against the dequantized weights (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("int4_reference_path")


def _u32(word: int) -> int:
    return word & 0xFFFFFFFF


def _streamed(words: torch.Tensor, j: int, bits: int) -> int:
    """Value j of int32 `words` read as one little-endian bit stream (GPTQ's 3 bits cross words)."""
    at = bits * j
    stream = sum(_u32(int(w)) << (32 * i) for i, w in enumerate(words[at // 32 : at // 32 + 2].tolist()))
    return (stream >> (at % 32)) & ((1 << bits) - 1)


def _element(layout: str, t: dict[str, torch.Tensor], bits: int, group: int, n: int, k: int) -> float:
    """W[n, k] read straight off the stored tensors, by each writer's documented formula."""
    per, mask, g = 32 // bits, (1 << bits) - 1, k // group
    if layout == "awq":  # nibble i of word [k, n // 8] holds column 8 * (n // 8) + AWQ_ORDER[i]
        at = 4 * AWQ_ORDER.index(n % 8)
        q = (_u32(int(t["qweight"][k, n // 8])) >> at) & mask
        z = (_u32(int(t["qzeros"][g, n // 8])) >> at) & mask
        return (q - z) * float(t["scales"][g, n])
    if layout in ("gptq", "gptq_v2") and 32 % bits:  # (3 bits: AutoGPTQ's bit stream, 32 values in 3 words)
        q, z = _streamed(t["qweight"][:, n], k, bits), _streamed(t["qzeros"][g], n, bits)
        return (q - (z + (layout == "gptq"))) * float(t["scales"][g, n])
    if layout in ("gptq", "gptq_v2"):
        q = (_u32(int(t["qweight"][k // per, n])) >> (bits * (k % per))) & mask
        z = (_u32(int(t["qzeros"][g, n // per])) >> (bits * (n % per))) & mask
        return (q - (z + (layout == "gptq"))) * float(t["scales"][g, n])
    if layout == "int-quantized":  # the signed values and zero points as they are
        zp = int(t["weight_zero_point"][n, g]) if "weight_zero_point" in t else 0
        return (int(t["weight"][n, k]) - zp) * float(t["weight_scale"][n, g])
    half = 1 << (bits - 1)  # compressed-tensors: stored = signed + 2^(bits-1)
    q_signed = ((_u32(int(t["weight_packed"][n, k // per])) >> (bits * (k % per))) & mask) - half
    zp_signed = 0
    if "weight_zero_point" in t:
        zp_signed = ((_u32(int(t["weight_zero_point"][n // per, g])) >> (bits * (n % per))) & mask) - half
    return (q_signed - zp_signed) * float(t["weight_scale"][n, g])


def test_awq_word_holds_its_columns_interleaved():
    """AWQ's GEMM packing by hand: the word 0x76543210 has nibble i = i, and nibble i holds column
    (0, 2, 4, 6, 1, 3, 5, 7)[i], so the 8 columns read 0, 4, 1, 5, 2, 6, 3, 7."""
    word = torch.tensor([[0x76543210]], dtype=torch.int32)
    parts = {"qweight": word.expand(32, 1).contiguous(), "qzeros": torch.zeros(1, 1, dtype=torch.int32)}
    parts["scales"] = torch.ones(1, 8)
    w = unpack(Int4Spec("awq", 4, 32, False), parts, "probe")
    assert w.q[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def test_gptq_3_bit_words_are_autogptqs_packing():
    """3 bits a value, as AutoGPTQ's `pack` loop writes them (by hand here: per 3 words, 10 values, one
    split 2 + 1 bits across the first two words, 10 more, one split 1 + 2 across the next, 10 more), are
    what `unpack_int32` reads and `pack_int32` writes, along K (qweight) and along N (qzeros)."""
    g = torch.Generator().manual_seed(3)
    values = torch.randint(0, 8, (64, 5), generator=g)
    words = []
    for col in values.t().tolist():
        packed = []
        for i in range(0, len(col), 32):
            v = col[i : i + 32]
            w0 = sum(v[j] << (3 * j) for j in range(10)) | ((v[10] & 3) << 30)
            w1 = (v[10] >> 2) | sum(v[11 + j] << (3 * j + 1) for j in range(10)) | ((v[21] & 1) << 31)
            w2 = (v[21] >> 1) | sum(v[22 + j] << (3 * j + 2) for j in range(10))
            packed += [w - (1 << 32) if w >= 1 << 31 else w for w in (w0, w1, w2)]
        words.append(packed)
    qweight = torch.tensor(words, dtype=torch.int32).t()  # [K * 3 / 32, N]
    assert torch.equal(unpack_int32(qweight, 3, dim=0).long(), values)
    assert torch.equal(pack_int32(values, 3, dim=0), qweight)
    assert torch.equal(unpack_int32(qweight.t().contiguous(), 3, dim=1).long(), values.t())  # (qzeros' way)


CASES = [  # layout, bits, group, symmetric
    ("awq", 4, 32, False),
    ("gptq", 4, 32, True),
    ("gptq", 4, 64, False),
    ("gptq", 8, 32, False),
    ("gptq", 3, 32, False),  # (held as 4 bits)
    ("gptq", 3, 64, True),
    ("gptq", 2, 32, False),
    ("gptq_v2", 4, 32, False),
    ("compressed-tensors", 4, 32, True),
    ("compressed-tensors", 4, 32, False),
    ("compressed-tensors", 8, -1, True),
    ("int-quantized", 8, -1, True),  # (W8A8 INT8's usual: per channel, symmetric)
    ("int-quantized", 8, 32, False),
    ("int-quantized", 4, 32, True),
]


@pytest.mark.parametrize("layout,bits,group,sym", CASES)
def test_unpacked_layout_equals_the_writers_formula(layout, bits, group, sym):
    n, k = 32, 128  # (GPTQ's zeros pack along the outputs: 32 a 3-bit run of words)
    w = quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(bits)), bits, group, sym)
    stored = layout_tensors(w, layout, bits, group)
    spec = int4_spec_from_config(quantization_config(layout, bits, group, sym))
    assert spec is not None and spec.checkpoint_bits == bits and spec.bits == max(bits, 4)
    got = unpack(spec, stored, "probe").dequantize()
    g = k if group < 0 else group
    want = torch.tensor([[_element(layout, stored, bits, g, i, j) for j in range(k)] for i in range(n)])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got, w.dequantize(), rtol=0, atol=0)  # and the quantizer's own weights


# (bits, group, rows): every pair at every row count; two of the 4-bit ones (~11 s under the interpreter)
# in the slow tier, each with its group's other row counts left in `make test`
CASES = [
    pytest.param(
        bits, group, m, marks=[pytest.mark.slow] if (bits, group, m) in ((4, 32, 5), (4, 128, 1)) else []
    )
    for bits, group in ((4, 32), (4, 128), (8, 64))
    for m in (1, 5, 33)
]


@pytest.mark.parametrize("bits,group,m", CASES)
def test_triton_gemm_equals_the_dequantized_matmul(bits, group, m):
    """The chosen tiles, a split of K into 4 with narrow tiles (the partial sums added by a tile's last
    split to finish, every tile's counter then back at 0: `split_k.finish`), K steps over several groups
    (groups of 32 and 64 under the chosen 128-wide step: each word row's scales and zeros), the
    decode tiles with a dot per value of the words and with one reshaped tile (`nibble_dots`, where the
    group allows a 128-wide K block), both also swapped (W x^T: `GemmConfig.swapped`), and the one-row
    GEMV tiles (a program a row), plain and factored (`factored_words`), in fp32; and bf16 activations
    and scales within bf16's rounding, the GEMVs' and swapped tiles' too at one row (with PTX values where
    they run); and at one row the dots' values by PTX give Triton's bits in bf16 and fp16, swapped or not
    (on CUDA: the interpreter takes Triton's path)."""
    n, k = 96, 256
    gen = torch.Generator().manual_seed(m)
    w = quantize(torch.randn(n, k, generator=gen), bits, group, sym=False)
    x = torch.randn(m, k, generator=gen)
    ref = x.double() @ w.dequantize().double().t()
    x = x.to(DEVICE)
    spec = Int4Spec("gptq", bits, group, False)
    method = Int4LinearMethod(w, spec, torch.float32, DEVICE, kernel="triton")
    args = (method.qweight, method.scales, method.zeros, group, bits)
    # a program a row: slow interpreted
    # (BLOCK_K 32 and 128: in one group of 32 or more, and over four groups of 32)
    gemv = (
        [GemmConfig(1, 32, bk, 2, 4, 3, factored=f) for bk in (32, 128) for f in (False, True)]
        if m <= 5
        else []
    )
    bk = 16 * (32 // bits)  # the narrowest K block a dot per value takes: 16 words' rows
    whole = group % bk == 0 or bk % group == 0  # (a K step in one group, or over whole groups)
    wide = [GemmConfig(16, 32, bk, 2, 4, 3, nibble) for nibble in (True, False)] if whole else []
    assert [nibble_dots(c, bits) for c in wide] == ([True, False] if wide else [])
    swap = [c._replace(block_m=16 if m <= 16 else 32, swapped=True) for c in wide]
    if m <= 16:  # decode: the GEMV with PTX values at one row, 16-row tiles of one reshaped dot above
        chosen = choose_config(m, n, k, group)
        assert (chosen.block_m, chosen.ptx_values, nibble_dots(chosen, bits)) == (
            1 if m == 1 else 16,
            m == 1,
            False,
        )
    for cfg in [None, GemmConfig(16, 32, 32, 4, 4, 3), *gemv, *wide, *swap]:
        y = w4a16_matmul(x, *args, config=cfg)
        torch.testing.assert_close(y.double().cpu(), ref, rtol=1e-5, atol=1e-4)
    assert int(split_k._COUNTERS[x.device].abs().sum()) == 0
    half = Int4LinearMethod(w, spec, torch.bfloat16, DEVICE, kernel="triton")  # (not tinygemm on CUDA)
    tol = x.abs().sum().item() * 2e-2 / k**0.5
    # the GEMV at one row (its weights in float32, or rounded to bf16 by PTX on CUDA)
    one_row = [*gemv, *(c._replace(ptx_values=True) for c in [*gemv[:1], *swap])] if m == 1 else []
    for cfg in [None, *one_row]:
        y = w4a16_matmul(x.bfloat16(), half.qweight, half.scales, half.zeros, group, bits, cfg)
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.double().cpu(), ref, rtol=2e-2, atol=tol)
    if bits == 4 and whole and m == 1:  # the dots' values by PTX: Triton's bits (on CUDA)
        for dtype in (torch.bfloat16, torch.float16):
            held = Int4LinearMethod(w, spec, dtype, DEVICE, kernel="triton")
            for nibble, swapped in ((True, False), (True, True), (False, True)):
                by = [GemmConfig(16, 32, 128, 2, 4, 3, nibble, ptx, swapped=swapped) for ptx in (False, True)]
                assert ptx_values(by[1], bits, dtype) == (DEVICE.type == "cuda")  # (interpreted: Triton's)
                args = (held.qweight, held.scales, held.zeros, group, bits)
                ys = [w4a16_matmul(x.to(dtype), *args, config=cfg) for cfg in by]
                assert torch.equal(ys[0], ys[1]), (dtype, nibble, swapped)


@pytest.mark.parametrize("m", [1, 5, pytest.param(70, marks=pytest.mark.slow)])  # (70: ~14 s interpreted)
def test_a_codebooks_weight_in_the_triton_gemm_equals_the_dequantized_matmul(m):
    """A codebook's weight (`Unpacked.levels`: bitsandbytes' NF4, `W = levels[q] * scale`, no zeros held)
    through the chosen tiles, the GEMV, dots per value, one reshaped tile, K steps over two groups of 64,
    and configs asking for PTX values, factored or swapped tiles (which take Triton's lookups instead), in
    float32 and bfloat16; on any device and whatever `GAPLESS_INT4_KERNEL` names, the layer is the Triton
    GEMM's; levels of the wrong size are refused."""
    from gapless.model.quant.bnb import NF4
    from gapless.model.quant.int4_layouts import Unpacked

    n, k, group = 96, 256, 64
    gen = torch.Generator().manual_seed(m)
    scale = torch.rand(n, k // group, generator=gen) + 0.5
    w = Unpacked(
        torch.randint(0, 16, (n, k), generator=gen), scale, torch.zeros_like(scale), None, torch.tensor(NF4)
    )
    x = torch.randn(m, k, generator=gen)
    ref = x.double() @ w.dequantize().double().t()
    spec = Int4Spec("bitsandbytes", 4, group, True, codebook="nf4")
    method = Int4LinearMethod(w, spec, torch.float32, DEVICE, kernel="tinygemm")
    assert method.triton_held and method.library is None and method.zeros.numel() == 0
    assert method.name == "bitsandbytes nf4 g64"
    assert torch.equal(method.dequantized(torch.float32).cpu(), w.dequantize())
    args = (method.qweight, method.scales, method.zeros, group, 4)
    configs = [
        None,
        GemmConfig(1, 32, 128, 2, 4, 1),  # (the GEMV, two groups a K step)
        GemmConfig(16, 32, 128, 2, 4, 3, True),  # (a dot per value of the words)
        GemmConfig(16, 32, 64, 1, 4, 3, False),  # (one reshaped tile)
        GemmConfig(16, 32, 128, 2, 4, 3, True, ptx_values=True, swapped=True),
        GemmConfig(1, 32, 64, 2, 4, 1, ptx_values=True, factored=True),
    ]
    for cfg in configs:
        y = w4a16_matmul(x.to(DEVICE), *args, config=cfg, levels=method.levels)
        torch.testing.assert_close(y.double().cpu(), ref, rtol=1e-5, atol=1e-4)
    half = Int4LinearMethod(w, spec, torch.bfloat16, DEVICE)
    y = half.apply(None, x.to(DEVICE, torch.bfloat16))
    torch.testing.assert_close(y.double().cpu(), ref, rtol=2e-2, atol=x.abs().sum().item() * 2e-2 / k**0.5)
    with pytest.raises(ValueError, match=r"levels \(8,\) torch.float32: float32 \[16\]"):
        w4a16_matmul(x.to(DEVICE), *args, levels=method.levels[:8])


def test_decode_tiles_split_k_on_an_8b_layer():
    """M <= 16 on a 4096 x 14336 layer: 16-row tiles at 16 rows, K split so about two programs an SM run;
    the GEMV at one row, K split so about as many programs run as the SMs hold (`GEMV_PROGRAMS_PER_SM`),
    whatever their count, each share two K steps at least; none split at prefill sizes."""
    cfg = choose_config(16, 4096, 14336, 128)
    assert cfg.block_m == 16 and 128 <= (4096 // cfg.block_n) * cfg.split_k <= 264
    for sms in (132, 100, 40):
        gemv = choose_config(1, 4096, 14336, 128, sms)
        steps = -(-14336 // gemv.block_k // gemv.split_k)
        programs = (4096 // gemv.block_n) * -(-14336 // gemv.block_k // steps)
        assert gemv.block_m == 1 and steps >= 2, (sms, gemv)
        assert 0.75 * GEMV_PROGRAMS_PER_SM * sms <= programs <= GEMV_PROGRAMS_PER_SM * sms, (sms, programs)
    assert choose_config(1, 4096, 256, 128).split_k == 1  # (two K steps: one share)
    assert choose_config(4096, 4096, 4096, 128).split_k == 1


def test_a_split_gemm_with_more_tiles_than_counters_is_refused(monkeypatch):
    """`split_k.counters` holds `COUNTERS` tiles' counters; a split GEMM with more tiles (a config forced
    so) is refused by name, before any launch, and the same GEMM unsplit runs."""
    monkeypatch.setattr(split_k, "COUNTERS", 2)
    w = quantize(torch.randn(96, 256), 4, 128, sym=False)
    method = Int4LinearMethod(w, Int4Spec("gptq", 4, 128, False), torch.float32, DEVICE, kernel="triton")
    args = (torch.randn(1, 256).to(DEVICE), method.qweight, method.scales, method.zeros, 128, 4)
    with pytest.raises(ValueError, match="at most 2 output tiles, got 3"):
        w4a16_matmul(*args, config=GemmConfig(16, 32, 32, 2, 4, 3))
    assert w4a16_matmul(*args, config=GemmConfig(16, 32, 32, 1, 4, 3)).shape == (1, 96)


def test_swapped_tiles_are_chosen_up_to_64_rows_where_asked_for(monkeypatch):
    """`GAPLESS_INT4_SWAPPED`: the swapped tiles (W x^T, one K tile a step, PTX values) at 1-64 rows, one
    row padded to 16; past 64 rows, and without it, the tiles as before."""
    plain = [choose_config(m, 4096, 14336, 128) for m in (1, 16, 64, 65)]
    monkeypatch.setenv("GAPLESS_INT4_SWAPPED", "1")
    chosen = [choose_config(m, 4096, 14336, 128) for m in (1, 16, 64, 65)]
    assert [c.block_m for c in chosen] == [16, 16, 64, 64] and chosen[3] == plain[3]
    assert all(swapped(c) and c.ptx_values and not c.nibble_dots for c in chosen[:3])
    assert not any(swapped(c) for c in plain)


@pytest.mark.slow  # (sm_90 compiles, ~9 s)
def test_kernel_compiles_for_sm90():
    built = compile_cases("int4", "bfloat16")  # (the float16 ones: the whole harness's test)
    if built is None:
        pytest.skip("this triton has no NVIDIA backend to compile with")
    assert built.kernels == ["_w4a16_kernel"] and not built.failed, built


@pytest.mark.slow  # (compiles over a cold Triton cache: ~30 s)
def test_the_compiled_gemms_convert_no_integer_to_float():
    """Compiled for sm_90 (the harness's stand-in driver, in a child process without the interpreter):
    the int4/int8 GEMM and the mixtures' grouped GEMM over int experts take each packed value to float32
    by bits (`unsigned_to_float`), with no `cvt` from an integer, which Hopper runs at a fraction of its
    float rate (the code before took one a dequantized value: 288 in these kernels)."""
    script = (
        "import re\n"
        "from gapless.testing.triton_compile import Compiler\n"
        "from gapless.testing.triton_cases import int4_cases, moe_cases\n"
        "with Compiler(90) as c:\n"
        "    for name, case in {**int4_cases(), **moe_cases()}.items():\n"
        "        if 'int' in name and 'bfloat16' in name:\n"
        "            case()\n"
        "ptx = [k.asm['ptx'] for n, k in c.compiled if n in ('_w4a16_kernel', '_grouped_gemm_kernel')]\n"
        "print(len(ptx), sum(len(re.findall(r'cvt\\.\\w+\\.f32\\.[us]32', p)) for p in ptx))\n"
    )
    out = compile_child(script, "compiling the int GEMMs")
    if out is None:
        pytest.skip("this Triton has no NVIDIA backend to compile with")
    kernels, conversions = map(int, out.split()[-2:])
    assert kernels >= 8 and conversions == 0, out


@pytest.mark.slow  # (sm_90 compiles in a child process, ~10 s)
def test_the_gemv_asked_for_stages_loads_through_asynchronous_copies():
    """Compiled for sm_90, the one-row GEMV's loop loads with plain loads by default (1 stage) and, asked
    for 3 stages, through asynchronous copies (`cp.async`) into shared memory: Triton pipelines a loop's
    loads that feed no dot only when the loop says how deep (`tl.range(num_stages=)`)."""
    script = (
        "from gapless.testing.triton_compile import Compiler\n"
        "from gapless.testing.triton_cases import int4_cases\n"
        "with Compiler(90) as c:\n"
        "    for name, case in int4_cases().items():\n"
        "        if 'int4' in name and 'bfloat16' in name and 'gemv ptx' in name:\n"
        "            before = len(c.compiled)\n"
        "            case()\n"
        "            built = c.compiled[before:]\n"
        "            print(name.endswith('stages'), *('cp.async' in k.asm['ptx'] for _, k in built))\n"
    )
    out = compile_child(script, "compiling the int4 GEMV")
    if out is None:
        pytest.skip("this Triton has no NVIDIA backend to compile with")
    assert sorted(out.split("\n")[-3:]) == ["", "False False", "True True"], out


@pytest.mark.slow  # (sm_90 compiles in a child process, ~10 s)
def test_the_factored_gemv_compiles_to_fewer_instructions():
    """Compiled for sm_90 (bf16): the factored GEMV (`factored_words`) is fewer instructions than the
    GEMV with PTX values (480 against 560 with Triton 3.6, 488 against 568 with 3.9; on Llama-3-8B's down
    shape its loop body 335 against 420), with about one LOP3 a value: 64 values a thread a step, where
    a LOP3 split into an AND and an OR (both constants immediates) would add 64. 8 bits: fewer than the
    plain GEMV."""
    script = (
        "from gapless.testing.triton_compile import Compiler\n"
        "from gapless.testing.triton_cases import int4_cases\n"
        "from gapless.testing.sass import cuobjdump, instruction_mix\n"
        "with Compiler(90) as c:\n"
        "    for name, case in int4_cases().items():\n"
        "        skip = 'stages' in name or 'fractional' in name or 'codebook' in name\n"
        "        if 'bfloat16' in name and 'gemv' in name and not skip:\n"
        "            before = len(c.compiled)\n"
        "            case()\n"
        "            (_, k), = c.compiled[before:]\n"
        "            lop3 = cuobjdump(k, '-sass').count('LOP3.LUT')\n"
        "            how = name.split('gemv')[1].strip() or '-'\n"
        "            print(name.split()[0], how, instruction_mix(k)['instructions'], lop3)\n"
    )
    out = compile_child(script, "compiling the int GEMVs")
    if out is None:
        pytest.skip("this Triton has no NVIDIA backend to compile with")
    got = {
        (bits, how): (int(n), int(lop3)) for bits, how, n, lop3 in (line.split() for line in out.splitlines())
    }
    assert got[("int4", "factored")][0] < 0.9 * got[("int4", "ptx")][0], got
    assert got[("int4", "factored")][1] < 100, got  # (72-75 whole-kernel; split, 64 more)
    assert got[("int8", "factored")][0] < got[("int8", "-")][0], got


@pytest.mark.slow  # (sm_90 compiles in a child process, ~10 s)
def test_the_swapped_tiles_feed_the_tensor_cores_w_from_registers():
    """Compiled for sm_90 (bf16, 16 rows): the swapped tiles (W x^T, `GemmConfig.swapped`, PTX values) run
    Hopper's wgmma with W, the first operand, in registers (`HGMMA ... R, R, gdesc`: each of its 8), in
    fewer instructions than the 16-row default's (x W^T on mma.sync, W through shared memory a value at
    a time: 856 against 648 with Triton 3.6, 808 against 600 with 3.9), with fewer shared-memory stores
    (the values go 8 at a time, `_k_tile`)."""
    script = (
        "import re\n"
        "from gapless.testing.triton_compile import Compiler\n"
        "from gapless.testing.triton_cases import int4_cases\n"
        "from gapless.testing.sass import cuobjdump, instruction_mix\n"
        "with Compiler(90) as c:\n"
        "    for name, case in int4_cases().items():\n"
        "        if 'int4' in name and 'bfloat16' in name and 'm=16' in name and 'fractional' not in name:\n"
        "            before = len(c.compiled)\n"
        "            case()\n"
        "            (_, k), = c.compiled[before:]\n"
        "            sass = cuobjdump(k, '-sass')\n"
        "            wgmma = len(re.findall(r'HGMMA\\.\\S+ R\\d+, R\\d+, gdesc', sass))\n"
        "            print('swapped' in name, instruction_mix(k)['instructions'], wgmma, sass.count('STS'))\n"
    )
    out = compile_child(script, "compiling the int4 16-row tiles")
    if out is None:
        pytest.skip("this Triton has no NVIDIA backend to compile with")
    got = {line.split()[0]: [int(v) for v in line.split()[1:]] for line in out.splitlines()}
    (plain, _, plain_stores), (swapped, wgmma, stores) = got["False"], got["True"]
    assert swapped < 0.85 * plain and wgmma == 8 and stores < plain_stores / 2, got


@pytest.mark.parametrize("kind", ["column", "merged", "row", "row per channel"])
def test_tensor_parallel_pieces_make_the_whole_layer(kind):
    """Two ranks' pieces (scales and zeros cut with their weights: column layers by rows, row layers by
    groups, or per channel by columns under each row's scale and zero) concatenate (column) or sum (row)
    to the whole layer's output."""
    gen = torch.Generator().manual_seed(1)
    group = 128 if kind == "row per channel" else 32
    spec = Int4Spec("gptq", 4, -1 if group == 128 else 32, False)
    k, n = (128, 64) if kind.startswith("row") else (64, 96)
    x = torch.randn(3, k, generator=gen)
    sizes = {"gate": 64, "up": 32}
    shards = (
        {s: quantize(torch.randn(size, k, generator=gen), 4, 32, False) for s, size in sizes.items()}
        if kind == "merged"
        else {None: quantize(torch.randn(n, k, generator=gen), 4, group, False)}
    )
    outs = []
    for rank in range(2):
        parallel.use(parallel.TPGroup(rank=rank, size=2))
        try:
            layer = {
                "column": lambda: layers.ColumnParallelLinear(k, n),
                "merged": lambda: layers.MergedColumnParallelLinear(k, sizes),
                "row": lambda: layers.RowParallelLinear(k, n),
                "row per channel": lambda: layers.RowParallelLinear(k, n),
            }[kind]()
        finally:
            parallel.use(parallel.SINGLE)
        install(layer, shards, spec, torch.float32, kind, "triton")
        outs.append(layer.linear_method.apply(layer, x.chunk(2, 1)[rank] if kind.startswith("row") else x))
    if kind.startswith("row"):
        whole = x @ shards[None].dequantize().t()
        torch.testing.assert_close(outs[0] + outs[1], whole, rtol=1e-5, atol=1e-5)
    elif kind == "column":
        torch.testing.assert_close(torch.cat(outs, 1), x @ shards[None].dequantize().t())
    else:  # each rank: its half of gate, then its half of up
        gate, up = (x @ shards[s].dequantize().t() for s in ("gate", "up"))
        for rank, out in enumerate(outs):
            want = torch.cat([gate.chunk(2, 1)[rank], up.chunk(2, 1)[rank]], 1)
            torch.testing.assert_close(out, want)


def _greedy(
    model: Path, prompts: list[list[int]], max_new: int = MAX_NEW, device: str = "cpu"
) -> list[list[int]]:
    with LLM(str(model), device=device, dtype="float32", kv_cache_tokens=2048, overlap=False) as llm:
        outs = llm.generate(
            prompts, SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True), use_tqdm=False
        )
    return [o.token_ids for o in outs]


@pytest.mark.parametrize(
    "arch,layout,bits,sym,act_order",
    [
        ("qwen2", "awq", 4, False, False),  # q/k/v bias, tied head
        ("llama", "gptq", 4, True, False),
        ("phi3", "gptq", 8, False, False),  # q/k/v and gate/up fused in the checkpoint
        ("llama", "gptq", 3, False, False),  # (2 and 3 bits held as 4)
        ("qwen3", "gptq", 2, True, True),
        ("qwen3", "compressed-tensors", 4, False, False),
        # act-order (GPTQ's desc_act, compressed-tensors' actorder group): inputs grouped by g_idx
        ("llama", "gptq", 4, False, True),
        ("phi3", "gptq_v2", 8, True, True),
        ("qwen3", "compressed-tensors", 4, False, True),
        ("qwen3", "int-quantized", 8, True, False),  # W8A8 INT8, run as w8a16
        ("phi3", "int-quantized", 8, False, True),
    ],
)
def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(
    ckpt_factory, tmp_path, arch, layout, bits, sym, act_order
):
    from transformers import AutoModelForCausalLM

    qdir, refdir = write_quantized(
        ckpt_factory(arch), tmp_path, layout, bits=bits, group=32, sym=sym, act_order=act_order
    )
    model = loader.load_model(qdir, torch.float32, torch.device("cpu"))
    formats, held = weights_held(model)
    assert any(f.startswith(layout_label(layout, bits, 32, sym, act_order)) for f in formats), formats
    assert held < weights_held(loader.load_model(refdir, torch.float32, torch.device("cpu")))[1]
    assert f"w{bits}a16 g32" in weights_summary(model)
    prompts = make_prompts(1000, n=3, max_len=30, shared_prefix=8)
    ours = _greedy(qdir, prompts)
    ref = AutoModelForCausalLM.from_pretrained(str(refdir), dtype=torch.float32).eval()
    notes = [check_greedy(o, hf_greedy(ref, p, MAX_NEW)) for o, p in zip(ours, prompts)]
    assert sum(n is not None for n in notes) <= 1, notes  # same weights: at most a rare near-tie


@pytest.mark.parametrize(
    "arch,layout",
    [
        ("llama", "gptq"),  # GPTQModel's `lm_head: true`
        ("qwen2", "gptq_v2"),  # a tied model: the table stays float, the head quantized beside it
        ("qwen3", "compressed-tensors"),  # a config whose `ignore` leaves the head out
        ("llama", "auto_round:auto_gptq"),  # AutoRound's `extra_config` head (`--quant_lm_head`)
    ],
)
def test_a_quantized_lm_head_is_held_on_the_path(ckpt_factory, tmp_path, arch, layout):
    """The LM head quantized as the layers are (`int4.install_head`): its weight the reference's bit for bit,
    the embedding table float and untouched; transformers' greedy tokens on the reference; two ranks hold
    their halves of its rows."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from gapless.testing.ranks import load_as_ranks

    qdir, refdir = write_quantized(ckpt_factory(arch), tmp_path, layout, group=32, sym=True, head=True)
    model = loader.load_model(qdir, torch.float32, torch.device("cpu"))
    reference = load_file(str(refdir / "model.safetensors"))
    head = model.lm_head.linear_method
    assert isinstance(head, Int4LinearMethod) and model.lm_head.weight.numel() == 0
    assert torch.equal(head.dequantized(torch.float32), reference["lm_head.weight"])
    assert torch.equal(model.model.embed_tokens.weight, reference["model.embed_tokens.weight"])
    assert weights_held(model)[0] == {layout_label(layout, 4, 32, True): 9}  # (8 projections and the head)
    prompts = make_prompts(1000, n=3, max_len=30, shared_prefix=8)
    ref = AutoModelForCausalLM.from_pretrained(str(refdir), dtype=torch.float32).eval()
    notes = [check_greedy(o, hf_greedy(ref, p, MAX_NEW)) for o, p in zip(_greedy(qdir, prompts), prompts)]
    assert sum(n is not None for n in notes) <= 1, notes
    _, ranks = load_as_ranks(qdir)
    halves = [r.lm_head.linear_method.dequantized(torch.float32) for r in ranks]
    torch.testing.assert_close(
        torch.cat(halves)[: len(reference["lm_head.weight"])], reference["lm_head.weight"]
    )


@pytest.mark.parametrize(
    "layout,sym,act_order,packages",
    [
        ("gptq", False, False, ("gptqmodel", "optimum")),
        ("gptq", False, True, ("gptqmodel", "optimum")),
        ("awq", False, False, ("awq",)),
        # symmetric: transformers 5.24 declares an asymmetric checkpoint's zero points unpacked ([N, G])
        # and refuses the packed [N / 8, G] that compressed-tensors itself writes and reads
        ("compressed-tensors", True, False, ("compressed_tensors",)),
        # (act-order: compressed-tensors 0.20 refuses `actorder: group`, "removed"; checkpoints written
        # before it carry it, read here as GPTQ's g_idx)
    ],
)
def test_transformers_reads_the_tiny_checkpoint(ckpt_factory, tmp_path, layout, sym, act_order, packages):
    """transformers' own reading of the file (through `packages`) gives the reference's logits: the
    layout as the tests write it is the layout its writers' readers read. (compressed-tensors 0.20,
    installed aside, gave logits equal to the reference's, difference 0.0, at 4 and 8 bits.)"""
    absent = [p for p in packages if importlib.util.find_spec(p) is None]
    if absent:
        pytest.skip(
            f"transformers reads {layout} checkpoints through {', '.join(packages)}; absent: {absent}"
        )
    from transformers import AutoModelForCausalLM

    qdir, refdir = write_quantized(
        ckpt_factory("llama"), tmp_path, layout, group=32, sym=sym, act_order=act_order
    )
    ids = torch.tensor([make_prompts(1000, n=1, max_len=20, shared_prefix=4)[0]])
    theirs = AutoModelForCausalLM.from_pretrained(str(qdir), dtype=torch.float32).eval()(ids).logits
    ref = AutoModelForCausalLM.from_pretrained(str(refdir), dtype=torch.float32).eval()(ids).logits
    torch.testing.assert_close(theirs.float(), ref, rtol=2e-2, atol=2e-2)


def test_a_float16_int4_checkpoint_runs_in_bfloat16_where_tinygemm_takes_it(
    ckpt_factory, tmp_path, monkeypatch
):
    """AutoAWQ and AutoGPTQ save their checkpoints in float16, which torch's int4 decode GEMM (tinygemm)
    does not take: under `--dtype auto` on a GPU with bfloat16 such a checkpoint runs in bfloat16 (its
    layers then take tinygemm's copy at decode), unless the kernel asked for or the bits rule tinygemm
    out, or the dtype is named. (int4 checkpoints need sm_80, which has bfloat16.)"""
    from gapless.model.config import load_model_config

    monkeypatch.delenv("GAPLESS_INT4_KERNEL")  # (the module's fixture names the reference path)
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))

    def auto(path):
        return loader.resolve_dtype("auto", load_model_config(path), cuda, path)

    paths = {}
    for name, layout, bits in (("awq", "awq", 4), ("gptq8", "gptq", 8)):
        qdir, refdir = write_quantized(ckpt_factory("qwen3"), tmp_path / name, layout, bits=bits, group=32)
        for d in (qdir, refdir):
            config = json.loads((d / "config.json").read_text())
            (d / "config.json").write_text(json.dumps(dict(config, torch_dtype="float16")))
        paths[name], paths["float"] = qdir, refdir
    assert auto(paths["awq"]) == torch.bfloat16
    assert (
        loader.resolve_dtype("float16", load_model_config(paths["awq"]), cuda, paths["awq"]) == torch.float16
    )
    assert auto(paths["gptq8"]) == torch.float16  # (8 bits: the Triton GEMM, in the checkpoint's dtype)
    assert auto(paths["float"]) == torch.float16
    assert loader.resolve_dtype("auto", load_model_config(paths["awq"]), cuda) == torch.float16  # (no path)
    monkeypatch.setenv("GAPLESS_INT4_KERNEL", "triton")
    assert auto(paths["awq"]) == torch.float16
    monkeypatch.setenv("GAPLESS_INT4_KERNEL", "tinygemm")
    assert auto(paths["awq"]) == torch.bfloat16


REFUSED = [
    (dict(quant_method="gptq", bits=5, group_size=128), "bits=5 is not run"),
    (dict(quant_method="gptq", bits=4, group_size=100), "group_size=100 is not run"),
    (dict(quant_method="awq", bits=4, group_size=128, version="gemv"), "version='gemv'"),
    (dict(quant_method="awq", bits=8, group_size=128), "bits=8 is not run"),
    (dict(quant_method="gptq", bits=4, group_size=128, checkpoint_format="marlin"), "checkpoint_format"),
    (dict(quant_method="gptq", bits=4, group_size=128, is_marlin_format=True), "'marlin' is not read"),
    (dict(quant_method="gptq", bits=4, group_size=128, format="bitblas"), "'bitblas' is not read"),
    (dict(quant_method="gptq", bits=4, group_size=128, pack_dtype="int16"), "pack_dtype='int16' is not read"),
    # GPTQModel's per-module rules: other bits (or groups, ...) for some modules
    (
        dict(quant_method="gptq", bits=4, group_size=128, dynamic={r"+:.*mlp.*": {"bits": 8}}),
        r"dynamic rule '+:.*mlp.*' quantizes with its own bits",
    ),
    (
        dict(
            quant_method="gptq", bits=4, group_size=128, dynamic={r".*down.*": {"group_size": 64, "bits": 4}}
        ),
        "its own group_size: not built",
    ),
]


def test_a_module_a_dynamic_rule_leaves_float_loads_float(ckpt_factory, tmp_path):
    """GPTQModel's `-:` rule (a module left unquantized): that module's float weight beside the quantized
    ones, read as the checkpoint holds it; the tokens are the dequantized reference's."""
    from safetensors.torch import load_file, save_file

    qdir, refdir = write_quantized(ckpt_factory("qwen3"), tmp_path, "gptq", group=32)
    float_module = "model.layers.1.mlp.down_proj"
    tensors = load_file(str(qdir / "model.safetensors"))
    tensors = {k: v for k, v in tensors.items() if not k.startswith(float_module + ".")}
    tensors[f"{float_module}.weight"] = load_file(str(refdir / "model.safetensors"))[f"{float_module}.weight"]
    save_file(tensors, str(qdir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((qdir / "config.json").read_text())
    config["quantization_config"]["dynamic"] = {r"-:.*layers\.1\.mlp\.down_proj": {}}
    (qdir / "config.json").write_text(json.dumps(config))
    model = loader.load_model(qdir, torch.float32, torch.device("cpu"))
    assert not isinstance(model.get_submodule(float_module).linear_method, Int4LinearMethod)
    assert isinstance(model.get_submodule("model.layers.0.mlp.down_proj").linear_method, Int4LinearMethod)
    prompts = make_prompts(1000, n=2, max_len=16, shared_prefix=4)
    assert _greedy(qdir, prompts, max_new=4) == _greedy(refdir, prompts, max_new=4)


@pytest.mark.parametrize("qc,says", REFUSED, ids=[s for _, s in REFUSED])
def test_unsupported_schemes_are_refused_before_any_weight_loads(
    ckpt_factory, tmp_path, monkeypatch, qc, says
):
    qdir, _ = write_quantized(ckpt_factory("llama"), tmp_path, "gptq")
    config = json.loads((qdir / "config.json").read_text())
    (qdir / "config.json").write_text(json.dumps(dict(config, quantization_config=qc)))

    def no_weights(*a, **k):
        raise AssertionError("weights were read before the refusal")

    monkeypatch.setattr(loader, "iter_weights", no_weights)
    with pytest.raises(QuantFormatError, match=r"^quantization_config \((gptq|awq)\): ") as e:
        loader.load_model(qdir, torch.float32, torch.device("cpu"))
    assert says in str(e.value) and "\n" not in str(e.value)


def test_gptqs_format_is_read_under_each_name_its_writers_gave_it():
    """`checkpoint_format` (AutoGPTQ, GPTQModel), `format` (some GPTQModel releases): gptq_v2 stores its
    zero points as they are, gptq (v1) minus one; a v2 checkpoint read as v1 would be off a step a
    weight."""
    base = dict(quant_method="gptq", bits=4, group_size=128, sym=False)
    for key in ("checkpoint_format", "format"):
        assert int4_spec_from_config({**base, key: "gptq_v2"}).zero_offset == 0, key
        assert int4_spec_from_config({**base, key: "gptq"}).zero_offset == 1, key
    assert int4_spec_from_config(base).zero_offset == 1  # (neither: AutoGPTQ's v1)


def test_compressed_tensors_act_order_and_fp8_are_told_apart():
    ct = quantization_config("compressed-tensors", 4, 128, True)
    for order in ("group", "weight"):  # (group: g_idx read per layer; weight: groups contiguous)
        ct["config_groups"]["group_0"]["weights"]["actorder"] = order
        spec = Int4Spec("compressed-tensors", 4, 128, True, act_order=order == "group")
        assert int4_spec_from_config(ct) == spec
    assert spec.label == "compressed-tensors w4a16 g128"  # ("weight": no order to name)
    gptq = dict(quant_method="gptq", bits=4, group_size=128, desc_act=True)
    assert int4_spec_from_config(gptq).label == "gptq w4a16 g128 act-order"
    assert not int4_spec_from_config(gptq | {"static_groups": True}).act_order  # (static: g_idx k // G)
    ct["config_groups"]["group_0"]["weights"]["actorder"] = "sideways"
    with pytest.raises(QuantFormatError, match="actorder='sideways'"):
        int4_spec_from_config(ct)
    ct["format"] = "float-quantized"  # FP8: another method's, not refused here
    assert int4_spec_from_config(ct) is None
    assert int4_spec_from_config(dict(quant_method="fp8")) is None and int4_spec_from_config(None) is None


def test_act_order_g_idx_orders_the_inputs_and_a_malformed_one_is_refused_by_name():
    """A g_idx that groups the inputs out of order (act-order) unpacks to q's columns sorted by group and
    the inputs' order, whose weight is the one quantized; the plain k // G and compressed-tensors' all -1
    to none; a g_idx whose groups are not all G inputs is refused, naming the layer."""
    gen = torch.Generator().manual_seed(3)
    dense, order = torch.randn(16, 64, generator=gen), torch.randperm(64, generator=gen)
    spec = Int4Spec("gptq", 4, 32, False, zero_offset=1)  # (GPTQ's v1 zeros, as `layout_tensors` writes)
    w = quantize(dense, 4, 32, False, order)
    stored = layout_tensors(w, "gptq", 4, 32)
    assert not torch.equal(stored["g_idx"], torch.arange(64) // 32)  # (out of order: act-order's)
    got = unpack(spec, stored, "layer")
    assert torch.equal(got.dequantize(), w.dequantize())
    # each group's inputs those quantized together (in increasing order within it: g_idx says no more)
    assert torch.equal(got.order.view(2, 32), order.view(2, 32).sort(1).values)
    torch.testing.assert_close(got.dequantize(), dense, atol=0.2, rtol=0)  # (the weight quantized)
    plain = layout_tensors(quantize(dense, 4, 32, False), "gptq", 4, 32)
    assert unpack(spec, plain, "layer").order is None
    ct = layout_tensors(quantize(dense, 4, 32, False), "compressed-tensors", 4, 32)
    ct["weight_g_idx"] = torch.full((64,), -1, dtype=torch.int32)
    assert unpack(Int4Spec("compressed-tensors", 4, 32, False), ct, "layer").order is None
    stored["g_idx"] = torch.arange(64, dtype=torch.int32) % 3 % 2  # (groups of 43 and 21)
    with pytest.raises(QuantFormatError, match="^layer: g_idx does not put exactly 32 inputs"):
        unpack(spec, stored, "layer")


def test_stored_tensors_of_another_kind_than_the_layout_are_refused_by_name():
    """Each layout's tensors are of the kinds its writers store: a packed weight or zero point in floats,
    a scale in integers or of 3 dims, an unpacked weight as unsigned bytes or past its bits, a per-row
    scale of another shape, or act-order without its g_idx would be read as a cast (or a misplacement)
    no writer made, so each is refused naming the tensor."""
    gen = torch.Generator().manual_seed(4)
    dense = torch.randn(16, 64, generator=gen)
    w, order = quantize(dense, 4, 32, False), torch.randperm(64, generator=gen)

    def refused(spec: Int4Spec, parts: dict[str, torch.Tensor], says: str) -> None:
        with pytest.raises(QuantFormatError, match=f"^layer{says}") as e:
            unpack(spec, parts, "layer")
        assert "\n" not in str(e.value)

    for layout, spec in (("awq", Int4Spec("awq", 4, 32, False)), ("gptq", Int4Spec("gptq", 4, 32, False, 1))):
        stored = layout_tensors(w, layout, 4, 32)
        assert unpack(spec, stored, "layer").q.shape == (16, 64)  # (as written: read)
        for name, bad, says in (
            ("qweight", stored["qweight"].float(), r"\.qweight: float32 \[.*int32 words, 2-D"),
            ("qzeros", stored["qzeros"].half(), r"\.qzeros: float16 .*int32 words"),
            ("qweight", stored["qweight"].flatten(), r"\.qweight: int32 \[\d+\], .*2-D"),
            ("scales", stored["scales"].to(torch.int32), r"\.scales: int32 .*floats"),
            ("scales", stored["scales"][None], r"\.scales: float.* \[1, .*at most 2-D"),
        ):
            refused(spec, {**stored, name: bad}, says)
    int8 = Int4Spec("compressed-tensors", 8, 32, True, packed=False)
    stored = layout_tensors(quantize(dense, 8, 32, True), "int-quantized", 8, 32)
    refused(int8, {**stored, "weight": stored["weight"].to(torch.uint8)}, r"\.weight: uint8 .*signed integer")
    assert unpack(int8, {**stored, "weight": stored["weight"].to(torch.int32)}, "layer").q.shape == (16, 64)
    int4 = Int4Spec("compressed-tensors", 4, 32, True, packed=False)  # (8 bits' values said to be 4)
    refused(int4, stored, r": values out of 4 bits' range")
    refused(int8, {**stored, "weight_scale": stored["weight_scale"].t()}, r"\.weight_scale: shape \[2, 16\]")
    act = Int4Spec("gptq", 4, 32, False, 1, act_order=True)
    stored = layout_tensors(quantize(dense, 4, 32, False, order), "gptq", 4, 32)
    assert unpack(act, stored, "layer").order is not None
    without = {k: v for k, v in stored.items() if k != "g_idx"}
    refused(act, without, ": the config names act-order.*lacks g_idx")


def _act_order_layer(
    seed: int, k: int, n: int, sym: bool, group: int = 32
) -> tuple[torch.Tensor, torch.Tensor, Unpacked, Int4Spec]:
    """x [3, k], a float weight [n, k], it quantized GPTQ-style in groups of `group` with its inputs in a
    random order (act-order), and the spec."""
    gen = torch.Generator().manual_seed(seed)
    x, dense = torch.randn(3, k, generator=gen), torch.randn(n, k, generator=gen)
    w = quantize(dense, 4, group, sym, torch.randperm(k, generator=gen))
    return x, dense, w, Int4Spec("gptq", 4, group, sym)


def _on_rank(rank: int, size: int, make: Any) -> Any:
    """What `make()` builds as rank `rank` of `size` builds it (a layer cut for tensor parallelism)."""
    parallel.use(parallel.TPGroup(rank=rank, size=size))
    try:
        return make()
    finally:
        parallel.use(parallel.SINGLE)


def test_act_order_layers_gather_x_on_every_path_and_refuse_what_is_not_built(monkeypatch):
    """An act-order layer (its inputs gathered into the weight's order) gives x @ W^T on the CPU's
    reference path and through the Triton GEMM (interpreted here; on CUDA also tinygemm's); a fused layer
    whose shards' orders differ is refused by name."""
    from gapless.model.quant import int4

    k, n = 64, 48
    x, dense, w, spec = _act_order_layer(4, k, n, sym=False)
    want = x @ w.dequantize().t()
    layer = layers.ReplicatedLinear(k, n, bias=False)
    install(layer, {None: w}, spec, torch.float32, "layer", "triton")
    torch.testing.assert_close(layer.linear_method.apply(layer, x), want)
    assert layer.input_order() is layer.linear_method.order  # (the norm or activation before may write it)
    monkeypatch.setattr(int4, "TRITON_ON_CPU", True)
    torch.testing.assert_close(layer.linear_method.apply(layer, x), want, rtol=1e-5, atol=1e-4)
    if DEVICE.type == "cuda":  # bf16 on CUDA: tinygemm's copy (`auto` at decode rows), the Triton GEMM
        for kernel in ("auto", "triton"):
            method = Int4LinearMethod(w, spec, torch.bfloat16, DEVICE, kernel)
            y = method.apply(None, x.to(DEVICE, torch.bfloat16)).float().cpu()
            torch.testing.assert_close(y, want, rtol=2e-2, atol=5e-2 * want.abs().max().item())
    merged = _on_rank(0, 2, lambda: layers.MergedColumnParallelLinear(k, {"gate": n, "up": n}))
    other = quantize(dense, 4, 32, False, torch.randperm(k))
    with pytest.raises(QuantFormatError, match="^mlp: its shards' act-orders"):
        install(merged, {"gate": w, "up": other}, spec, torch.float32, "mlp", "triton")


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("zeros", ["symmetric", "asymmetric", "past the codes", "fractional"])
def test_a_row_parallel_act_order_layer_regroups_each_ranks_inputs(monkeypatch, ranks, zeros):
    """Under tensor parallelism a row-parallel act-order layer (o, down) holds on each rank its own inputs
    of every group, each group's run padded to one power-of-two width (`int4.regroup_for_rank`): the
    ranks' partial products add up to x @ W^T on the reference path and through the Triton GEMM
    (interpreted), each rank at most twice its share of the weight; the layer gathers x itself (no order
    for the kernel before it to write: the padded one is no permutation). The padding reads a zero
    appended to x, so it adds exactly 0 whatever the group's zero: past the codes too (GPTQ v1's stored
    zero of 0 reads back as 16) or fractional; and on the CPU's int4 kernel (`auto`, its zero an offset in
    bfloat16) the split layer is as close as the whole one, where each rank's first input is large."""
    from gapless.model.quant import int4

    k, n = 512, 40  # (groups of 64: a rank's runs of ~64 / ranks inputs, padded to 32 at least)
    x, _, w, spec = _act_order_layer(5, k, n, sym=zeros == "symmetric", group=64)
    if zeros == "past the codes":
        w = w._replace(zero=torch.where(torch.arange(w.zero.shape[1]) == 0, 16.0, w.zero))
    elif zeros == "fractional":
        w = w._replace(zero=w.zero + 0.5)
    x[:, :: k // ranks] = 30.0  # (each rank's first input)
    want = x @ w.dequantize().t()

    def split(kernel: str) -> tuple[list[Any], torch.Tensor]:
        held = []
        for rank in range(ranks):
            held.append(row := _on_rank(rank, ranks, lambda: layers.RowParallelLinear(k, n)))
            install(row, {None: w}, spec, torch.float32, "row", kernel)
        return held, sum(r.linear_method.apply(r, p) for r, p in zip(held, x.chunk(ranks, dim=1)))

    held, got = split("triton")
    assert all(r.input_order() is None and r.linear_method.order is not None for r in held)
    assert all(k // ranks < r.linear_method.in_features <= 2 * k // ranks for r in held)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    whole = layers.ReplicatedLinear(k, n)
    install(whole, {None: w}, spec, torch.float32, "whole", "auto")
    error = (whole.linear_method.apply(whole, x) - want).abs().max()
    assert (split("auto")[1] - want).abs().max() <= 2 * error + 1e-4 * want.abs().max()
    monkeypatch.setattr(int4, "TRITON_ON_CPU", True)
    torch.testing.assert_close(split("triton")[1], want, rtol=1e-5, atol=1e-4)


def test_an_act_order_mlps_down_order_is_taken_onto_its_gate_up_rows(ckpt_factory, tmp_path):
    """An act-order MLP's down reads the intermediate width gate/up alone write, so its order is taken
    onto gate's and up's rows at load (`int4.takes_down_order`): down holds none (no gather, no ordered
    copy for SiLU·mul to write), gate/up and down keep it for LoRA (`inter_order`), the tokens are the
    dequantized model's, and each of two ranks holds down's plain half, where it was regrouped and padded
    before. Where gate/up stay float (a dynamic rule's, layer 1), down keeps its order and gathers x."""
    from safetensors.torch import load_file, save_file

    from gapless.testing.ranks import load_as_ranks

    qdir, refdir = write_quantized(ckpt_factory("llama"), tmp_path, "gptq", group=32, act_order=True)
    prompts = make_prompts(1000, n=2, max_len=16, shared_prefix=4)
    model = loader.load_model(qdir, torch.float32, torch.device("cpu"))
    mlp = model.model.layers[0].mlp
    down, gate_up = mlp.down_proj, mlp.gate_up_proj
    assert down.linear_method.order is None and down.input_order() is None
    assert down.inter_order is not None and gate_up.inter_order is down.inter_order
    assert not torch.equal(down.inter_order, torch.arange(down.inter_order.numel()))
    assert gate_up.linear_method.order is not None  # (x's order: its own act-order)
    assert _greedy(qdir, prompts, max_new=4) == _greedy(refdir, prompts, max_new=4)
    _, ranks = load_as_ranks(qdir)
    inter = down.linear_method.in_features
    assert all(r.model.layers[0].mlp.down_proj.linear_method.in_features == inter // 2 for r in ranks)
    # layer 1's gate/up left float: its down as stored, its order kept
    float_modules = ("model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj")
    tensors = load_file(str(qdir / "model.safetensors"))
    tensors = {k: v for k, v in tensors.items() if not k.startswith(float_modules)}
    reference = load_file(str(refdir / "model.safetensors"))
    tensors.update({f"{m}.weight": reference[f"{m}.weight"] for m in float_modules})
    save_file(tensors, str(qdir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((qdir / "config.json").read_text())
    config["quantization_config"]["dynamic"] = {r"-:.*layers\.1\.mlp\.(gate|up)_proj": {}}
    (qdir / "config.json").write_text(json.dumps(config))
    model = loader.load_model(qdir, torch.float32, torch.device("cpu"))
    down = model.model.layers[1].mlp.down_proj
    assert down.linear_method.order is not None and down.inter_order is None
    assert model.model.layers[0].mlp.down_proj.linear_method.order is None
    assert _greedy(qdir, prompts, max_new=4) == _greedy(refdir, prompts, max_new=4)


@pytest.mark.parametrize("swapped_tiles", [False, True])
def test_the_triton_gemm_in_a_whole_model_gives_the_reference_paths_tokens(
    ckpt_factory, tmp_path, monkeypatch, swapped_tiles
):
    """The GPU's path, every projection through the Triton GEMM (on CUDA where there is one, else under
    the interpreter), in a served model: the same greedy tokens as the CPU's dequantizing path; also with
    the swapped tiles (`GAPLESS_INT4_SWAPPED`) at every decode row."""
    from gapless.model.quant import int4

    qdir, _ = write_quantized(ckpt_factory("qwen3"), tmp_path, "gptq", group=32)
    prompts = make_prompts(1000, n=1, max_len=12, shared_prefix=4)
    reference = _greedy(qdir, prompts, max_new=3)
    from gapless.model.quant import int4_triton

    calls = []  # (each call: whether its tiles are the swapped ones)
    gemm, choose = int4_triton.w4a16_matmul, int4_triton.choose_config

    def counted(x, qweight, *args, **kwargs):
        calls.append(swapped(choose(x.shape[0], qweight.shape[1], x.shape[1], args[2])))
        return gemm(x, qweight, *args, **kwargs)

    monkeypatch.setattr(int4_triton, "w4a16_matmul", counted)
    monkeypatch.setattr(int4, "TRITON_ON_CPU", DEVICE.type == "cpu")
    monkeypatch.setenv("GAPLESS_INT4_KERNEL", "triton")
    monkeypatch.setenv("GAPLESS_INT4_SWAPPED", "1" if swapped_tiles else "0")
    assert _greedy(qdir, prompts, max_new=3, device=DEVICE.type) == reference
    assert len(calls) >= 3 * 2 * 4  # forwards x layers x projections (q/k/v, o, gate/up, down)
    assert set(calls) == {swapped_tiles}  # (every call: 12 rows at most)


@pytest.mark.slow  # (two tensor-parallel rank processes, ~9 s each)
@pytest.mark.parametrize("act_order", [False, True])
def test_two_ranks_give_the_dequantized_models_tokens(ckpt_factory, tmp_path, act_order):
    """Tensor parallelism over quantized layers (gloo, one process per rank): fused q/k/v and gate/up cut
    by rows, o and down by groups (32 inputs a group: one group of o's 64 inputs per rank); with act-order
    (GPTQ's desc_act), o regrouped on each rank (`int4.regroup_for_rank`), down's order taken onto
    gate/up's rows (`int4.takes_down_order`)."""
    from transformers import AutoModelForCausalLM

    qdir, refdir = write_quantized(ckpt_factory("llama"), tmp_path, "gptq", group=32, act_order=act_order)
    prompts = make_prompts(1000, n=2, max_len=30, shared_prefix=8)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    with LLM(str(qdir), device="cpu", dtype="float32", kv_cache_tokens=1024, tensor_parallel_size=2) as llm:
        ours = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    ref = AutoModelForCausalLM.from_pretrained(str(refdir), dtype=torch.float32).eval()
    notes = [check_greedy(o, hf_greedy(ref, p, MAX_NEW)) for o, p in zip(ours, prompts)]
    assert sum(n is not None for n in notes) <= 1, notes


@pytest.mark.parametrize(
    "arch,layout,head",
    [
        ("qwen3", "awq", False),
        ("qwen3_moe", "awq", False),
        ("qwen3", "gptq", False),
        ("qwen2", "gptq", True),
        ("qwen3_moe", "gptq", False),  # (act-order experts: gate and up given one order)
    ],
)
def test_dummy_load_format_holds_random_int4_layers(ckpt_factory, tmp_path, arch, layout, head):
    """`load_format="dummy"` of an int4 checkpoint's config (`gapless.bench.quant`'s int4 shapes): the
    layers such a checkpoint quantizes (every linear but the routers, the experts) hold random int4
    weights of the dummy floats' spread, the LM head stays float unless the config quantizes it (GPTQ's
    `lm_head`: then it too, untied from a tied table, qwen2's), and the engine generates; with act-order
    (GPTQ's here) each layer in a random input order, which it gathers x into, but an MLP's down, as a
    checkpoint's is held (its order on its gate/up's rows)."""
    src = ckpt_factory(arch)
    dst = tmp_path / "m"
    dst.mkdir()
    for f in src.iterdir():
        if not f.name.endswith(".safetensors") and f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((dst / "config.json").read_text())
    act = layout == "gptq"
    cfg["quantization_config"] = quantization_config(layout, 4, 32, act, act_order=act, head=head)
    (dst / "config.json").write_text(json.dumps(cfg))
    opts = dict(device="cpu", kv_cache_tokens=256, overlap=False, load_format="dummy")
    with LLM(str(dst), **opts) as llm:
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
        assert len(out[0].token_ids) == 3
        model = llm.engine.runner.model
        formats = dict(llm.engine.info.weight_formats)
    linears = [m for m in model.modules() if isinstance(m, layers._Linear)]
    int4s = [m.linear_method for m in linears if isinstance(m.linear_method, Int4LinearMethod)]
    routers = [m for m in linears if isinstance(m, layers.ReplicatedLinear)]
    label = f"{layout} w4a16 g32" + (" act-order" if act else "")
    assert formats[label] == len(int4s) + head == len(linears) - len(routers) + head > 0
    # (act-order: each layer in its order, but an MLP's down, whose order its gate/up's rows take)
    downs = {id(m.linear_method) for n, m in model.named_modules() if n.endswith("mlp.down_proj")}
    assert (bool(downs) or arch == "qwen3_moe") and all(
        (m.order is not None) == (act and id(m) not in downs) for m in int4s
    )
    assert isinstance(model.lm_head.linear_method, Int4LinearMethod) == head
    assert model.model.embed_tokens.weight.numel() > 0  # (a tied table keeps its float rows)
    assert int4s[0].dequantized(torch.float32).std().item() == pytest.approx(0.02, rel=0.1)
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert bool(experts) == (arch == "qwen3_moe")
    assert len(experts) == formats.get(f"{label} experts", 0)
    assert all(m.int_quant is not None for m in experts)
    for m in experts:  # (act-order experts: gate/up's x order held, down's taken onto gate/up's rows)
        assert (
            m.int_quant is not None
            and (m.int_quant[0].order is not None) == (m.inter_order is not None) == act
        )


def _half(pattern: int, dtype: torch.dtype) -> float:
    """The `dtype` (bf16 or fp16) value of a 16-bit pattern."""
    return torch.tensor([pattern], dtype=torch.int32).view(torch.int16)[:1].view(dtype).item()


def _pattern(x: float, dtype: torch.dtype) -> int:
    """`x` rounded to `dtype` (exact in float32 here), as its 16-bit pattern."""
    return int(torch.tensor([x], dtype=torch.float32).to(dtype).view(torch.int16).item()) & 0xFFFF


def _run_ptx(asm: str, inputs: dict[str, int], dtype: torch.dtype) -> list[int]:
    """`asm` (`values_ptx`'s PTX: mov, shr, lop3 and fma on 16-bit pairs) run on `inputs` ($8: a word, $9:
    a scale's pattern, $10: a negated zero's), as PTX defines each instruction: outputs $0..$7's patterns.
    fma: the exact product and sum (float64; exact for these operands), rounded once to `dtype`."""
    regs = dict(inputs)

    def val(op: str) -> int:
        return int(op, 16) if op.startswith("0x") else regs[op] if op in regs else int(op)

    for line in asm.strip().removeprefix("{").removesuffix("}").split(";"):
        op, _, rest = line.strip().partition(" ")
        args = [a.strip(" {}") for a in rest.split(",")]
        if not op or op == ".reg":
            continue
        if op == "mov.b32" and rest.startswith("{"):  # {low, high} <- a register
            regs[args[0]], regs[args[1]] = val(args[2]) & 0xFFFF, val(args[2]) >> 16
        elif op == "mov.b32" and "{" in rest:  # a register <- {low, high}
            regs[args[0]] = val(args[1]) | val(args[2]) << 16
        elif op == "mov.b32":
            regs[args[0]] = val(args[1])
        elif op == "shr.u32":
            regs[args[0]] = val(args[1]) >> val(args[2])
        elif op == "lop3.b32":  # bit i of the result: bit (a_i b_i c_i) of the table
            a, b, c, table = (val(x) for x in args[1:])
            picks = ((a >> i & 1) << 2 | (b >> i & 1) << 1 | (c >> i & 1) for i in range(32))
            regs[args[0]] = sum((table >> pick & 1) << i for i, pick in enumerate(picks))
        elif op in ("fma.rn.bf16x2", "fma.rn.f16x2"):
            a, b, c = ([_half(val(x) >> sh & 0xFFFF, dtype) for sh in (0, 16)] for x in args[1:])
            lo, hi = (_pattern(a[i] * b[i] + c[i], dtype) for i in (0, 1))
            regs[args[0]] = lo | hi << 16
        else:
            raise AssertionError(f"an instruction this test does not run: {line.strip()}")
    return [regs[f"${i}"] for i in range(8)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_ptx_values_are_the_triton_paths_bits(dtype):
    """`values_ptx`'s PTX, run instruction by instruction as PTX defines them (the interpreter cannot run
    PTX; the CUDA test runs it on the GPU): for words with every nibble value, zeros 0-16 and scales of
    both signs and many magnitudes, value j of each word is (q_j - z) * s rounded once to x's dtype, the
    bits `value` and the dot's rounding give (so the magic numbers, the shifts and which output each
    half goes to are checked here)."""
    from gapless.model.quant import int4_values

    asm = (int4_values._BF16_VALUES_ASM if dtype == torch.bfloat16 else int4_values._FP16_VALUES_ASM).value
    magic = 128.0 if dtype == torch.bfloat16 else 1024.0
    gen = torch.Generator().manual_seed(0)
    words = torch.randint(-(2**31), 2**31, (48,), generator=gen, dtype=torch.int64).tolist()
    words += [0, -1, 0x76543210, 0x0F0F0F0F]
    scales = (
        torch.randn(len(words), generator=gen) * 10.0 ** torch.randint(-4, 2, (len(words),), generator=gen)
    ).tolist()
    zeros = torch.randint(0, 17, (len(words),), generator=gen).tolist()
    for word, scale, zero in zip(words, scales, zeros):
        s = _half(_pattern(scale, dtype), dtype)  # (the scale as held: in x's dtype)
        inputs = {"$8": word & 0xFFFFFFFF, "$9": _pattern(s, dtype), "$10": _pattern(-(zero + magic), dtype)}
        want = [_pattern((((word & 0xFFFFFFFF) >> 4 * j & 15) - zero) * s, dtype) for j in range(8)]
        assert _run_ptx(asm, inputs, dtype) == want, (hex(word), s, zero)
