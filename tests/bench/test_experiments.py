"""Smoke tests of the experiments in bench/experiments/ (scripts outside the package, whose results are
recorded under bench/results/): `cpu_step --compare` times plain and prepacked GEMMs side by side (and
the packed step dispatches fewer ops), `cpu_gemm` the GEMMs alone, `detokenize` the server's detokenizer
per step, `spy` py-spy's stacks as a table, `embed` embeddings against sentence-transformers, `gguf_decode`
each GGUF type's decoding rate, `codebook_sass` the codebook GEMV's sm_90 instructions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from gapless.testing import cached_checkpoint

EXPERIMENTS = Path(__file__).resolve().parents[2] / "bench" / "experiments"


def _experiment(name: str) -> ModuleType:
    """bench/experiments/NAME.py, imported as a module (it is run as a script)."""
    spec = importlib.util.spec_from_file_location(f"experiment_{name}", EXPERIMENTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


cpu_gemm, cpu_step, detokenize = (_experiment(n) for n in ("cpu_gemm", "cpu_step", "detokenize"))


def test_embed_times_both_and_agrees():
    pytest.importorskip("sentence_transformers", reason="the experiment compares with sentence-transformers")
    out = _experiment("embed").main(["--size", "tiny", "--texts", "3", "--words", "2", "5", "--batch", "2"])
    assert out["gapless_texts_per_s"] > 0 and out["sentence_transformers_texts_per_s"] > 0
    assert out["min_cosine"] >= 0.9999


def test_cpu_step_compare_times_plain_packed_and_without_gemms_and_packing_cuts_ops():
    model = cached_checkpoint("qwen3")
    argv = ["--model", str(model), "--batch", "1", "3", "--steps", "8", "--repeat", "2", "--threads", "1"]
    rows = cpu_step.main(
        [*argv, "--compare", "--compare-one-row", "--compare-without-gemms", "--kv-cache-tokens", "512"]
    )
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert r["plain"]["ms_per_step"] > 0 and r["default"]["ms_per_step"] > 0
        assert r["default_over_plain"] == r["default"]["ms_per_step"] / r["plain"]["ms_per_step"]
        direct = r["one_row_direct"]["ms_per_step"]
        assert r["default_over_one_row_direct"] == r["default"]["ms_per_step"] / direct
        # each linear layer is one op on packed weights (mm + transpose + views on plain ones); the device
        # side runs in this process on any machine (cpu_worker="inline"), so its ops are the ones counted
        assert r["default"]["ops_per_step"] < r["plain"]["ops_per_step"]
        # without its GEMMs a step dispatches one op fewer per GEMM (the oneDNN call; a lone row's copies
        # too), and the stand-in is gone again afterwards (the default engine's later runs computed)
        without = r["without_gemms"]
        assert without["ops_per_step"] < r["default"]["ops_per_step"]
        assert r["without_gemms_over_default"] == without["ms_per_step"] / r["default"]["ms_per_step"]
    assert cpu_step.cpu_gemm.PackedLinear.__call__ is not cpu_step._zero_gemm


def test_cpu_gemm_bench_compares_within_float32():
    rows = cpu_gemm.main(["--rows", "1", "4", "--layers", "1", "--vocab", "256", "--rounds", "1"])
    assert [r["rows"] for r in rows] == [1, 4]
    for r in rows:
        assert r["max_abs_diff"] < 1e-4
        assert r["layers_packed_over_plain"] > 0 and r["head_packed_over_plain"] > 0
        assert r["layers_packed_over_direct"] > 0 and r["head_packed_over_direct"] > 0
        assert r["read"]["layers_ms"] > 0 and r["layers_packed_over_read"] > 0


def test_detokenize_bench_times_every_mode_and_their_texts_agree(capsys):
    res = detokenize.main(["--requests", "5", "--steps", "40", "--tokens-per-step", "2", "--rounds", "1"])
    assert res["texts_identical"]
    assert set(res["median_ms_per_step"]) == set(detokenize.MODES)
    assert all(ms > 0 for ms in res["median_ms_per_step"].values())
    out = capsys.readouterr().out
    assert "texts identical in every mode" in out and "python bench/experiments/detokenize.py" in out
    for mode in detokenize.MODES:
        assert f"| {mode} |" in out


def test_detokenize_bench_streams_are_real_text():
    """Each stream is text from its own offset, long enough for the steps asked for."""
    from gapless.testing import build_tokenizer

    tok = build_tokenizer()
    ids = detokenize.streams(tok, 3, 100)
    assert [len(s) for s in ids] == [100] * 3 and ids[0] != ids[1]
    _, texts = detokenize.run_mode("whole step", tok, ids, 4)
    assert texts[0] and texts[0] in tok.decode(ids[0])


def test_spy_names_the_process_and_counts_self_and_inclusive_samples(tmp_path):
    spy = _experiment("spy")
    raw = tmp_path / "c1_pid7.txt"
    raw.write_text(
        "main (server/workers.py:10);scheduler_main (server/workers.py:431);step (engine/engine.py:205) 30\n"
        "main (server/workers.py:10);scheduler_main (server/workers.py:431) 10\n"
    )
    table = spy.summarize(raw, possible=200.0)
    assert table.startswith("== scheduler (c1_pid7.txt): 40 samples, on a core 20.0% of the run")
    assert "75.0%  step (engine/engine.py)" in table  # self: the leaf's 30 of 40
    assert "100.0%  scheduler_main (server/workers.py)" in table  # inclusive: on every stack


def test_cpu_profile_counts_one_decode_steps_ops(capsys):
    cpu_profile = _experiment("cpu_profile")
    model = cached_checkpoint("qwen3")
    argv = ["--model", str(model), "--steps", "3", "--threads", "1", "--top", "5"]
    per = cpu_profile.main([*argv, "--kv-cache-tokens", "512"])
    # a decode step runs each layer's 4 GEMMs (qkv, o, gate/up, down; oneDNN's prepacked linear on a float
    # checkpoint) and the LM head's: per step, counted as the difference of two profiles
    layers = 2
    assert per["mkldnn::_linear_pointwise"][1] == 4 * layers + 1
    out = capsys.readouterr().out
    assert "ms per step under the profiler" in out and len(out.splitlines()) == 2 + 5


def test_fp8_sweep_configs_are_distinct_and_cover_the_one_row_split():
    """`fp8_gemm.py --sweep`'s configurations: none twice; at one row the default tile also unsplit and
    split to 256 programs over 3 and 6 stages, and the GEMV; past 16 rows neither (its tiles split or not)."""
    pytest.importorskip("triton", reason="the FP8 GEMM experiment imports triton.testing")
    sweep = _experiment("fp8_gemm")
    one, many = sweep._sweep_configs(1), sweep._sweep_configs(32)
    assert len(set(one)) == len(one) and len(set(many)) == len(many)
    assert {((16, 64, 4, s), p, "launch", "tiles") for s in (3, 6) for p in (0, 256)} <= set(one)
    assert any(kind == "gemv" for *_, kind in one) and all(kind == "tiles" for *_, kind in many)
    assert {p for _, p, _, _ in many} == {0, 512} and all(t[0] >= 64 for t, *_ in many)
    small = sweep.SWEEP_SMALL  # (Qwen3-0.6B's layers: the GEMV's K split)
    assert {p for _, p, _, _ in small} == {0, 128, 256, 512} and all(kind == "gemv" for *_, kind in small)
    # `--swapped`: 16-row tiles (x padded to 16: the wgmma's N), each config once
    swapped = sweep.SWEEP_SWAPPED
    assert len(set(swapped)) == len(swapped) and all(t[0] == 16 for t, _ in swapped)


def test_gguf_decode_rates_every_type():
    rates = _experiment("gguf_decode").main(["--rows", "16", "--cols", "256"])
    legacy_and_k = {
        "Q4_0",
        "Q4_1",
        "Q4_K",
        "Q8_0",
        "Q5_0",
        "Q5_1",
        "Q5_K",
        "Q6_K",
        "Q3_K",
        "Q2_K",
        "TQ1_0",
        "TQ2_0",
    }
    i_quants = {
        "IQ4_NL",
        "IQ4_XS",
        "IQ3_XXS",
        "IQ3_S",
        "IQ2_XXS",
        "IQ2_XS",
        "IQ2_S",
        "IQ1_S",
        "IQ1_M",
        "MXFP4",
    }
    assert set(rates) == legacy_and_k | i_quants
    assert all(r > 0 for r in rates.values())


@pytest.mark.slow  # (four sm_90 compiles in a child process, ~15 s)
def test_codebook_sass_counts_a_load_a_value_for_the_codebooks():
    """`codebook_sass` compiles the one-row GEMV for sm_90 with AWQ's values and a codebook's: the table
    has each, and the codebook's gather loads outnumber the affine kernels' by far."""
    from gapless.testing.triton_compile import compile_child

    script = f"import runpy\nrunpy.run_path({str(EXPERIMENTS / 'codebook_sass.py')!r}, run_name='__main__')\n"
    out = compile_child(script, "compiling the codebook GEMVs")
    if out is None:
        pytest.skip("this Triton has no NVIDIA backend to compile with")
    rows = {
        line.split("|")[1].strip(): line.split("|")[2:-1]
        for line in out.splitlines()
        if line.startswith("| ")
    }
    loads = {name: int(cells[1]) for name, cells in rows.items() if name != "values"}
    assert len(loads) == 4 and min(loads["codebook g64 (NF4)"], loads["codebook g16 (NVFP4)"]) > 2 * max(
        loads["affine, Triton's values"], loads["affine, PTX values"]
    ), out
