"""Smoke tests of the CPU step benchmarks: `cpu_step --compare` times plain and prepacked GEMMs side by
side (and the packed step dispatches fewer ops), `cpu_gemm` the GEMMs alone."""

from __future__ import annotations

from gapless.bench import cpu_gemm, cpu_step
from gapless.testing import cached_checkpoint


def test_cpu_step_compare_times_plain_packed_and_without_gemms_and_packing_cuts_ops():
    model = cached_checkpoint("qwen3")
    argv = ["--model", str(model), "--batch", "1", "3", "--steps", "2", "--repeat", "1", "--threads", "1"]
    rows = cpu_step.main(
        [*argv, "--compare", "--compare-one-row", "--compare-without-gemms", "--kv-cache-tokens", "512"]
    )
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert r["plain"]["ms_per_step"] > 0 and r["default"]["ms_per_step"] > 0
        assert r["default_over_plain"] == r["default"]["ms_per_step"] / r["plain"]["ms_per_step"]
        direct = r["one_row_direct"]["ms_per_step"]
        assert r["default_over_one_row_direct"] == r["default"]["ms_per_step"] / direct
        # each linear layer is one op on packed weights (mm + transpose + views on plain ones)
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
