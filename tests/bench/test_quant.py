"""`gapless.bench.quant` (bench/gpu_quant.sh's TPOT runs): the shapes it writes are the models' (config and
tokenizer, no weights; the larger ones' int4 twins an AWQ config) and its report gives each run's ratio to
the bf16 run of the same shape."""

from __future__ import annotations

import json

import pytest

from gapless.bench import quant, timing
from gapless.bench.cli import machine as this_machine
from gapless.model.config import load_model_config
from gapless.model.quant import declared, formats
from gapless.model.quant.int4_configs import int4_spec_from_config
from gapless.model.quant.int4_layouts import Int4Spec


def test_make_writes_each_shape_without_weights(tmp_path):
    paths = quant.make(tmp_path)
    assert [p.name for p in paths] == [
        "qwen3-0.6b",
        "qwen3-0.6b-awq",
        "qwen3-0.6b-gptq-head",
        "qwen3-0.6b-int8",
        "qwen3-0.6b-int8-g128",
        "qwen3-0.6b-fp8",
        "qwen3-0.6b-nf4",
        "qwen3-8b",
        "qwen3-8b-awq",
        "qwen3-8b-gptq-act",
        "qwen3-8b-gptq-head",
        "qwen3-8b-fp8",
        "qwen3-8b-nf4",
        "qwen3-8b-nvfp4",
        "qwen3-30b-a3b",
        "qwen3-30b-a3b-awq",
        "qwen3-30b-a3b-gptq-act",
    ]
    for name in ("qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b"):  # the int4 twin: the same model, AWQ g128
        twin = load_model_config(tmp_path / f"{name}-awq")
        assert twin == load_model_config(tmp_path / name)
        qc = json.loads((tmp_path / f"{name}-awq" / "config.json").read_text())["quantization_config"]
        assert int4_spec_from_config(qc) == Int4Spec("awq", 4, 128, sym=False)
        assert "quantization_config" not in json.loads((tmp_path / name / "config.json").read_text())
    qc = json.loads((tmp_path / "qwen3-8b-gptq-act" / "config.json").read_text())["quantization_config"]
    assert int4_spec_from_config(qc) == Int4Spec("gptq", 4, 128, True, zero_offset=1, act_order=True)
    qc = json.loads((tmp_path / "qwen3-8b-gptq-head" / "config.json").read_text())["quantization_config"]
    assert int4_spec_from_config(qc) == Int4Spec("gptq", 4, 128, True, zero_offset=1, lm_head=True)
    qc = json.loads((tmp_path / "qwen3-0.6b-int8" / "config.json").read_text())["quantization_config"]
    assert int4_spec_from_config(qc) == Int4Spec("gptq", 8, -1, True, zero_offset=1)
    qc = json.loads((tmp_path / "qwen3-0.6b-int8-g128" / "config.json").read_text())["quantization_config"]
    assert int4_spec_from_config(qc) == Int4Spec("gptq", 8, 128, True, zero_offset=1)
    for name in ("qwen3-0.6b", "qwen3-8b"):  # Qwen's own *-FP8: e4m3, a scale per 128 x 128 block
        spec = formats.resolve(declared.checkpoint_quantization(tmp_path / f"{name}-fp8"), None, "cpu")
        assert spec is not None and spec.label == "fp8 e4m3 block 128x128"
        assert load_model_config(tmp_path / f"{name}-fp8") == load_model_config(tmp_path / name)
    for name in ("qwen3-0.6b", "qwen3-8b"):  # unsloth's *-bnb-4bit: NF4, double-quantized
        spec = formats.resolve(declared.checkpoint_quantization(tmp_path / f"{name}-nf4"), None, "cpu")
        assert spec is not None and (spec.scheme, spec.codebook) == ("bnb", "nf4")
    assert quant._shape_of("qwen3-0.6b-int8-g128") == quant._shape_of("qwen3-0.6b-fp8") == "qwen3-0.6b"
    assert quant._shape_of("qwen3-8b-gptq-act") == quant._shape_of("qwen3-8b-awq") == "qwen3-8b"
    moe = load_model_config(tmp_path / "qwen3-30b-a3b")  # every layer a mixture of 128 experts, 8 routed
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (128, 8, 768)
    assert all(moe.moe_layers) and moe.num_layers == 48
    cfg = load_model_config(tmp_path / "qwen3-8b")
    assert (cfg.hidden_size, cfg.num_layers, cfg.intermediate_size, cfg.num_kv_heads) == (4096, 36, 12288, 8)
    assert not cfg.tie_word_embeddings and load_model_config(tmp_path / "qwen3-0.6b").tie_word_embeddings
    assert not list(tmp_path.glob("*/*.safetensors")) and (tmp_path / "qwen3-8b" / "tokenizer.json").is_file()
    assert json.loads((tmp_path / "qwen3-8b" / "config.json").read_text())["architectures"] == [
        "Qwen3ForCausalLM"
    ]


def test_report_gives_the_ratio_to_bf16():
    machine = this_machine("cpu")
    runs = [
        dict(
            shape="qwen3-8b",
            quantization=None,
            tpot_ms=10.0,
            prefill_ms=40.0,
            weights="w: 16 GB",
            machine=machine,
        ),
        dict(
            shape="qwen3-8b",
            quantization="fp8",
            tpot_ms=5.5,
            prefill_ms=30.0,
            weights="w: 8 GB",
            machine=machine,
        ),
        dict(
            shape="qwen3-8b",
            quantization="fp8",
            tpot_ms=5.0,
            weights="w: 8 GB",
            machine=machine,
            kernels={"GAPLESS_FP8_DECODE": "fp16"},
        ),
    ]
    text = quant.report(runs)
    assert "| qwen3-8b | fp8 | 5.500 | 0.55 | 30.0 | 0.75 |" in text
    assert "| qwen3-8b | bf16 | 10.000 | 1.00 | 40.0 | 1.00 |" in text
    # (a run from before the prefill was recorded)
    assert "| qwen3-8b | fp8 (GAPLESS_FP8_DECODE=fp16) | 5.000 | 0.50 | n/a | n/a |" in text


def test_a_run_records_the_kernels_its_environment_chose(monkeypatch):
    """A run under `GAPLESS_FP8_DECODE=fp16`, `GAPLESS_FP8_GEMV_ROWS=0`, `GAPLESS_PDL=1` and
    `GAPLESS_FP8_UNFUSED_NORM=1` says so in its JSON (the defaults are left out)."""
    from gapless.testing.checkpoints import cached_checkpoint

    monkeypatch.setenv("GAPLESS_FP8_DECODE", "fp16")
    monkeypatch.setenv("GAPLESS_FP8_GEMV_ROWS", "0")
    monkeypatch.setenv("GAPLESS_PDL", "1")
    monkeypatch.setenv("GAPLESS_FP8_UNFUSED_NORM", "1")
    res = quant.run(cached_checkpoint("qwen3"), {}, tokens=2, repeats=1, device="cpu")
    assert res["kernels"] == {
        "GAPLESS_FP8_DECODE": "fp16",
        "GAPLESS_FP8_GEMV_ROWS": 0,
        "GAPLESS_FP8_UNFUSED_NORM": True,
        "GAPLESS_PDL": True,
    }


def test_run_profiles_a_decode_token_on_the_cpu():
    """`run --profile` on a tiny model: each op's time a decode token, from the difference of two profiled
    requests (a longer one's ops outnumber a one-token one's), and the report's table of them."""
    from gapless.testing.checkpoints import cached_checkpoint

    # (48 tokens: the decode steps' ops stand well above the noise in the two requests' difference, which
    # on a loaded 2-core machine ranked 3 steps' matmuls below zero, and once 16 steps' out of the listed
    # ops, failing the matmul check below)
    res = quant.run(cached_checkpoint("qwen3"), {}, tokens=48, repeats=1, device="cpu", profile=True)
    assert res["prefill_ms"] > 0 and res["tpot_ms"] > 0  # (the one-token request: its prefill)
    prof = res["profile"]
    assert 0 < len(prof["ops"]) <= timing.PROFILE_TOP and prof["us_per_step"] > 0
    times = [us for _, us, _ in prof["ops"]]
    assert times == sorted(times, reverse=True) and all(t > 0 for t in times)
    assert abs(sum(times) + prof["other_us"] - prof["us_per_step"]) < 1e-6 * prof["us_per_step"]
    # a decode token runs the model's matmuls: at least one a token, summed as GEMMs
    assert any("mm" in name or "linear" in name for name, _, calls in prof["ops"] if calls >= 1)
    assert set(prof["kinds"]) == {"GEMMs", "attention", "other"} and prof["kinds"]["GEMMs"] > 0
    assert abs(sum(prof["kinds"].values()) - prof["us_per_step"]) < 1e-6 * prof["us_per_step"]
    text = quant.report([res])
    assert f"| {prof['ops'][0][0]} | {prof['ops'][0][1]:.1f} |" in text and "of TPOT's" in text
    assert f"GEMMs {prof['kinds']['GEMMs']:.0f}, attention" in text


def test_a_decode_profile_takes_the_least_of_the_one_token_runs(monkeypatch):
    """A one-token run slowed by another process (its GEMM at 150 us, against 10 and 12) does not take
    the decode steps' GEMM time away; an op of the long run alone counts whole."""
    runs = iter(
        [
            {"aten::mm": (100.0, 17), "aten::add": (30.0, 17), "aten::silu": (8.0, 16)},  # 1 + 16 tokens
            {"aten::mm": (150.0, 1)},
            {"aten::mm": (10.0, 1), "aten::add": (2.0, 1)},
            {"aten::mm": (12.0, 1)},
        ]
    )
    monkeypatch.setattr(timing, "op_times", lambda fn, device: next(runs))
    prof = timing.decode_profile(lambda n: None, 16, "cpu")
    want = [("aten::mm", 90.0 / 16, 1.0), ("aten::add", 28.0 / 16, 1.0), ("aten::silu", 0.5, 1.0)]
    assert prof["ops"] == want
    assert prof["kinds"]["GEMMs"] == 90.0 / 16 and prof["kinds"]["other"] == 36.0 / 16


def test_profile_kinds_name_the_engines_kernels():
    """The kernel names a GPU profile shows (cuBLAS's, gapless's Triton kernels, tinygemm's) fall under the
    kind they are."""
    kind = {
        name: next((k for k, p in timing.KINDS.items() if p.search(name)), "other")
        for name in (
            "nvjet_sm90_tst_72x64_64x12_4x1_v_bz_TNN",
            "_fp8_gemm_kernel",
            "_fp8_quant_kernel",
            "_w4a16_kernel",
            "void at::native::(anonymous namespace)::tinygemm_m16n8k16_chunk_kernel<...>",
            "void cublasLt::splitKreduce_kernel<32, 16, int, float>",
            "_decode_split_kernel",
            "_extend_kernel",
            "_rms_norm_kernel",
            "_qk_norm_rope_store_kernel",
            "_act_and_mul_kernel",
        )
    }
    assert [k for k in kind.values()] == ["GEMMs"] * 6 + ["attention"] * 2 + ["other"] * 3, kind


def test_the_report_leaves_out_runs_without_a_profile():
    machine = this_machine("cpu")
    run = dict(shape="qwen3-8b", quantization=None, tpot_ms=10.0, weights="w", machine=machine, profile=None)
    assert "of TPOT's" not in quant.report([run])


def test_gguf_writes_a_shape_as_a_q4_k_m_file_that_runs(tmp_path, monkeypatch):
    """`gguf` writes a shape (here a small Qwen3 of 16 layers) as a GGUF file of random blocks in llama.cpp's
    Q4_K_M mix: each matrix the type its rule gives (Q6_K for attn_v and ffn_down in the first and last
    eighth of the layers and every third between), which the engine reads and runs; `run`'s ratio is to
    the shape's bf16 run."""
    import gguf

    from gapless.model.quant.gguf_blocks import QUANTIZED_TYPES
    from gapless.testing.checkpoints import make_checkpoint
    from gapless.testing.gguf_files import q4_k_m_type

    shape = make_checkpoint(
        tmp_path / "qwen3-small",
        "qwen3",
        hidden_size=256,
        intermediate_size=512,
        head_dim=64,
        num_hidden_layers=16,
    )
    path = quant.gguf_file(shape, "Q4_K_M")
    assert path.parent.name == "qwen3-small-gguf" and quant._shape_of(path.parent.name) == "qwen3-small"
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    six = [i for i in range(16) if types[f"blk.{i}.ffn_down.weight"] == "Q6_K"]
    assert six == [0, 1, 4, 7, 10, 13, 14, 15]  # (16 layers: 2 first, 2 last, every third from 2 between)
    v = [f"blk.{i}.attn_v.weight" for i in range(16)]
    assert all(types[name] == q4_k_m_type(name, 16) for name in v)
    assert {types[f"blk.{i}.attn_q.weight"] for i in range(16)} == {"Q4_K"}
    assert types["blk.0.attn_norm.weight"] == "F32" and set(types.values()) <= {"F32", *QUANTIZED_TYPES}
    narrow = r"embed_tokens.weight \(1000, 64\): Q4_K takes rows of whole 256-weight blocks"
    with pytest.raises(ValueError, match=narrow):
        quant.gguf_file(make_checkpoint(tmp_path / "narrow", "qwen3", num_hidden_layers=2), "Q4_K")
    res = quant.run(path.parent, {"load_format": "auto"}, tokens=8, repeats=3, device="cpu")
    assert res["shape"] == "qwen3-small" and res["quantization"] == "gguf"
    assert res["tpot_ms"] > 0, res["tpot_ms_all"]
    assert "Q4_K as int4 g32" in res["weights"] and "Q6_K as int8 per-row" in res["weights"], res["weights"]
