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

from gapless.bench import cli, gpu, gpu_report
from gapless.bench.runs import run_gapless
from gapless.bench.workload import Workload, random_workload
from gapless.testing import cached_checkpoint


@pytest.mark.slow  # (a benchmark run, ~8 s)
def test_gpu_bench_smoke_on_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    argv = ["--quick", "--size", "tiny", "--device", "cpu", "--dtype", "float32", "--json", str(out)]
    res = gpu.main([*argv, "--hf-num-seqs", "3", "--hf-batch-size", "2", "--engine-option", "page_size=4"])
    assert res["errors"] == []

    vocab = json.loads((cached_checkpoint("qwen3") / "config.json").read_text())["vocab_size"]
    work = random_workload(**gpu.QUICK, vocab_size=vocab, seed=0)
    assert res["workload"]["output_tokens"] == work.output_tokens
    for key, run in gpu.RUNS.items():
        g = res[key]
        # the engine really ran with the mode asked for, and the pass-through option reached it
        assert g["engine_options"]["overlap"] is run.overlap
        assert g["decode_read_vs_copy"] is None  # no copy measured off CUDA
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
        assert g["triton_compiles"] == []  # (the interpreter compiles nothing; the sm_90 harness test does)
        # the decode jobs' device time, a share of all jobs', per decode step
        meter = g["meter"]
        assert 0 < meter["decode_device_s"] < g["device_busy_s"] and meter["prefill_device_s"] > 0
        assert g["decode_device_ms_per_step"] == 1e3 * meter["decode_device_s"] / meter["decode_steps"]
        assert f"decode {g['decode_device_ms_per_step']:.2f} ms of device time a step" in res["report"]
    assert res["greedy"]["engine_options"]["overlap"] != res["plain"]["engine_options"]["overlap"]
    assert res["sampling"]["qwen3"] == dict(temperature=0.6, top_k=20, top_p=0.95)
    assert res["sampling"]["sampled"] == dict(temperature=0.6) and res["copy_tb_s"] is None

    h = res["transformers"]
    assert h["requests"] == 3 and h["batches"] == 2 and h["batch_size"] == 2
    assert h["output_tokens"] == work.head(3).output_tokens == res["workload"]["hf_output_tokens"]
    assert h["computed_output_tokens"] >= h["output_tokens"] and h["output_tokens_per_s"] > 0

    r = res["ratios"]
    tok_s = {k: res[k]["output_tokens_per_s"] for k in gpu.RUNS}
    assert r["overlap_vs_plain"] == tok_s["greedy"] / tok_s["plain"]
    assert r["sampled_vs_greedy"] == tok_s["sampled"] / tok_s["greedy"]
    assert r["qwen3_vs_greedy"] == tok_s["qwen3"] / tok_s["greedy"]
    assert r["gapless_vs_transformers"] == tok_s["greedy"] / h["output_tokens_per_s"]
    saved = json.loads(out.read_text())
    assert saved["sampled"]["output_tokens"] == work.output_tokens and saved["report"] == res["report"]
    for run in gpu.RUNS.values():
        assert f"| {run.label} |" in res["report"]
    assert "| transformers generate (greedy) |" in res["report"]

    # the report's GPU and failure branches, which only a GPU session reaches for real
    fake = copy.deepcopy(res)
    fake["machine"].update(
        gpu="NVIDIA H100 80GB HBM3", gpu_memory_gib=79.2, sms=132, compute_capability="9.0", cuda="13.0"
    )
    fake["machine"]["nvidia_smi"] = {"driver_version": "580.159.04"}
    fake["transformers"] = {"error": "Traceback ...", "error_line": "OutOfMemoryError: CUDA out of memory"}
    fake["ratios"] = gpu_report.ratios(fake)
    fake["copy_tb_s"] = 3.0
    for key in gpu.RUNS:
        gpu_report.derive(fake[key], fake["model_info"], fake["workload"]["decode_kv_tokens_read"], 3.0)
        assert fake[key]["decode_read_vs_copy"] == fake[key]["decode_read_tb_per_s"] / 3.0
    fake["greedy"]["triton_compiles"] = ["_extend_kernel", "_extend_kernel"]
    kinds = {"GEMMs": 900.0, "attention": 2500.0, "other": 600.0}
    ops = [["_decode_split_kernel", 2500.0, 28.0], ["nvjet_sm90_tst", 900.0, 113.0]]
    fake["sampled"]["kernel_profile"] = dict(us_per_step=4000.0, kinds=kinds, ops=ops, other_us=600.0)
    report = gpu.format_report(fake)
    assert "2 Triton compiles in the timed run" in report
    assert "kernels 4000 us a decode step of every request at once" in report
    assert "GEMMs 900, attention 2500, other 600" in report
    assert "| _decode_split_kernel | 2500.0 | 28 |" in report
    names = fake["greedy"]["triton_compiles"] + ["_draw_kernel"]
    assert gpu._compiled(names) == "_extend_kernel x2, _draw_kernel x1"
    assert "NVIDIA H100 80GB HBM3 (79.2 GiB, 132 SMs, sm_90, driver 580.159.04), CUDA 13.0" in report
    assert "GPU idle" in report and "FAILED: OutOfMemoryError" in report and "3.00 TB/s" in report
    assert fake["ratios"]["gapless_vs_transformers"] is None and "overlap / no overlap" in report
    assert ">= 20,000 tok/s, NOT met" in report and "of copy)" in report  # the H100's target


def test_a_run_profiles_its_decode_steps_on_the_cpu():
    """`profile_steps`: after the timed run, every request's decode steps under torch.profiler (prompts
    rotated: the prefix cache holds none of them), each op's time a step; on the CPU torch's ops. Sixteen
    steps: a step's times are the difference of two profiled runs, which on a loaded CPU (CI's, beside
    another test process) lost the GEMMs in noise once at three steps (stop 53)."""
    vocab = json.loads((cached_checkpoint("qwen3") / "config.json").read_text())["vocab_size"]
    work = random_workload(4, 8, 16, 2, 4, vocab_size=vocab, seed=0)
    g = run_gapless(cached_checkpoint("qwen3"), work, options={"page_size": 4}, profile_steps=16)
    prof = g["kernel_profile"]
    assert prof["us_per_step"] > 0 and prof["kinds"]["GEMMs"] > 0 and prof["ops"]
    assert abs(sum(us for _, us, _ in prof["ops"]) + prof["other_us"] - prof["us_per_step"]) < 1e-3
    assert g["output_tokens"] == work.output_tokens  # (the timed run's, not the profile's)
    assert run_gapless(cached_checkpoint("qwen3"), work.head(1))["kernel_profile"] is None


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


@pytest.mark.slow  # (the GPU kit's script, ~10 s on the CPU)
def test_gpu_bench_script_writes_its_files(tmp_path):
    """`bench/gpu_bench.sh`, the one command a GPU session runs, on the CPU: the same files in $OUT."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OUT=str(tmp_path), PY=sys.executable, GPU_BENCH_TIMEOUT="300")
    argv = ["--quick", "--size", "tiny", "--device", "cpu", "--dtype", "float32", "--skip-hf"]
    argv += ["--runs", "sampled"]
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
    assert res["errors"] == [] and not {"greedy", "qwen3", "plain", "transformers"} & set(res)
    assert res["sampled"]["output_tokens"] == res["workload"]["output_tokens"]
    assert res["report"] in (tmp_path / "gpu_bench.log").read_text()


@pytest.mark.parametrize(("kv", "name"), [("fp8", "fp8_e4m3"), ("fp8_e5m2", "fp8_e5m2")])
def test_gpu_bench_fp8_kv_reaches_the_engine_and_the_byte_count(kv, name):
    argv = f"--quick --size tiny --device cpu --dtype float32 --runs greedy --skip-hf --kv-cache-dtype {kv}"
    res = gpu.main(argv.split())
    assert res["errors"] == [] and res["greedy"]["engine_options"]["kv_cache_dtype"] == kv
    mi = res["model_info"]
    assert mi["kv_cache_dtype"] == name
    per_layer = 2 * mi["num_key_value_heads"] * mi["head_dim"]
    assert mi["kv_bytes_per_token"] == per_layer * mi["num_hidden_layers"]  # one byte an element
    assert f"{name} KV per token" in res["report"]
    with pytest.raises(SystemExit):
        gpu.main([*argv.split()[:-2], "--engine-option", "kv_cache_dtype=fp8"])
