"""The libraries' int4 GEMMs `GAPLESS_INT4_KERNEL` can name (`gapless.model.quant.int4_kernels`): on the CPU,
tinygemm's form of a weight (nibble order, scales and offsets) against the unpacked weight, the refusals
of what a library cannot take, and the CPU's reference path whatever the variable says; on CUDA, each
library's product against the dequantized matmul and a whole model's greedy tokens against the Triton
GEMM's."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from gapless import LLM, SamplingParams, env
from gapless.model.quant import int4_kernels
from gapless.model.quant.formats import QuantFormatError
from gapless.model.quant.int4 import Int4LinearMethod
from gapless.model.quant.int4_kernels import GemLite, TinyGemm, tinygemm_form
from gapless.model.quant.int4_layouts import Int4Spec, Unpacked
from gapless.testing.quant_checkpoints import quantize, write_quantized

CUDA = torch.cuda.is_available()
SPEC = Int4Spec("awq", 4, 32, sym=False)


def _weight(n: int = 64, k: int = 128, group: int = 32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(n, k, generator=gen) * 0.02, 4, group, sym=False)


def tinygemm_dequantized(w: Unpacked, dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] as tinygemm computes it from `tinygemm_form`'s scales and offsets, in float32."""
    _, sz = tinygemm_form(w, dtype)
    group = w.q.shape[1] // w.scale.shape[1]
    scale, offset = (sz[..., i].float().t().repeat_interleave(group, dim=1) for i in (0, 1))
    return (w.q.float() - 8.0) * scale + offset


def test_env_names_the_kernel(monkeypatch):
    assert env.INT4_KERNEL.get() == "auto" and int4_kernels.chosen() == "auto"
    monkeypatch.setenv("GAPLESS_INT4_KERNEL", "TinyGemm")
    assert int4_kernels.chosen() == "tinygemm"
    monkeypatch.setenv("GAPLESS_INT4_KERNEL", "marlin")
    with pytest.raises(
        ValueError, match="GAPLESS_INT4_KERNEL='marlin': not one of auto, triton, tinygemm, gemlite"
    ):
        int4_kernels.chosen()
    assert all(env.INT4_KERNEL.parse(k) == k for k in int4_kernels.KERNELS)  # the module's choices


CPU_KERNEL = int4_kernels.CPU_KERNEL


@pytest.mark.parametrize(
    "bits,group,dtype,n,k,kernel,on_cpu",
    [
        (4, 128, torch.bfloat16, 4096, 4096, "tinygemm+triton", CPU_KERNEL),
        (4, 32, torch.bfloat16, 64, 128, "tinygemm+triton", CPU_KERNEL),
        (8, 128, torch.bfloat16, 4096, 4096, "triton", CPU_KERNEL),  # tinygemm: 4 bits
        (8, 4096, torch.bfloat16, 4096, 4096, "triton", CPU_KERNEL),  # (int8, a group a row)
        (8, 48, torch.bfloat16, 4096, 48, "triton", "triton"),  # (K no multiple of 32)
        (4, 128, torch.float16, 4096, 4096, "triton", CPU_KERNEL),  # tinygemm: bfloat16 only
        (4, 4096, torch.bfloat16, 4096, 4096, "triton", CPU_KERNEL),  # a group a row (CPU: as int8)
        (4, 16, torch.bfloat16, 4096, 4096, "triton", "triton"),
        (8, 16, torch.bfloat16, 4096, 4096, "triton", "triton"),
        (4, 128, torch.bfloat16, 4100, 4096, "triton", CPU_KERNEL),  # N not a multiple of 8 (CPU: padded)
    ],
)
def test_auto_takes_tinygemm_where_it_runs_the_layer(bits, group, dtype, n, k, kernel, on_cpu):
    """On CUDA tinygemm's copy beside the Triton GEMM's where tinygemm runs the layer; on the CPU torch's
    CPU kernels where they take it, else the reference path (the Triton layout's)."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert int4_kernels.for_layer("auto", bits, group, dtype, n, k, cuda) == kernel
    assert int4_kernels.for_layer("auto", bits, group, dtype, n, k, cpu) == on_cpu
    for named in ("triton", "tinygemm", "gemlite"):  # a named kernel is every layer's (refused if it cannot)
        assert int4_kernels.for_layer(named, bits, group, dtype, n, k, cuda) == named
        assert int4_kernels.for_layer(named, bits, group, dtype, n, k, cpu) == "triton"


class _FakeLibrary:
    """A library kernel's stand-in on the CPU: the product, and a record of the rows it was called on."""

    def __init__(self, w: Unpacked) -> None:
        self.w, self.rows = w.dequantize().bfloat16(), []
        self.held = [torch.zeros(7)]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.rows.append(x.shape[0])
        return x @ self.w.t()

    def tensors(self) -> list[torch.Tensor]:
        return self.held


def test_auto_runs_its_tinygemm_copy_at_decode_rows_and_the_triton_gemm_above(monkeypatch):
    """Under `auto` a layer holds both copies: up to TINYGEMM_ROWS rows the library's, above them the
    Triton layout's path (here the CPU's reference path on it); `tensors()` counts both."""
    fakes = []
    monkeypatch.setattr(int4_kernels, "for_layer", lambda *a: "tinygemm+triton")
    monkeypatch.setattr(
        int4_kernels, "library_kernel", lambda kernel, w, *a: fakes.append(_FakeLibrary(w)) or fakes[-1]
    )
    w = _weight()
    method = Int4LinearMethod(w, SPEC, torch.bfloat16, torch.device("cpu"), "auto")
    assert method.name == f"awq w4a16 g32 (tinygemm to {int4_kernels.TINYGEMM_ROWS} rows, triton above)"
    assert [t.shape for t in method.tensors()] == [(7,), (16, 64), (4, 64), (4, 64)]  # library's, then ours
    for m in (1, int4_kernels.TINYGEMM_ROWS, int4_kernels.TINYGEMM_ROWS + 1, 40):
        x = torch.randn(m, 128).bfloat16()
        y = method.apply(torch.nn.Module(), x)
        torch.testing.assert_close(y.float(), x.float() @ w.dequantize().t(), rtol=2e-2, atol=2e-2)
    assert fakes[0].rows == [1, int4_kernels.TINYGEMM_ROWS]


def test_auto_holds_one_copy_where_the_second_would_crowd_the_gpu(ckpt_factory, monkeypatch, caplog):
    """`for_model`: `auto` unless the second copies (the linear layers at `bits`) would take more than
    SECOND_COPY_SHARE of the GPU's memory, then `triton`, said in the log; a named kernel stays."""
    from gapless.model.config import load_model_config
    from gapless.model.decoder import CausalLM
    from gapless.model.quant.int4 import is_quantized_linear

    model = CausalLM(load_model_config(ckpt_factory("qwen3")))  # (as the loader weighs it: before packing)
    numel = sum(m.weight.numel() for m in model.modules() if is_quantized_linear(m))
    assert 0 < numel < sum(p.numel() for p in model.parameters())  # (not the embedding, not the head)
    cuda = torch.device("cuda")
    for total, expected in ((numel // 2 * 5, "auto"), (numel // 2 * 5 - 8, "triton")):
        props = type("Props", (), {"total_memory": total})()
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device, p=props: p)
        with caplog.at_level("WARNING", logger="gapless.model.quant.int4_kernels"):
            assert int4_kernels.for_model(numel, 4, torch.bfloat16, cuda) == expected
        assert ("tinygemm's for decode would take" in caplog.text) == (expected == "triton")
        caplog.clear()
    # (the GPU still too small) no layer of 8 bits or in float16 gets a second copy: nothing to weigh
    assert int4_kernels.for_model(numel, 8, torch.bfloat16, cuda) == "auto"
    assert int4_kernels.for_model(numel, 4, torch.float16, cuda) == "auto"
    assert int4_kernels.for_model(numel, 4, torch.bfloat16, torch.device("cpu")) == "auto"
    monkeypatch.setenv("GAPLESS_INT4_KERNEL", "tinygemm")
    assert int4_kernels.for_model(numel, 4, torch.bfloat16, cuda) == "tinygemm"


def test_the_int4_bench_times_the_triton_gemm_on_its_own_layout(monkeypatch):
    """`gapless.bench.int4_gemm`'s Triton rows hold the Triton layout alone whatever kernel the layer would
    get (on CUDA, `auto` gives a bf16 4-bit layer tinygemm's too: the bench then failed on its tensors)."""
    import argparse

    from gapless.bench import int4_gemm

    # as on CUDA: a kernel named stays, `auto` gives a bf16 4-bit layer both copies
    monkeypatch.setattr(
        int4_kernels, "for_layer", lambda choice, *a: "tinygemm+triton" if choice == "auto" else choice
    )
    args = argparse.Namespace(bits=4, group=32)
    _, method, _ = int4_gemm._layer(128, 64, args, torch.device("cpu"), torch.bfloat16)
    assert method.library is None and [t.shape for t in method.tensors()] == [(16, 64), (4, 64), (4, 64)]


def test_tinygemm_form_packs_nibbles_in_order_and_offsets_the_zero():
    """Byte j of row n holds q[n, 2j] in its high nibble and q[n, 2j + 1] in its low one; the scales and
    offsets give (q - zero) * scale (the scale in bfloat16, as the Triton GEMM holds it) to within the
    offset's one bfloat16 rounding."""
    w = _weight()
    nibbles, sz = tinygemm_form(w, torch.bfloat16)
    assert nibbles.dtype == torch.uint8 and nibbles.shape == (64, 64)
    assert torch.equal((nibbles >> 4).to(torch.int16), w.q[:, ::2])
    assert torch.equal((nibbles & 15).to(torch.int16), w.q[:, 1::2])
    assert sz.shape == (128 // 32, 64, 2) and sz.dtype == torch.bfloat16
    exact = (w.q.float() - w.zero.repeat_interleave(32, 1)) * w.scale.bfloat16().float().repeat_interleave(
        32, 1
    )
    offset = sz[..., 1].float().t().repeat_interleave(32, 1)
    err = (tinygemm_dequantized(w, torch.bfloat16) - exact).abs()
    assert (err <= offset.abs() * 2**-8 + 1e-12).all()
    assert err.max() > 0  # the offset is rounded: not the exact weight
    # a zero off by one would be a whole step: far outside that bound
    shifted = (
        w.q.float() - 1 - w.zero.repeat_interleave(32, 1)
    ) * w.scale.bfloat16().float().repeat_interleave(32, 1)
    assert not ((tinygemm_dequantized(w, torch.bfloat16) - shifted).abs() <= offset.abs() * 2**-8).all()


@pytest.mark.parametrize(
    ("bits", "dtype", "n", "k", "group", "what"),
    [
        (8, torch.bfloat16, 64, 128, 32, "4 bits in bfloat16 only"),
        (4, torch.float16, 64, 128, 32, "4 bits in bfloat16 only"),
        (4, torch.bfloat16, 64, 128, 16, "groups of 16: it takes 32, 64, 128, 256"),
        (4, torch.bfloat16, 60, 128, 32, "N a multiple of 8"),
    ],
)
def test_tinygemm_refuses_what_it_cannot_run(bits, dtype, n, k, group, what):
    w = _weight(n, k, group)
    with pytest.raises(QuantFormatError, match=f"GAPLESS_INT4_KERNEL=tinygemm: awq.*{what}"):
        TinyGemm(w, bits, dtype, torch.device("cpu"), "awq w4a16 g32")


@pytest.mark.skipif(importlib.util.find_spec("gemlite") is not None, reason="gemlite is installed")
def test_gemlite_refused_by_name_where_not_installed():
    with pytest.raises(QuantFormatError, match="GAPLESS_INT4_KERNEL=gemlite: .*needs the gemlite package"):
        GemLite(_weight(), 4, torch.bfloat16, torch.device("cpu"), "awq w4a16 g32")


@pytest.mark.parametrize(
    ("kernel", "bits", "group", "dtype", "what"),
    [
        ("tinygemm", 8, 128, torch.bfloat16, "4 bits in bfloat16 only"),
        ("tinygemm", 4, -1, torch.bfloat16, "groups of -1"),
        ("tinygemm", 4, 512, torch.bfloat16, "groups of 512"),
        ("gemlite", 4, 16, torch.float16, "groups of >= 32|needs the gemlite package"),
        ("gemlite", 4, 128, torch.float32, "bfloat16 or float16|needs the gemlite package"),
    ],
)
def test_a_scheme_the_kernel_cannot_run_is_refused_before_any_layer(kernel, bits, group, dtype, what):
    """`check`, which the loader calls before any weight loads when the variable names a library."""
    with pytest.raises(QuantFormatError, match=f"GAPLESS_INT4_KERNEL={kernel}: gptq.*({what})"):
        int4_kernels.check(kernel, bits, group, dtype, "gptq w4a16")
    for ok in ((4, 128, torch.bfloat16), (4, 32, torch.bfloat16)):
        int4_kernels.check("tinygemm", *ok, "gptq w4a16")  # what it takes passes


def test_the_cpu_keeps_its_reference_path(monkeypatch):
    """The variable names a CUDA kernel: a CPU layer still holds the Triton layout and dequantizes."""
    monkeypatch.setenv("GAPLESS_INT4_KERNEL", "tinygemm")
    w = _weight()
    method = Int4LinearMethod(w, SPEC, torch.float32, torch.device("cpu"))
    assert method.library is None and method.name == "awq w4a16 g32"
    x = torch.randn(3, 128)
    layer = torch.nn.Module()
    torch.testing.assert_close(method.apply(layer, x), x @ w.dequantize().t(), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not CUDA, reason="the libraries' kernels run on CUDA; their forms are checked above")
@pytest.mark.parametrize("kernel", ["tinygemm", "gemlite", "auto"])
@pytest.mark.parametrize("m", [1, 5, 33])
def test_cuda_library_kernel_computes_the_product(kernel, m, monkeypatch):
    """Each library's product; `auto`'s tinygemm copy at 1 and 5 rows, its Triton GEMM at 33."""
    if kernel == "gemlite" and importlib.util.find_spec("gemlite") is None:
        pytest.skip("gemlite is not installed (the `gemlite` extra)")
    monkeypatch.setenv("GAPLESS_INT4_KERNEL", kernel)
    w = _weight(256, 512, 128)
    dev = torch.device("cuda")
    method = Int4LinearMethod(w, Int4Spec("awq", 4, 128, sym=False), torch.bfloat16, dev)
    label = {"auto": f"tinygemm to {int4_kernels.TINYGEMM_ROWS} rows, triton above"}.get(kernel, kernel)
    assert method.library is not None and method.name.endswith(f"({label})")
    x = torch.randn(m, 512, device=dev).bfloat16()
    ref = x.float() @ w.dequantize().to(dev).bfloat16().float().t()
    got = method.apply(torch.nn.Module(), x).float()
    assert (got - ref).abs().max() <= 2e-2 * ref.abs().max()


@pytest.mark.skipif(not CUDA, reason="the libraries' kernels run on CUDA; their forms are checked above")
def test_cuda_tinygemm_model_gives_the_triton_gemms_greedy_tokens(ckpt_factory, tmp_path, monkeypatch):
    """A whole AWQ model in bfloat16 on tinygemm (the default `auto` takes it for every layer): the Triton
    GEMM's greedy tokens, or a first divergence where the Triton run's top two tokens lie within
    bfloat16's noise (0.05 in logprob)."""
    src = ckpt_factory("qwen3", hidden_size=128, intermediate_size=256)
    path = write_quantized(src, tmp_path / "awq", "awq", bits=4, group=32, sym=False)[0]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    outs = {}
    for kernel in ("triton", "auto"):
        monkeypatch.setenv("GAPLESS_INT4_KERNEL", kernel)
        with LLM(str(path), device="cuda", dtype="bfloat16", kv_cache_tokens=512) as llm:
            outs[kernel] = llm.generate(prompts, params, use_tqdm=False)
            formats = [f for f, _ in llm.engine.info.weight_formats if "awq" in f]
            assert formats and all(("tinygemm" in f) == (kernel == "auto") for f in formats), formats
    for ours, ref in zip(outs["auto"], outs["triton"], strict=True):
        step = next((i for i, (a, b) in enumerate(zip(ours.token_ids, ref.token_ids)) if a != b), None)
        if step is not None:
            (_, first), (_, second) = ref.top_logprobs[step][:2]
            assert first - second <= 0.05, (step, ours.token_ids, ref.token_ids)


@pytest.mark.skipif(not CUDA, reason="the loader checks the kernel only for a CUDA load")
def test_cuda_load_refuses_the_kernels_unrunnable_scheme_before_loading(ckpt_factory, tmp_path, monkeypatch):
    path = write_quantized(ckpt_factory("qwen3"), tmp_path / "gptq", "gptq", bits=8, group=32, sym=True)[0]
    monkeypatch.setenv("GAPLESS_INT4_KERNEL", "tinygemm")
    with pytest.raises(QuantFormatError, match="tinygemm runs 4 bits in bfloat16 only"):
        LLM(str(path), device="cuda", dtype="bfloat16", kv_cache_tokens=256)
