"""`gapless.bench.quant` (bench/gpu_quant.sh's TPOT runs): the shapes it writes are the models' (config and
tokenizer, no weights; the larger ones' int4 twins an AWQ config) and its report gives each run's ratio to
the bf16 run of the same shape."""

from __future__ import annotations

import json

from gapless.bench import quant
from gapless.bench.cli import machine as this_machine
from gapless.model.config import load_model_config
from gapless.model.quant.int4 import Int4Spec, int4_spec_from_config


def test_make_writes_each_shape_without_weights(tmp_path):
    paths = quant.make(tmp_path)
    assert [p.name for p in paths] == [
        "qwen3-0.6b",
        "qwen3-8b",
        "qwen3-8b-awq",
        "qwen3-30b-a3b",
        "qwen3-30b-a3b-awq",
    ]
    for name in ("qwen3-8b", "qwen3-30b-a3b"):  # the int4 twin: the same model, an AWQ g128 config
        twin = load_model_config(tmp_path / f"{name}-awq")
        assert twin == load_model_config(tmp_path / name)
        qc = json.loads((tmp_path / f"{name}-awq" / "config.json").read_text())["quantization_config"]
        assert int4_spec_from_config(qc) == Int4Spec("awq", 4, 128, sym=False)
        assert "quantization_config" not in json.loads((tmp_path / name / "config.json").read_text())
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
        dict(shape="qwen3-8b", quantization=None, tpot_ms=10.0, weights="w: 16 GB", machine=machine),
        dict(shape="qwen3-8b", quantization="fp8", tpot_ms=5.5, weights="w: 8 GB", machine=machine),
    ]
    text = quant.report(runs)
    assert "| qwen3-8b | fp8 | 5.500 | 0.55 |" in text and "| qwen3-8b | bf16 | 10.000 | 1.00 |" in text
