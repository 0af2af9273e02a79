"""Intel's AutoRound checkpoints (`quant_method: auto-round`, `gapless.model.quant.int4_configs`): each
`packing_format` read as the layout it stores (GPTQ's with v1 or v2 zeros, AWQ's), schemes not run
refused in one line, whole models in each packing against transformers on the same weights dequantized,
and checkpoints auto-round itself wrote read as auto-round's own readers read them (where it is
installed)."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gapless import LLM, SamplingParams
from gapless.model import loader
from gapless.model.moe import Experts
from gapless.model.quant import weights_held
from gapless.model.quant.formats import QuantFormatError, resolve
from gapless.model.quant.int4 import Int4LinearMethod
from gapless.model.quant.int4_configs import int4_spec_from_config
from gapless.model.quant.int4_layouts import unpack
from gapless.testing.hf_reference import check_greedy, hf_greedy, make_prompts
from gapless.testing.quant_checkpoints import (
    AUTO_ROUND,
    layout_tensors,
    quantization_config,
    quantize,
    write_quantized,
)

MAX_NEW = 8
pytestmark = pytest.mark.usefixtures("int4_reference_path")  # (exact against the dequantized weights)


@pytest.mark.parametrize("packing", list(AUTO_ROUND))
@pytest.mark.parametrize("sym", [True, False])
def test_each_packing_unpacks_to_the_quantizers_weights(packing, sym):
    """The tensors each packing stores (GPTQ's without g_idx, its zeros minus one under `auto_gptq` and
    as they are under `auto_round`; AWQ's) unpack to the very weights quantized; the label names the
    producer and the layout."""
    spec = int4_spec_from_config(quantization_config(packing, 4, 32, sym))
    layout = AUTO_ROUND[packing]
    assert spec is not None and spec.method == layout.removesuffix("_v2")
    assert spec.label == f"auto-round w4a16 g32 ({spec.method} layout)"
    assert spec.zero_offset == (1 if layout == "gptq" else 0)
    w = quantize(torch.randn(24, 128, generator=torch.Generator().manual_seed(7)), 4, 32, sym)
    stored = layout_tensors(w, packing, 4, 32)
    assert "g_idx" not in stored
    torch.testing.assert_close(unpack(spec, stored, "probe").dequantize(), w.dequantize(), rtol=0, atol=0)


def test_the_config_names_and_the_flags():
    """No `packing_format`: auto-round's default (`auto_gptq`); Intel Neural Compressor's older
    `intel/auto-round`; `--quantization auto-round` and vLLM's `inc` repeat the checkpoint's format; a
    layer kept float by `extra_config`, or an LM head quantized as the rest, is read from the checkpoint,
    not refused."""
    qc = quantization_config("auto_round:auto_gptq", 4, 128, True)
    spec = resolve(qc, None, "cpu")
    assert spec is not None and spec.name == "auto-round" and spec.weight_only is not None
    assert spec.label == "auto-round w4a16 g128 (gptq layout)"
    assert resolve({k: v for k, v in qc.items() if k != "packing_format"}, None, "cpu") == spec
    assert resolve(qc, "inc", "cpu") == spec and resolve(qc, "auto-round", "cpu") == spec
    old = resolve({**qc, "quant_method": "intel/auto-round"}, None, "cpu")
    assert old is not None and old.weight_only == spec.weight_only
    kept_float = {**qc, "extra_config": {"model.layers.0.mlp.down_proj": {"bits": 16, "data_type": "float"}}}
    assert resolve(kept_float, None, "cpu") == spec
    head = resolve(quantization_config("auto_round:auto_gptq", 4, 128, True, head=True), None, "cpu")
    assert head is not None and head.weight_only == replace(
        spec.weight_only, lm_head=True
    )  # (--quant_lm_head)
    with pytest.raises(QuantFormatError, match="--quantization inc runs a auto-round checkpoint"):
        resolve(quantization_config("gptq", 4, 128, True), "inc", "cpu")


_BASE = quantization_config("auto_round:auto_gptq", 4, 128, True)
REFUSED = [
    (
        {"packing_format": "auto_round:llm_compressor"},
        "packing_format='auto_round:llm_compressor' is not read",
    ),
    ({"data_type": "nv_fp"}, "data_type='nv_fp' is not run"),
    ({"act_bits": 8}, "act_bits=8 (quantized activations) is not run"),
    ({"bits": 5}, "bits=5 is not run"),
    ({"packing_format": "auto_round:auto_awq", "bits": 3}, "bits=3 is not run"),
    ({"packing_format": "auto_round:auto_awq", "bits": 8}, "bits=8 is not run"),
    ({"group_size": 100}, "group_size=100 is not run"),
    ({"extra_config": {"lm_head": {"bits": 8}}}, "extra_config 'lm_head' quantizes with its own bits"),
    (
        {"extra_config": {r".*mlp\.down_proj": {"bits": 8}}},
        r"extra_config '.*mlp\\.down_proj' quantizes with its own bits: not built",
    ),
    ({"extra_config": {"model.layers.0.mlp.up_proj": {"sym": False}}}, "its own sym: not built"),
]


@pytest.mark.parametrize("change,says", REFUSED, ids=[s for _, s in REFUSED])
def test_schemes_not_run_are_refused_in_one_line(change, says):
    with pytest.raises(QuantFormatError, match=r"^quantization_config \(auto-round\): ") as e:
        resolve({**_BASE, **change}, None, "cpu")
    assert says in str(e.value) and "\n" not in str(e.value)


def _greedy(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    with LLM(str(model), device="cpu", dtype="float32", kv_cache_tokens=2048, overlap=False) as llm:
        outs = llm.generate(
            prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True), use_tqdm=False
        )
    return [o.token_ids for o in outs]


def _agrees_with_transformers(qdir: Path, refdir: Path) -> None:
    """gapless's greedy tokens on `qdir` are transformers' on `refdir` (the same weights dequantized), a
    near-tie's divergence at most."""
    from transformers import AutoModelForCausalLM

    prompts = make_prompts(1000, n=3, max_len=30, shared_prefix=8)
    ref = AutoModelForCausalLM.from_pretrained(str(refdir), dtype=torch.float32).eval()
    notes = [check_greedy(o, hf_greedy(ref, p, MAX_NEW)) for o, p in zip(_greedy(qdir, prompts), prompts)]
    assert sum(n is not None for n in notes) <= 1, notes


@pytest.mark.parametrize(
    "arch,packing,bits,sym",
    [
        ("llama", "auto_round:auto_gptq", 4, True),
        ("qwen3", "auto_round", 4, False),  # (its own asymmetric format: GPTQ's layout, v2 zeros)
        ("qwen2", "auto_round:auto_awq", 4, False),  # q/k/v bias, tied head
        ("phi3", "auto_round:auto_gptq", 8, False),  # q/k/v and gate/up fused in the checkpoint
        ("qwen3_moe", "auto_round:auto_gptq", 4, True),  # every expert's projections
    ],
)
def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(
    ckpt_factory, tmp_path, arch, packing, bits, sym
):
    qdir, refdir = write_quantized(ckpt_factory(arch), tmp_path, packing, bits=bits, group=32, sym=sym)
    model = loader.load_model(qdir, torch.float32, torch.device("cpu"))
    formats, held = weights_held(model)
    layout = AUTO_ROUND[packing].removesuffix("_v2")
    assert any(f.startswith(f"auto-round w{bits}a16 g32 ({layout} layout)") for f in formats), formats
    assert held < weights_held(loader.load_model(refdir, torch.float32, torch.device("cpu")))[1]
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert all(e.int_quant is not None for e in experts) and len(experts) == (arch == "qwen3_moe")
    _agrees_with_transformers(qdir, refdir)


def test_a_layer_extra_config_keeps_float_loads_float(ckpt_factory, tmp_path):
    """A layer auto-round kept float (`extra_config` bits 16: stored as its float weight) loads float
    beside the quantized ones; the tokens are the reference's."""
    qdir, refdir = write_quantized(
        ckpt_factory("qwen3"), tmp_path, "auto_round:auto_gptq", group=32, sym=True
    )
    float_module = "model.layers.1.self_attn.o_proj"
    tensors = {k: v for k, v in load_file(str(qdir / "model.safetensors")).items() if float_module not in k}
    tensors[f"{float_module}.weight"] = load_file(str(refdir / "model.safetensors"))[f"{float_module}.weight"]
    save_file(tensors, str(qdir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((qdir / "config.json").read_text())
    config["quantization_config"]["extra_config"] = {float_module: {"bits": 16, "data_type": "float"}}
    (qdir / "config.json").write_text(json.dumps(config))
    model = loader.load_model(qdir, torch.float32, torch.device("cpu"))
    assert not isinstance(model.get_submodule(float_module).linear_method, Int4LinearMethod)
    assert isinstance(model.get_submodule("model.layers.0.self_attn.o_proj").linear_method, Int4LinearMethod)
    _agrees_with_transformers(qdir, refdir)


AUTO_ROUND_ABSENT = importlib.util.find_spec("auto_round") is None


def _theirs(tensors: dict[str, torch.Tensor], module: str, spec, in_features: int) -> torch.Tensor:
    """`module`'s weight [N, K] in float32 as auto-round's own readers take it: its AWQ dequantization
    (`dequantize_gemm`), or its GPTQ-layout `QuantLinear` (v1 zeros) applied to the identity."""
    parts = {k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.rsplit(".", 1)[0] == module}
    if spec.method == "awq":
        from auto_round.export.export_to_awq.utils import dequantize_gemm

        scales = parts["scales"].float()
        return dequantize_gemm(parts["qweight"], parts["qzeros"], scales, spec.bits, spec.group_size).t()
    from auto_round_extension.torch.qlinear_torch_zp import QuantLinear

    n = parts["scales"].shape[1]
    layer = QuantLinear(spec.checkpoint_bits, spec.group_size, in_features, n, bias=False)
    layer.qweight, layer.qzeros, layer.scales = parts["qweight"], parts["qzeros"], parts["scales"]
    with torch.no_grad():
        return layer(torch.eye(in_features, dtype=parts["scales"].dtype)).float().t()


@pytest.mark.skipif(AUTO_ROUND_ABSENT, reason="auto-round is absent: it writes the checkpoints this reads")
@pytest.mark.parametrize(
    "fmt,sym,bits",
    [
        ("auto_round", True, 4),
        ("auto_round", False, 4),
        ("auto_round:auto_gptq", False, 4),
        ("auto_round:auto_gptq", True, 3),  # (GPTQ's 3-bit words: 32 values in 3, held as 4 bits)
        ("auto_round:auto_gptq", False, 2),
    ],
)
def test_a_checkpoint_auto_round_wrote_is_read_as_its_own_readers_read_it(
    ckpt_factory, tmp_path, fmt, sym, bits
):
    """auto-round (round-to-nearest, `iters=0`) quantizes a tiny model to `bits` and saves it in `fmt`
    (its `auto_round` format packs symmetric weights as `auto_round:auto_gptq`, asymmetric ones as AWQ's
    in 0.16): each projection unpacks to the weight auto-round's own readers give (to float16's rounding,
    in which they compute), and the model's greedy tokens are transformers' on those weights."""
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = ckpt_factory("llama")
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    rounder = AutoRound(
        model, AutoTokenizer.from_pretrained(str(src)), bits=bits, group_size=32, sym=sym, iters=0,
        disable_opt_rtn=True,
    )  # fmt: skip
    rounder.quantize_and_save(str(tmp_path / "out"), format=fmt)
    qdir = next((tmp_path / "out").iterdir())
    qcfg = json.loads((qdir / "config.json").read_text())["quantization_config"]
    spec = int4_spec_from_config(qcfg)
    assert spec is not None and spec.producer == "auto-round" and spec.checkpoint_bits == bits
    tensors = load_file(str(next(qdir.glob("*.safetensors"))))
    reference = load_file(str(src / "model.safetensors"))
    modules = sorted({k.rsplit(".", 1)[0] for k in tensors if k.endswith(".qweight")})
    assert len(modules) == 14  # (2 layers x q, k, v, o, gate, up, down)
    for module in modules:
        parts = {k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.rsplit(".", 1)[0] == module}
        ours = unpack(spec, parts, module).dequantize()
        theirs = _theirs(tensors, module, spec, ours.shape[1])
        torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=1e-6)
        reference[f"{module}.weight"] = ours
    refdir = tmp_path / "reference"
    refdir.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (refdir / f.name).write_bytes(f.read_bytes())
    save_file(reference, str(refdir / "model.safetensors"), metadata={"format": "pt"})
    _agrees_with_transformers(qdir, refdir)
