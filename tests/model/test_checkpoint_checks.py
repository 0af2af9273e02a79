"""A quantized checkpoint's tensors checked as they load (`gapless.model.quant.checkpoint_checks`), and a
float checkpoint beside a weight-only quantization config refused (`Int4Layers.finish`): each a one-line
refusal where the load went through before and served NaNs, or floats under the format's name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from gapless.model import loader
from gapless.model.quant import quantization
from gapless.testing.fp8_checkpoints import write_fp8_checkpoint
from gapless.testing.nvfp4_checkpoints import write_nvfp4
from gapless.testing.quant_checkpoints import assert_refused_after, edit_tensors, write_quantized

pytestmark = pytest.mark.usefixtures("int4_reference_path")


def _spoiled(suffix: str, value: float):
    """An edit (`assert_refused_after`) setting one value of the first tensor named `*suffix` to `value`."""

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        name = next(n for n in sorted(tensors) if n.endswith(suffix))
        t = tensors[name].float().clone()
        t.view(-1)[t.numel() // 2] = value
        tensors[name] = t.to(tensors[name].dtype)

    return edit


def _written(kind: str, src, tmp_path):
    if kind.startswith("fp8:"):
        return write_fp8_checkpoint(src, tmp_path / "q", kind[4:])[0]
    if kind.startswith("nvfp4:"):
        return write_nvfp4(src, tmp_path, kind[6:])[0]
    return write_quantized(src, tmp_path, kind)[0]


@pytest.mark.parametrize(
    "kind,suffix,value",
    [
        ("gptq", ".scales", float("nan")),
        ("awq", ".scales", float("inf")),
        ("compressed-tensors", ".weight_scale", float("-inf")),
        ("fp8:fp8", ".weight_scale_inv", float("nan")),  # Qwen's block-wise FP8
        ("fp8:ct-channel", ".weight_scale", float("inf")),
        ("nvfp4:modelopt", ".weight_scale_2", float("nan")),
        ("nvfp4:compressed-tensors", ".weight_scale", float("nan")),  # (float8 block scales)
    ],
)
def test_a_non_finite_scale_is_refused_by_name(ckpt_factory, tmp_path, kind, suffix, value):
    checkpoint = _written(kind, ckpt_factory("llama"), tmp_path)
    assert_refused_after(checkpoint, _spoiled(suffix, value), (suffix.lstrip(".") + "'", "non-finite"))


def test_zero_and_negative_scales_load(ckpt_factory, tmp_path):
    """Finite scales of any sign load: a group of zeros may have a zero scale, and GGUF's are signed."""
    checkpoint = write_quantized(ckpt_factory("llama"), tmp_path, "gptq")[0]
    edit_tensors(checkpoint, _spoiled(".scales", 0.0))
    edit_tensors(checkpoint, _spoiled("down_proj.scales", -0.5))
    loader.load_model(checkpoint, torch.float32, torch.device("cpu"))


def test_both_spellings_of_an_fp8_weight_scale_are_refused(ckpt_factory, tmp_path):
    checkpoint = write_fp8_checkpoint(ckpt_factory("llama"), tmp_path / "q", "fp8")[0]

    def both(tensors: dict[str, torch.Tensor]) -> None:
        name = next(n for n in sorted(tensors) if n.endswith(".weight_scale_inv"))
        tensors[name.removesuffix("_inv")] = tensors[name] * 2

    assert_refused_after(checkpoint, both, ("has both weight_scale", "weight_scale_inv"))


@pytest.mark.parametrize(
    "config_file,record",
    [
        ("hf_quant_config.json", {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4"}}),
        ("quantize_config.json", {"bits": 4, "group_size": 32, "desc_act": False, "sym": True}),  # AutoGPTQ
        ("config.json", {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"}),
    ],
)
def test_a_float_checkpoint_beside_a_weight_only_config_is_refused(
    ckpt_factory, tmp_path, config_file, record
):
    checkpoint = tmp_path / "float"
    shutil.copytree(ckpt_factory("llama"), checkpoint)
    if config_file == "config.json":
        config = json.loads((checkpoint / "config.json").read_text())
        (checkpoint / "config.json").write_text(json.dumps({**config, "quantization_config": record}))
    else:
        (checkpoint / config_file).write_text(json.dumps(record))
    assert_refused_after(checkpoint, lambda tensors: None, ("no layer is stored so", "a float checkpoint"))


def test_a_dummy_load_of_a_weight_only_config_is_not_refused(ckpt_factory, tmp_path):
    """`--load-format dummy` reads no tensor, so holding none is no refusal there."""
    checkpoint = write_quantized(ckpt_factory("llama"), tmp_path, "awq")[0]
    model = loader.load_model(checkpoint, torch.float32, torch.device("cpu"), dummy=True)
    assert (quantization(model) or "").startswith("awq"), quantization(model)


@pytest.mark.parametrize("layout", ["fp8", "ct-channel"])
def test_a_float_weight_in_an_fp8_layer_is_refused(ckpt_factory, tmp_path, layout):
    """A float weight where its layer is e4m3 (its scale kept) was cast to e4m3 codes and then scaled as
    them: ~1/scale off, silently."""
    checkpoint = write_fp8_checkpoint(ckpt_factory("llama"), tmp_path / "q", layout)[0]

    def floats(tensors: dict[str, torch.Tensor]) -> None:
        name = next(n for n in sorted(tensors) if n.endswith("down_proj.weight"))
        tensors[name] = torch.randn(tensors[name].shape, dtype=torch.bfloat16) * 0.02

    assert_refused_after(checkpoint, floats, ("down_proj.weight' is floats", "holds e4m3 codes"))
