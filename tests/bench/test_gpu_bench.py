"""Smoke test of the GPU benchmark on the CPU: tiny model, tiny workload, every run and field it reports.

The GPU session runs it for real (`bench/gpu_bench.sh`); here it must run end to end, count tokens right,
run overlap on and off for real, and run transformers on its slice.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gapless.bench import cli, gpu
from gapless.bench.workload import Workload, random_workload
from gapless.testing import cached_checkpoint


def test_gpu_bench_smoke_on_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    argv = ["--quick", "--size", "tiny", "--device", "cpu", "--dtype", "float32", "--json", str(out)]
    res = gpu.main([*argv, "--hf-num-seqs", "3", "--hf-batch-size", "2", "--engine-option", "page_size=4"])
    assert res["errors"] == []

    vocab = json.loads((cached_checkpoint("qwen3") / "config.json").read_text())["vocab_size"]
    work = random_workload(**gpu.QUICK, vocab_size=vocab, seed=0)
    assert res["workload"]["output_tokens"] == work.output_tokens
    for key, overlap in gpu.RUNS.items():
        g = res[key]
        # the engine really ran with the mode asked for, and the pass-through option reached it
        assert g["engine_options"]["overlap"] is overlap
        assert g["engine_options"]["page_size"] == 4
        assert (g["device"], g["engine_options"]["dtype"]) == ("cpu", "float32")
        # every request got exactly its own length
        assert g["output_tokens"] == g["requested_output_tokens"] == work.output_tokens
        assert g["wrong_length_requests"] == 0
        assert g["requests"] == len(work) and g["output_tokens_per_s"] > 0
        assert g["kv_pool_tokens"] >= res["kv_cache_tokens"] >= work.input_tokens + work.output_tokens
        assert g["retractions"] == 0
        assert 0.0 <= g["device_idle_fraction"] < 1.0 and g["host_ms_per_step"] > 0
        assert 0.0 < g["busy_fraction_of_wall"] <= 1.0
        assert g["decode_batches"] + g["prefill_batches"] == g["steps"] > 0
        assert g["warmup_requests"] == gpu.QUICK_WARMUP[0]
    assert res["overlap"]["engine_options"]["overlap"] != res["plain"]["engine_options"]["overlap"]

    h = res["transformers"]
    assert h["requests"] == 3 and h["batches"] == 2 and h["batch_size"] == 2
    assert h["output_tokens"] == work.head(3).output_tokens == res["workload"]["hf_output_tokens"]
    assert h["computed_output_tokens"] >= h["output_tokens"] and h["output_tokens_per_s"] > 0

    r = res["ratios"]
    assert (
        r["overlap_vs_plain"] == res["overlap"]["output_tokens_per_s"] / res["plain"]["output_tokens_per_s"]
    )
    assert r["gapless_vs_transformers"] == res["overlap"]["output_tokens_per_s"] / h["output_tokens_per_s"]
    saved = json.loads(out.read_text())
    assert saved["overlap"]["output_tokens"] == work.output_tokens and saved["report"] == res["report"]
    for row in ("| gapless, overlap |", "| gapless, no overlap |", "| transformers generate |"):
        assert row in res["report"]

    # the report's GPU and failure branches, which only a GPU session reaches for real
    fake = copy.deepcopy(res)
    fake["machine"].update(
        gpu="NVIDIA H100 80GB HBM3", gpu_memory_gib=79.2, sms=132, compute_capability="9.0", cuda="13.0"
    )
    fake["machine"]["nvidia_smi"] = {"driver_version": "580.159.04"}
    fake["transformers"] = {"error": "Traceback ...", "error_line": "OutOfMemoryError: CUDA out of memory"}
    fake["ratios"] = gpu._ratios(fake)
    report = gpu.format_report(fake)
    assert "NVIDIA H100 80GB HBM3 (79.2 GiB, 132 SMs, sm_90, driver 580.159.04), CUDA 13.0" in report
    assert "GPU idle" in report and "FAILED: OutOfMemoryError" in report
    assert fake["ratios"]["gapless_vs_transformers"] is None and "overlap / no overlap" in report


def test_decode_kv_reads_match_a_step_by_step_count():
    work = Workload([[1] * 5, [2] * 3], [4, 1])
    # request 0: decode steps 1..3 attend to 6, 7, 8 keys; request 1 has no decode step
    assert gpu.decode_kv_tokens_read(work) == 6 + 7 + 8


def test_qwen3_06b_config_matches_the_published_model(tmp_path):
    """The size the GPU bench builds has Qwen3-0.6B's shape (checked on the config; never built here)."""
    from gapless.testing.checkpoints import model_config

    c = model_config("qwen3", "qwen3-0.6b")
    shape = (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads)
    assert shape == (1024, 3072, 28, 16)
    assert (c.num_key_value_heads, c.head_dim, c.vocab_size, c.max_position_embeddings) == (
        8,
        128,
        151936,
        40960,
    )
    assert c.tie_word_embeddings and c.rms_norm_eps == 1e-6
    theta = c.rope_parameters["rope_theta"] if hasattr(c, "rope_parameters") else c.rope_theta
    assert theta == 1e6
    # what the bench reports from that config: 112 KiB of bf16 KV per token, as the arithmetic says
    c.save_pretrained(tmp_path)  # config.json alone: no weights, so no parameters to count
    info = cli.model_info(tmp_path, "bfloat16")
    assert (info["head_dim"], info["vocab_size"], info["params"]) == (128, 151936, 0)
    assert info["kv_bytes_per_token"] == 112 * 1024
    assert cli.model_info(tmp_path, "float32")["kv_bytes_per_token"] == 224 * 1024


def test_engine_option_overlap_is_refused():
    with pytest.raises(SystemExit):
        gpu._parse_args(["--quick", "--device", "cpu", "--engine-option", "overlap=False"])


def test_model_info_counts_parameters_and_bytes():
    path = cached_checkpoint("qwen3")
    info = cli.model_info(path, "bfloat16")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path))
    # every tensor in the safetensors files (tied embeddings are stored once)
    assert info["params"] == sum(p.numel() for p in model.parameters())
    assert info["weight_bytes"] == 2 * info["params"]


def test_gpu_bench_script_writes_its_files(tmp_path):
    """`bench/gpu_bench.sh`, the one command a GPU session runs, on the CPU: the same files in $OUT."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OUT=str(tmp_path), PY=sys.executable, GPU_BENCH_TIMEOUT="300")
    argv = ["--quick", "--size", "tiny", "--device", "cpu", "--dtype", "float32", "--skip-plain", "--skip-hf"]
    proc = subprocess.run(
        ["bash", str(root / "bench" / "gpu_bench.sh"), *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gapless imports ok" in (tmp_path / "gpu_env.log").read_text()
    res = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert res["errors"] == [] and "plain" not in res and "transformers" not in res
    assert res["overlap"]["output_tokens"] == res["workload"]["output_tokens"]
    assert res["report"] in (tmp_path / "gpu_bench.log").read_text()
