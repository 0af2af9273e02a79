"""FP4 checkpoints on the weight-only path: NVFP4 (ModelOpt's `quant_algo: NVFP4`, compressed-tensors'
`nvfp4-pack-quantized`) and MXFP4 (compressed-tensors' `mxfp4-pack-quantized`), FP4 codes with the e2m1
values as the Triton GEMM's codebook, each group's scale NVFP4's float8 block scale with the tensor's or
MXFP4's power of two. Tiny checkpoints written by the tests
(`gapless.testing.nvfp4_checkpoints`) against transformers on the same weights dequantized; the GEMM
itself under the interpreter; malformed files refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gapless import LLM, SamplingParams
from gapless.model import loader
from gapless.model.layers import ReplicatedLinear, _Linear
from gapless.model.moe import Experts
from gapless.model.quant import int4, quantization, weights_held
from gapless.model.quant.base import UNQUANTIZED
from gapless.model.quant.declared import checkpoint_quantization
from gapless.model.quant.formats import QuantFormatError, resolve
from gapless.model.quant.int4 import Int4LinearMethod
from gapless.testing.hf_reference import check_greedy, hf_greedy, load_hf_model, make_prompts
from gapless.testing.nvfp4_checkpoints import quantization_config, write_nvfp4
from gapless.testing.quant_checkpoints import assert_refused_after

CPU = torch.device("cpu")
MAX_NEW = 8
LABEL = {
    "modelopt": "modelopt nvfp4 g16",
    "compressed-tensors": "compressed-tensors nvfp4 g16",
    "mxfp4": "compressed-tensors mxfp4 g32",
}
GROUP = {"modelopt": 16, "compressed-tensors": 16, "mxfp4": 32}

pytestmark = pytest.mark.usefixtures("int4_reference_path")


def _greedy(model: Path, prompts: list[list[int]], device: str = "cpu") -> list[list[int]]:
    with LLM(str(model), device=device, dtype="float32", kv_cache_tokens=2048, overlap=False) as llm:
        outs = llm.generate(
            prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True), use_tqdm=False
        )
    return [o.token_ids for o in outs]


def _agrees(qdir: Path, refdir: Path) -> None:
    """Greedy tokens equal transformers' on the reference weights, or diverge at a near-tie once at most."""
    reference = load_hf_model(refdir)
    prompts = make_prompts(1000, n=3, max_len=30, shared_prefix=8)
    notes = [
        check_greedy(o, hf_greedy(reference, p, MAX_NEW)) for o, p in zip(_greedy(qdir, prompts), prompts)
    ]
    assert sum(n is not None for n in notes) <= 1, notes


@pytest.mark.parametrize(
    "arch,layout",
    [
        ("llama", "modelopt"),  # (its hf_quant_config.json)
        ("qwen3", "compressed-tensors"),
        ("phi3", "modelopt"),  # q/k/v and gate/up fused in the checkpoint
        ("qwen3_moe", "compressed-tensors"),  # each expert's projections, in the grouped GEMM's layout
        ("qwen3", "mxfp4"),
        ("qwen3_moe", "mxfp4"),
    ],
)
def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(
    ckpt_factory, tmp_path, monkeypatch, arch, layout
):
    """Every decoder projection held as FP4 codes with the e2m1 codebook, its weight the reference's bit for
    bit (the group scale in float32), the LM head float (the checkpoint leaves it), and transformers'
    greedy tokens on the reference."""
    monkeypatch.setenv("GAPLESS_CPU_GEMM", "plain")  # (the reference's float weights left as loaded)
    qdir, refdir = write_nvfp4(ckpt_factory(arch), tmp_path, layout)
    model = loader.load_model(qdir, torch.float32, CPU)
    ref = loader.load_model(refdir, torch.float32, CPU)
    linear = [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, _Linear) and not isinstance(m, ReplicatedLinear)
    ]
    assert all(isinstance(m.linear_method, Int4LinearMethod) for _, m in linear)
    assert all(
        torch.equal(m.linear_method.dequantized(torch.float32), ref.get_submodule(n).weight)
        for n, m in linear
    )
    assert model.lm_head.linear_method is UNQUANTIZED  # (the checkpoint leaves it float)
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert bool(experts) == (arch == "qwen3_moe")
    assert all(q.levels is not None and q.group == GROUP[layout] for m in experts for q in m.int_quant)
    formats = weights_held(model)[0]
    method = "compressed-tensors" if layout == "mxfp4" else layout
    assert formats[LABEL[layout]] == len(linear) and quantization(model) == method, formats
    _agrees(qdir, refdir)


@pytest.mark.parametrize("layout", ["compressed-tensors", "mxfp4"])
def test_the_triton_gemm_gives_the_reference_paths_tokens(ckpt_factory, tmp_path, monkeypatch, layout):
    """The GPU's path (the Triton GEMM over the codes, groups of 16 or 32; on CUDA where there is one, else
    under the interpreter) in a served model: the CPU reference path's greedy tokens."""
    from gapless.model.quant import int4_triton

    qdir, _ = write_nvfp4(ckpt_factory("llama"), tmp_path, layout)
    prompts = make_prompts(1000, n=2, max_len=16, shared_prefix=4)
    want = _greedy(qdir, prompts)
    gemm, groups = int4_triton.w4a16_matmul, []
    monkeypatch.setattr(int4_triton, "w4a16_matmul", lambda *a, **k: groups.append(a[4]) or gemm(*a, **k))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(int4, "TRITON_ON_CPU", device == "cpu")
    assert _greedy(qdir, prompts, device) == want
    assert len(groups) >= 2 * 4 and set(groups) == {GROUP[layout]}  # (forwards x projections)


@pytest.mark.parametrize("layout", ["modelopt", "compressed-tensors", "mxfp4"])
def test_the_config_names_the_format(tmp_path, layout):
    config = quantization_config(layout)
    if layout == "modelopt":
        (tmp_path / "config.json").write_text("{}")
        (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": config}))
        config = checkpoint_quantization(tmp_path)
    spec = resolve(config, None, "cpu")
    assert spec is not None and spec.label == LABEL[layout] and spec.weight_only is not None
    if layout == "modelopt":  # (vLLM's name of its kernel for it, as a flag and as some exports' configs
        # name it; ModelOpt's weight-only NVFP4 the same weights)
        assert resolve(config, "modelopt_fp4", "cpu") == spec
        for named in ({"quant_method": "modelopt_fp4"}, {"quant_algo": "W4A16_NVFP4"}):
            assert resolve({**config, **named}, None, "cpu") == spec


def _first(tensors: dict[str, torch.Tensor], suffix: str) -> str:
    return next(n for n in sorted(tensors) if n.endswith(suffix))


@pytest.mark.parametrize(
    "layout,edit,words",
    [
        ("compressed-tensors", lambda t: t.pop(_first(t, ".weight_scale")), ("lacks weight_scale",)),
        (
            "compressed-tensors",
            lambda t: t.__setitem__(_first(t, ".weight_global_scale"), torch.ones(2)),
            ("weight_global_scale of 2 values",),
        ),
        (
            "compressed-tensors",
            lambda t: t.__setitem__((n := _first(t, ".weight_scale")), t[n][:, :-1].contiguous()),
            ("not groups of 16",),
        ),
        ("mxfp4", lambda t: t.pop(_first(t, ".weight_packed")), ("lacks weight_packed",)),
        (
            "mxfp4",
            lambda t: t.__setitem__((n := _first(t, ".weight_scale")), t[n][:, :-1].contiguous()),
            ("not groups of 32",),
        ),
    ],
)
def test_a_broken_checkpoint_is_refused_by_name(ckpt_factory, tmp_path, layout, edit, words):
    assert_refused_after(write_nvfp4(ckpt_factory("llama"), tmp_path, layout)[0], edit, words)


def test_another_group_size_is_refused_before_anything_loads():
    config = quantization_config("compressed-tensors")
    config["config_groups"]["group_0"]["weights"]["group_size"] = 32  # type: ignore[index]
    with pytest.raises(QuantFormatError, match="NVFP4 group_size=32 is not read; 16"):
        resolve(config, None, "cpu")
    with pytest.raises(QuantFormatError, match="NVFP4 group_size=32"):
        resolve({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32}, None, "cpu")
    config = quantization_config("mxfp4")
    config["config_groups"]["group_0"]["weights"]["group_size"] = 16  # type: ignore[index]
    with pytest.raises(QuantFormatError, match="MXFP4 group_size=16 is not read; 32"):
        resolve(config, None, "cpu")


def test_a_dummy_load_holds_random_fp4_codes_and_generates(ckpt_factory, tmp_path):
    """`--load-format dummy` of an NVFP4 config (`gapless.bench.quant`'s `-nvfp4` shape): every projection
    random FP4 codes with the e2m1 codebook, the weights' spread the dummy floats' (std 0.02), and the
    engine generates."""
    qdir, _ = write_nvfp4(ckpt_factory("qwen3"), tmp_path, "compressed-tensors")
    for file in qdir.glob("*.safetensors"):
        file.unlink()
    model = loader.load_model(qdir, torch.float32, CPU, dummy=True)
    methods = [
        m.linear_method
        for m in model.modules()
        if isinstance(m, _Linear) and not isinstance(m, ReplicatedLinear)
    ]
    assert methods and all(isinstance(m, Int4LinearMethod) and m.levels is not None for m in methods)
    assert all(0.015 < float(m.dequantized(torch.float32).std()) < 0.025 for m in methods)
    with LLM(str(qdir), device="cpu", dtype="float32", load_format="dummy", kv_cache_tokens=256) as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 4
