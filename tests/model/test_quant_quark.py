"""AMD Quark's checkpoints (`quant_method: quark`): each scheme Quark's `LLMTemplate` names, written as
Quark 0.13 exports it (`gapless.testing.quark_checkpoints`; the files Quark itself wrote are read in
`bench/results/quant_writers_cpu/read_quark.log`), holds its weights bit for bit and answers as
transformers on them; its FP8 KV cache's scales are taken; what is not run is refused in one line."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch

from gapless import LLM, SamplingParams
from gapless.__main__ import main
from gapless.model import loader
from gapless.model.quant import quantization, weights_held
from gapless.model.quant.formats import QuantFormatError, resolve
from gapless.testing.fp8_checkpoints import quant_config as fp8_config
from gapless.testing.hf_reference import assert_agrees, load_hf_model
from gapless.testing.quant_checkpoints import assert_refused_after, experts_of, linear_layers
from gapless.testing.quark_checkpoints import (
    KV_SCALE,
    SCHEMES,
    quantization_config,
    tensor_config,
    write_quark,
)
from gapless.testing.ranks import load_as_ranks

CPU = torch.device("cpu")
LABELS = {
    "fp8": "quark fp8 e4m3 per-tensor",
    "fp8+kv": "quark fp8 e4m3 per-tensor",
    "ptpc_fp8": "quark fp8 e4m3 per-channel",
    "int8": "quark w8a16 tensor",
    "uint4_wo_32": "quark w4a16 g32",
    "uint4_wo_32@order": "quark w4a16 g32",
    "int4_wo_32": "quark w4a16 g32",
    "uint4_wo_per_channel": "quark w4a16 channel",
    "int4_wo_per_channel": "quark w4a16 channel",
    "mxfp4": "quark mxfp4 g32",
}
FP8 = ("fp8", "fp8+kv", "ptpc_fp8")


def _held(layer: torch.nn.Module) -> torch.Tensor:
    """A quantized linear layer's weight as it holds it, float32 (FP8: the CPU's dequantized copy)."""
    held = layer.linear_method.dequantized
    return held(torch.float32) if callable(held) else held


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_each_scheme_holds_its_weights_bit_for_bit(
    ckpt_factory, tmp_path, int4_reference_path, monkeypatch, scheme, arch
):
    """Every projection (a mixture's experts, stacked from each expert's tensors, among them) holds the
    weight its tensors say, as the float32 reference holds it, under the scheme's name."""
    monkeypatch.setenv("GAPLESS_CPU_GEMM", "plain")  # (the reference's float weights left as loaded)
    qdir, ref = write_quark(ckpt_factory(arch), tmp_path, scheme)
    model, reference = loader.load_model(qdir, torch.float32, CPU), loader.load_model(ref, torch.float32, CPU)
    formats, _ = weights_held(model)
    layers = linear_layers(model)
    assert quantization(model) == "quark" and formats[LABELS[scheme]] == len(layers), formats
    for name, m in model.named_modules():
        if m in layers:
            assert torch.equal(_held(m), reference.get_submodule(name).weight), name
    for ours, theirs in zip(experts_of(model), experts_of(reference), strict=True):
        assert ours.weight_format == f"{LABELS[scheme]} experts" and ours.cpu_weights is not None
        assert torch.equal(ours.cpu_weights[0].float(), theirs.gate_up_proj)
        assert torch.equal(ours.cpu_weights[1].float(), theirs.down_proj)
    assert torch.equal(model.lm_head.weight, reference.lm_head.weight)  # (excluded, as Quark's `lm_head`)


@pytest.mark.parametrize("scheme", [s for s in SCHEMES if s not in FP8])
def test_weight_only_schemes_answer_as_transformers_on_their_weights(
    ckpt_factory, tmp_path, int4_reference_path, scheme
):
    qdir, ref = write_quark(ckpt_factory("llama"), tmp_path, scheme)
    assert_agrees(qdir, load_hf_model(ref))


@pytest.mark.parametrize(("scheme", "layout"), [("fp8", "ct-tensor"), ("ptpc_fp8", "ct-channel")])
def test_fp8_schemes_answer_as_the_compressed_tensors_checkpoint_of_the_same_tensors(
    ckpt_factory, tmp_path, scheme, layout
):
    """Quark's FP8 W8A8 runs as every FP8 checkpoint does (activations rounded per token at run time):
    the same tokens as the compressed-tensors checkpoint of the same e4m3 weights and scales, whose parity
    with transformers `tests/model/test_quant_fp8.py` checks."""
    qdir, _ = write_quark(ckpt_factory("qwen3"), tmp_path, scheme)
    same = shutil.copytree(qdir, tmp_path / layout)
    config = json.loads((same / "config.json").read_text())
    (same / "config.json").write_text(
        json.dumps({**config, "quantization_config": fp8_config(layout, (0, 0))})
    )
    options = dict(device="cpu", dtype="float32", kv_cache_tokens=1024, overlap=False)
    prompts = [[5, 9, 33, 2], [7] * 12, [100, 3, 71]]
    answers = []
    for path in (qdir, same):
        with LLM(str(path), **options) as llm:
            params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
            answers.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert answers[0] == answers[1]


def test_the_kv_cache_takes_its_scales_with_kv_cache_dtype_fp8(ckpt_factory, tmp_path):
    """`+kv` (AMD's `*-FP8-KV` models): with `--kv-cache-dtype fp8` the cache is e4m3 with each layer's k
    and v projections' output scale; `auto` keeps the model's dtype, as vLLM does for Quark's."""
    qdir, _ = write_quark(ckpt_factory("qwen3"), tmp_path, "fp8+kv")
    options = dict(device="cpu", dtype="float32", kv_cache_tokens=256, overlap=False)
    with LLM(str(qdir), kv_cache_dtype="fp8", **options) as llm:
        pool = llm.engine.runner.kv_pool
        assert pool.k[0].dtype == torch.float8_e4m3fn
        assert pool.scales.flatten().tolist() == pytest.approx([KV_SCALE] * 4)
    with LLM(str(qdir), **options) as llm:
        assert llm.engine.runner.kv_pool.k[0].dtype == torch.float32


def _edited(scheme: str, edit) -> dict:
    qcfg = copy.deepcopy(quantization_config(scheme))
    edit(qcfg)
    return qcfg


def _set(path: tuple[str, ...], value):
    def edit(qcfg: dict) -> None:
        target = qcfg
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return edit


G, W, IN = "global_quant_config", "weight", "input_tensors"
REFUSED = [
    (
        "fp8",
        _set((G, W), [tensor_config("fp8_e4m3", "per_tensor"), tensor_config("int4", "per_channel")]),
        "two-level tensor schemes (fp8_e4m3+int4) are not run",
    ),
    (
        "fp8",
        _set(("layer_quant_config", "*down_proj"), {W: tensor_config("int8", "per_tensor"), IN: None}),
        "layers in 2 schemes (fp8_e4m3 per_tensor, int8 per_tensor); one scheme for every quantized layer",
    ),
    (
        "fp8+kv",
        _set(("layer_quant_config", "*k_proj", "output_tensors"), tensor_config("int8", "per_tensor")),
        "a KV cache in int8 per_tensor is not run; fp8_e4m3 per_tensor",
    ),
    (
        "fp8",
        _set((G, "output_tensors"), tensor_config("fp8_e4m3", "per_tensor")),
        "global_quant_config quantizes the layer's output: not run",
    ),
    ("fp8", _set((G, IN), None), "fp8_e4m3 weights with float activations are not run (W8A8 fp8 only)"),
    (
        "uint4_wo_32",
        _set((G, IN), tensor_config("fp8_e4m3", "per_tensor")),
        "uint4 weights with fp8_e4m3 activations are not run (w4a16 only)",
    ),
    ("uint4_wo_32", _set((G, W, "symmetric"), True), "symmetric uint4 weights are not run"),
    ("uint4_wo_32", _set((G, W, "group_size"), 48), "group_size=48 is not run"),
    ("int4_wo_32", _set(("export", "pack_method"), "zigzag"), "export.pack_method='zigzag' is not read"),
    (
        "mxfp4",
        _set((G, W, "group_size"), 16),
        "fp4 weights per_group of 16 with e8m0 scales are not run; MXFP4 (per_group of 32, e8m0)",
    ),
    ("int8", _set((G, W, "dtype"), "fp6_e3m2"), "weights in fp6_e3m2 are not run"),
    ("int8", _set((G, W, "symmetric"), False), "int8 weights per_tensor asymmetric are not run"),
    ("fp8", _set((G, W), None), "no layer scheme quantizes weights"),
]


@pytest.mark.parametrize(("scheme", "edit", "words"), REFUSED, ids=[r[2][:40] for r in REFUSED])
def test_what_is_not_run_is_refused_in_one_line(scheme, edit, words):
    with pytest.raises(QuantFormatError) as e:
        resolve(_edited(scheme, edit), None, "cpu")
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_serve_refuses_before_any_worker_starts_and_a_float_checkpoint_is_not_quantized_as_quark(
    ckpt_factory, tmp_path, capsys
):
    qdir, _ = write_quark(ckpt_factory("qwen3"), tmp_path, "int8")
    config = json.loads((qdir / "config.json").read_text())
    config["quantization_config"]["global_quant_config"][W]["dtype"] = "fp6_e2m3"
    (qdir / "config.json").write_text(json.dumps(config))
    assert main(["serve", str(qdir), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "quantization quark: weights in fp6_e2m3 are not run" in err and err.count("\n") == 1, err
    with pytest.raises(QuantFormatError, match="--quantization quark reads a checkpoint quantized as quark"):
        resolve(None, "quark", "cpu")


def test_a_uint4_layer_without_its_zero_points_is_refused_by_name(ckpt_factory, tmp_path):
    qdir, _ = write_quark(ckpt_factory("qwen3"), tmp_path, "uint4_wo_32")

    def drop(tensors: dict) -> None:
        del tensors["model.layers.1.mlp.down_proj.weight_zero_point"]

    assert_refused_after(qdir, drop, ("model.layers.1.mlp.down_proj", "lacks weight_zero_point"))


@pytest.mark.parametrize("scheme", ["uint4_wo_32", "int4_wo_per_channel", "ptpc_fp8", "mxfp4"])
def test_tensor_parallel_ranks_hold_their_piece_of_each_weight(
    ckpt_factory, tmp_path, int4_reference_path, monkeypatch, scheme
):
    """Built as rank r of 2, every layer holds its rows (or columns) of the weight, as the float32
    reference's rank r holds them: scales and zero points are cut with their weights."""
    monkeypatch.setenv("GAPLESS_CPU_GEMM", "plain")
    qdir, ref = write_quark(ckpt_factory("qwen3"), tmp_path, scheme)
    _, ranks = load_as_ranks(qdir)
    _, float_ranks = load_as_ranks(ref)
    for rank, float_rank in zip(ranks, float_ranks, strict=True):
        layers = linear_layers(rank)
        assert weights_held(rank)[0][LABELS[scheme]] == len(layers)
        for name, m in rank.named_modules():
            if m in layers:
                assert torch.equal(_held(m), float_rank.get_submodule(name).weight), name
