"""The quantized formats and flags vLLM users bring (`gapless.model.quant.formats`):
- NVIDIA ModelOpt's FP8 checkpoints, said by config.json or by ModelOpt's own `hf_quant_config.json`
  alone, whose FP8 KV cache `--kv-cache-dtype auto` takes (as vLLM);
- older compressed-tensors checkpoints' `compression_config`, and AutoGPTQ's and AutoAWQ's own
  `quantize_config.json` and `quant_config.json` where config.json says nothing;
- `--quantization` naming vLLM's kernel for a checkpoint's format (`awq_marlin`, `gptq_marlin`,
  `moe_wna16`), and `gguf` for a GGUF file; `--load-format safetensors` and `gguf`;
- compressed-tensors' W8A8 INT8 (`int-quantized`), run as w8a16;
- SGLang's kernel names `w8a8_fp8` and `w8a8_int8`.
The weights' greedy parity with transformers is `test_quant_fp8.py`'s (FP8 layouts) and
`test_quant_int4.py`'s (int-quantized)."""

from __future__ import annotations

import json

import pytest
import torch

from gapless import LLM, SamplingParams
from gapless.memory.kv_pool import FP8
from gapless.model.config import load_model_config
from gapless.model.quant import declared, formats
from gapless.model.quant.formats import QuantFormatError
from gapless.model.quant.int4_configs import int4_spec_from_config
from gapless.model.quant.int4_layouts import split_name, unpack
from gapless.testing.fp8_checkpoints import KV_SCALE, quant_config, write_fp8_checkpoint
from gapless.testing.quant_checkpoints import quantization_config, write_quantized

AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}


def _one_line(excinfo, *words):
    msg = str(excinfo.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_modelopts_own_file_says_the_format_when_config_json_does_not(ckpt_factory, tmp_path):
    dst, _ = write_fp8_checkpoint(ckpt_factory("qwen3"), tmp_path / "q", "modelopt")
    assert "quantization_config" not in json.loads((dst / "config.json").read_text())
    qcfg = declared.checkpoint_quantization(dst)
    spec = formats.resolve(qcfg, None, "cpu")
    assert spec is not None and (spec.name, spec.label) == ("modelopt", "modelopt fp8 e4m3 per-tensor")
    assert formats.resolve(qcfg, "modelopt", "cpu") == spec  # the flag repeating it
    # config.json's own quantization_config wins over the file
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = quant_config("modelopt-channel", (128, 128))
    (dst / "config.json").write_text(json.dumps(cfg))
    assert formats.resolve(declared.checkpoint_quantization(dst), None, "cpu").label.endswith("per-channel")


def test_a_modelopt_export_of_the_kv_cache_alone_loads_float_weights(ckpt_factory, tmp_path):
    """`quant_algo: null` with `kv_cache_quant_algo: FP8`: the weights are float; the cache's scales are
    read where the cache is fp8 (`gapless.model.kv_scales`)."""
    dst, _ = write_fp8_checkpoint(ckpt_factory("qwen3"), tmp_path / "q", "modelopt")
    file = dst / declared.MODELOPT_FILE
    cfg = json.loads(file.read_text())
    cfg["quantization"]["quant_algo"] = None
    file.write_text(json.dumps(cfg))
    assert declared.checkpoint_quantization(dst) is None


@pytest.mark.parametrize(
    ("qcfg", "words"),
    [
        (
            {"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"},
            ["quant_algo 'W4A8_AWQ' is not run", "FP8_PB_WO, MXFP8, NVFP4"],
        ),
        ({"quant_method": "modelopt", "quantization": {"quant_algo": "int8_sq"}}, ["'INT8_SQ'"]),
        ({"quant_method": "modelopt_fp4", "quant_algo": "NVFP4_AWQ"}, ["'NVFP4_AWQ' is not run"]),
    ],
)
def test_modelopt_formats_not_run_are_refused_by_name(qcfg, words):
    with pytest.raises(QuantFormatError) as e:
        formats.resolve(qcfg, None, "cpu")
    _one_line(e, *words)


def test_older_compressed_tensors_checkpoints_say_it_in_compression_config(ckpt_factory, tmp_path):
    dst, _ = write_fp8_checkpoint(ckpt_factory("qwen3"), tmp_path / "q", "ct-channel")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["compression_config"] = cfg.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(cfg))
    spec = formats.resolve(declared.checkpoint_quantization(dst), None, "cpu")
    assert spec is not None and spec.label == "compressed-tensors fp8 e4m3 per-channel"


def _to_legacy_file(qdir, name, drop=(), rename=None):
    """The checkpoint `qdir` with its quantization_config moved out of config.json into `name`, as
    AutoGPTQ and AutoAWQ wrote it: the keys in `drop` left out, those in `rename` renamed."""
    cfg = json.loads((qdir / "config.json").read_text())
    qcfg = cfg.pop("quantization_config")
    (qdir / "config.json").write_text(json.dumps(cfg))
    legacy = {(rename or {}).get(k, k): v for k, v in qcfg.items() if k not in drop}
    (qdir / name).write_text(json.dumps(legacy))
    return qcfg


@pytest.mark.parametrize(
    ("layout", "name", "drop", "rename"),
    [
        # AutoGPTQ's quantize_config.json (before it said its quant_method)
        ("gptq", "quantize_config.json", ("quant_method",), None),
        # AutoAWQ's quant_config.json: its own keys (casperhansen's and TheBloke's older AWQ repositories)
        ("awq", "quant_config.json", ("quant_method",), {"bits": "w_bit", "group_size": "q_group_size"}),
        # an AWQ record under AutoGPTQ's file name, said by its keys
        ("awq", "quantize_config.json", ("quant_method",), None),
    ],
)
def test_autogptq_and_autoawq_files_say_the_format_when_config_json_does_not(
    ckpt_factory, tmp_path, layout, name, drop, rename
):
    qdir, _ = write_quantized(ckpt_factory("qwen3"), tmp_path, layout, group=32)
    want = formats.resolve(declared.checkpoint_quantization(qdir), None, "cpu")
    _to_legacy_file(qdir, name, drop, rename)
    assert "quantization_config" not in json.loads((qdir / "config.json").read_text())
    qcfg = declared.checkpoint_quantization(qdir)
    assert qcfg is not None and qcfg["quant_method"] == layout
    assert formats.resolve(qcfg, None, "cpu") == want
    assert formats.resolve(qcfg, layout, "cpu") == want  # vLLM's users pass the flag for these
    with pytest.raises(QuantFormatError) as e:
        formats.resolve(qcfg, "awq" if layout == "gptq" else "gptq", "cpu")
    _one_line(e, f"quantized as {layout}")


def test_a_checkpoint_said_by_autogptqs_file_alone_gives_the_same_tokens(ckpt_factory, tmp_path):
    """The whole load (`LLM`) of a GPTQ checkpoint said by quantize_config.json alone: the same greedy
    tokens and the same format as the checkpoint saying it in config.json. Before, its `g_idx` tensors
    had "no place in the model"."""
    qdir, _ = write_quantized(ckpt_factory("qwen3"), tmp_path / "a", "gptq", group=32)
    legacy, _ = write_quantized(ckpt_factory("qwen3"), tmp_path / "b", "gptq", group=32)
    _to_legacy_file(legacy, "quantize_config.json", drop=("quant_method",))
    prompts, params = (
        [[1, 2, 3, 4, 5], [9, 8, 7]],
        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
    )
    outs, labels = [], []
    for d in (qdir, legacy):
        with LLM(str(d), dtype="float32", kv_cache_tokens=512, overlap=False) as llm:
            outs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
            labels.append(llm.engine.info.weight_formats)
    assert outs[0] == outs[1] and labels[0] == labels[1] and "gptq" in str(labels[0]), labels


def test_a_quantized_checkpoint_declaring_nothing_is_refused_saying_so(ckpt_factory, tmp_path):
    qdir, _ = write_quantized(ckpt_factory("qwen3"), tmp_path, "gptq", group=32)
    _to_legacy_file(qdir, "notes.json")  # (the declaration gone from where it is read)
    assert declared.checkpoint_quantization(qdir) is None
    with pytest.raises(ValueError) as e:
        LLM(str(qdir), dtype="float32", kv_cache_tokens=512, overlap=False)
    _one_line(e, "has no place in the", "a quantized checkpoint's tensor", "declares no quantization")
    # declared, but as another format: the refusal names the one declared
    cfg = json.loads((qdir / "config.json").read_text())
    awq = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
    (qdir / "config.json").write_text(json.dumps({**cfg, "quantization_config": awq}))
    with pytest.raises(ValueError) as e:
        LLM(str(qdir), dtype="float32", kv_cache_tokens=512, overlap=False)
    _one_line(e, "a quantized checkpoint's tensor, which its declared awq w4a16 g32 does not hold")


def test_a_malformed_legacy_file_is_refused_by_name(ckpt_factory, tmp_path):
    qdir, _ = write_quantized(ckpt_factory("qwen3"), tmp_path, "gptq", group=32)
    _to_legacy_file(qdir, "quantize_config.json")
    (qdir / "quantize_config.json").write_text("{bits: 4")
    with pytest.raises(QuantFormatError) as e:
        declared.checkpoint_quantization(qdir)
    _one_line(e, "quantize_config.json", "is not readable JSON")
    (qdir / "quantize_config.json").write_text("[4, 128]")
    with pytest.raises(QuantFormatError) as e:
        declared.checkpoint_quantization(qdir)
    _one_line(e, "quantize_config.json", "is not a JSON object")
    config = json.loads((qdir / "config.json").read_text())
    for key, value in (("quantization_config", 5), ("compression_config", ["gptq"])):
        (qdir / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(QuantFormatError) as e:
            declared.checkpoint_quantization(qdir)
        _one_line(e, f"config.json's {key} is not a JSON object: {value!r}")
    (qdir / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError) as e:
        load_model_config(qdir)
    _one_line(e, "config.json is not a JSON object")


@pytest.mark.parametrize(
    ("qcfg", "flag", "method"),
    [
        (AWQ, "awq_marlin", "awq"),
        (GPTQ, "gptq_marlin", "gptq"),
        (AWQ, "moe_wna16", "awq"),
        (GPTQ, "moe_wna16", "gptq"),
        (AWQ, "awq_triton", "awq"),
        (GPTQ, "gptq_bitblas", "gptq"),
        (GPTQ, "ipex", "gptq"),
    ],
)
def test_vllms_kernel_names_run_the_checkpoints_own_format(qcfg, flag, method):
    spec = formats.resolve(qcfg, flag, "cpu")
    assert spec is not None and spec.name == method and spec == formats.resolve(qcfg, None, "cpu")


@pytest.mark.parametrize(
    ("qcfg", "flag", "words"),
    [
        (AWQ, "gptq_marlin", ["--quantization gptq_marlin runs a gptq checkpoint", "quantized as awq"]),
        (None, "awq_marlin", ["--quantization awq_marlin runs a awq checkpoint", "the checkpoint is float"]),
        (quant_config("fp8", (128, 128)), "moe_wna16", ["awq or gptq", "quantized as fp8"]),
        (None, "marlin", ["'marlin' is not a known format", "awq_marlin"]),
        (None, "modelopt", ["--quantization modelopt reads a checkpoint quantized as modelopt", "only fp8"]),
        (
            None,
            "gptq",
            ["--quantization gptq reads a checkpoint quantized as gptq", "declares no quantization"],
        ),
    ],
)
def test_a_kernel_name_for_another_format_is_refused_in_one_line(qcfg, flag, words):
    with pytest.raises(QuantFormatError) as e:
        formats.resolve(qcfg, flag, "cpu")
    _one_line(e, *words)


CT_FP8 = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {"group_0": {"weights": {"type": "float", "num_bits": 8, "strategy": "channel"}}},
}


@pytest.mark.parametrize(
    ("qcfg", "flag", "label"),
    [
        (quant_config("fp8", (128, 128)), "w8a8_fp8", "fp8 e4m3 block 128x128"),
        (CT_FP8, "w8a8_fp8", "compressed-tensors fp8 e4m3 per-channel"),
        (None, "w8a8_fp8", "fp8 e4m3 per-channel (quantized at load)"),
        (quantization_config("int-quantized", 8, -1, True), "w8a8_int8", "int-quantized w8a16 channel"),
    ],
)
def test_sglangs_kernel_names_run_the_checkpoint_or_quantize_a_float_one(qcfg, flag, label):
    """SGLang's `w8a8_fp8` runs an FP8 checkpoint as it is, and quantizes a float one to FP8 at load as
    `fp8` does (as SGLang does); `w8a8_int8` runs compressed-tensors' int8 W8A8 as it is (as w8a16)."""
    spec = formats.resolve(qcfg, flag, "cpu")
    assert spec is not None and label in spec.label
    assert spec == formats.resolve(qcfg, None if qcfg is not None else "fp8", "cpu")


@pytest.mark.parametrize(
    ("qcfg", "flag", "words"),
    [
        (AWQ, "w8a8_fp8", ["--quantization w8a8_fp8 runs an FP8 checkpoint", "the checkpoint is awq w4a16"]),
        (
            None,
            "w8a8_int8",
            ["--quantization w8a8_int8 runs an int8 W8A8 checkpoint", "the checkpoint is float"],
        ),
        (quantization_config("pack-quantized", 4, 128, True), "w8a8_int8", ["is compressed-tensors"]),
        (CT_FP8, "w8a8_int8", ["runs an int8 W8A8 checkpoint", "fp8 e4m3 per-channel"]),
    ],
)
def test_an_sglang_kernel_name_for_another_format_is_refused_in_one_line(qcfg, flag, words):
    with pytest.raises(QuantFormatError) as e:
        formats.resolve(qcfg, flag, "cpu")
    _one_line(e, *words)


def test_w8a8_fp8_quantizes_a_float_checkpoint_at_load(ckpt_factory):
    from gapless.model import loader
    from gapless.model.quant import quantization

    model = loader.load_model(
        ckpt_factory("qwen3"), torch.float32, torch.device("cpu"), quantization="w8a8_fp8"
    )
    assert quantization(model) == "fp8"


@pytest.mark.parametrize("layout", ["modelopt", "modelopt-channel"])
def test_auto_takes_a_modelopt_checkpoints_fp8_kv_cache_and_bfloat16_refuses_it(
    ckpt_factory, tmp_path, layout
):
    """ModelOpt's `kv_cache_quant_algo: FP8` (`hf_quant_config.json`) or config.json's `kv_cache_scheme`:
    `auto` makes the cache e4m3 with the checkpoint's k/v scales, as vLLM; `bfloat16` (vLLM's name for an
    unquantized cache) keeps the model's dtype; a checkpoint that names no KV format keeps it under `auto`."""
    dst, _ = write_fp8_checkpoint(ckpt_factory("qwen3"), tmp_path / layout, layout)
    assert declared.checkpoint_kv_cache(dst, "cpu") == "fp8_e4m3"
    opts = dict(device="cpu", dtype="float32", kv_cache_tokens=256, overlap=False)
    with LLM(str(dst), **opts) as llm:
        pool = llm.engine.runner.kv_pool
        assert pool.k[0].dtype == FP8 and pool.scales[0].flatten().tolist() == pytest.approx([KV_SCALE] * 2)
    with LLM(str(dst), kv_cache_dtype="bfloat16", **opts) as llm:
        assert llm.engine.runner.kv_pool.k[0].dtype == torch.float32
    other, _ = write_fp8_checkpoint(ckpt_factory("qwen3"), tmp_path / "ct", "ct-tensor")
    assert declared.checkpoint_kv_cache(other, "cpu") is None


def test_an_older_gpu_keeps_the_models_dtype_for_a_checkpoints_fp8_kv_cache(
    ckpt_factory, tmp_path, monkeypatch
):
    """Triton's e4m3 takes sm_89: on an Ampere GPU `auto` does not take the checkpoint's FP8 cache."""
    dst, _ = write_fp8_checkpoint(ckpt_factory("qwen3"), tmp_path / "q", "modelopt")
    for capability, want in (((8, 0), None), ((8, 9), "fp8_e4m3"), ((9, 0), "fp8_e4m3")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert declared.checkpoint_kv_cache(dst, "cuda") == want


def test_an_fp8_kv_cache_asked_for_on_an_older_gpu_is_refused_before_anything_loads(
    ckpt_factory, monkeypatch
):
    """`--kv-cache-dtype fp8` on an Ampere GPU (no e4m3 in its Triton) is refused in the pre-flight by
    name; auto and bfloat16 pass, and so does fp8 on sm_89."""
    from gapless.config import EngineConfig
    from gapless.engine.preflight import check_quantization

    src = ckpt_factory("qwen3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    for capability in ((8, 0), (8, 9)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        for kv in ("auto", "bfloat16", "fp8", "fp8_e4m3"):
            cfg = EngineConfig(model=str(src), kv_cache_dtype=kv)
            if capability == (8, 0) and kv.startswith("fp8"):
                with pytest.raises(QuantFormatError) as e:
                    check_quantization(cfg, src)
                _one_line(e, f"--kv-cache-dtype {kv}", "sm_89", "NVIDIA A100 is sm_80")
            else:
                check_quantization(cfg, src)


@pytest.mark.parametrize(
    ("kv", "want"),
    [
        ({"kv_cache_quant_algo": "fp8"}, "fp8_e4m3"),
        ({"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}, "fp8_e4m3"),
        ({"kv_cache_scheme": {"type": "float", "num_bits": 8, "dynamic": False}}, "fp8_e4m3"),
        ({"kv_cache_scheme": {"type": "float", "num_bits": 8, "dynamic": True}}, None),
        ({"kv_cache_quant_algo": "NVFP4"}, None),
        ({"kv_cache_quant_algo": None}, None),
    ],
)
def test_the_kv_cache_a_modelopt_config_names(ckpt_factory, tmp_path, kv, want):
    """vLLM's reading: static 8-bit floats or FP8, at the top or under `quantization`; anything else
    (dynamic scales, NVFP4, none) leaves `auto` the model's dtype."""
    src = ckpt_factory("qwen3")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8", **kv}
    dst = tmp_path / "m"
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(cfg))
    assert declared.checkpoint_kv_cache(dst, "cpu") == want


def test_compressed_tensors_w8a8_int8_runs_as_w8a16():
    """`int-quantized` (RedHatAI's `*-quantized.w8a8`): int8 values as they are in `weight`, a scale per
    row, per group or per tensor; the int8 activation scheme is left unused (the activations stay in the
    model's dtype), and the float layers' `weight`s are not taken for quantized ones."""
    qc = quantization_config("int-quantized", 8, -1, True)
    spec = formats.resolve(qc, None, "cpu")
    assert (
        spec is not None
        and spec.scheme == "int4"
        and spec.label == "compressed-tensors int-quantized w8a16 channel"
    )
    qc["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
    per_tensor = int4_spec_from_config(qc)
    assert per_tensor is not None and per_tensor.label == "compressed-tensors int-quantized w8a16 tensor"
    values = torch.tensor([[-3, 0, 5, 127], [1, -128, 2, 0]], dtype=torch.int8)
    w = unpack(per_tensor, {"weight": values, "weight_scale": torch.tensor([0.5])}, "probe")
    torch.testing.assert_close(w.dequantize(), values.float() * 0.5, rtol=0, atol=0)
    zero = torch.tensor([[1], [-2]], dtype=torch.int8)  # asymmetric, per row
    asym = int4_spec_from_config(quantization_config("int-quantized", 8, -1, False))
    parts = {"weight": values, "weight_scale": torch.tensor([[0.5], [0.25]]), "weight_zero_point": zero}
    want = (values.float() - zero.float()) * torch.tensor([[0.5], [0.25]])
    torch.testing.assert_close(unpack(asym, parts, "probe").dequantize(), want, rtol=0, atol=0)
    assert split_name("model.layers.0.mlp.down_proj.weight", spec.weight_only, torch.int8) is not None
    assert split_name("model.layers.0.input_layernorm.weight", spec.weight_only, torch.bfloat16) is None
    qc["config_groups"]["group_0"]["weights"]["strategy"] = "block"
    with pytest.raises(QuantFormatError, match="strategy='block' is not run; group or channel or tensor"):
        int4_spec_from_config(qc)


def test_quantization_gguf_names_a_gguf_files_own_format(ckpt_factory, tmp_path):
    """vLLM's `--quantization gguf` runs a GGUF file as it would without the flag; another format named
    for a GGUF file, and `gguf` for a safetensors checkpoint, are refused in one line."""
    from gapless.config import EngineConfig
    from gapless.engine.preflight import check_engine_config
    from gapless.testing.gguf_files import write_gguf

    path = write_gguf(ckpt_factory("llama", rope_scaling=None), tmp_path / "m.Q8_0.gguf", "Q8_0")
    check_engine_config(EngineConfig(model=str(path), device="cpu", quantization="gguf"))
    opts = dict(device="cpu", kv_cache_tokens=256, overlap=False)
    with LLM(str(path), quantization="gguf", **opts) as llm:
        assert "Q8_0" in " ".join(dict(llm.engine.info.weight_formats))
    with pytest.raises(QuantFormatError) as e:
        check_engine_config(EngineConfig(model=str(path), device="cpu", quantization="fp8"))
    _one_line(e, "--quantization fp8 applies to a safetensors checkpoint", "gguf")
    with pytest.raises(QuantFormatError) as e:
        formats.resolve(None, "gguf", "cpu")
    _one_line(e, "--quantization gguf names a GGUF file's format")


def test_load_format_takes_vllms_names_for_the_checkpoints_kind(ckpt_factory, tmp_path):
    """`--load-format safetensors` and `gguf` (vLLM's) are `auto` for a checkpoint of that kind; for the
    other kind, and for a format gapless does not read (`pt`), a one-line refusal before anything loads."""
    from gapless.config import EngineConfig
    from gapless.engine.preflight import check_engine_config
    from gapless.testing.gguf_files import write_gguf

    src = ckpt_factory("llama", rope_scaling=None)
    gguf_file = write_gguf(src, tmp_path / "m.Q8_0.gguf", "Q8_0")
    for model, fmt in ((src, "safetensors"), (gguf_file, "gguf")):
        assert check_engine_config(EngineConfig(model=str(model), device="cpu", load_format=fmt)).cfg
    for model, fmt, kind in ((gguf_file, "safetensors", "a GGUF file"), (src, "gguf", "a safetensors")):
        with pytest.raises(ValueError) as e:
            check_engine_config(EngineConfig(model=str(model), device="cpu", load_format=fmt))
        _one_line(e, f"--load-format {fmt}", kind)
    with pytest.raises(ValueError, match="load_format.*must be one of"):
        EngineConfig(model=str(src), load_format="pt")
