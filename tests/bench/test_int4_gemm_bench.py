"""`python -m gapless.bench.int4_gemm` runs end to end (a tiny shape; on a CPU under Triton's interpreter,
where its times mean nothing but every path runs): torch's GEMM and each tile variant of the int4 GEMM
(a dot per value of the words and one reshaped tile), the variant's product checked against the
dequantized weight's."""

from __future__ import annotations

import json

import torch

from gapless.bench import int4_gemm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs the kernel under the interpreter


def test_int4_gemm_bench_times_each_variant_and_checks_its_product(tmp_path):
    out = tmp_path / "int4.json"
    argv = f"--device {DEVICE} --dtype float32 --shapes 256:64 --m 1 3 --group 128 --block-n 0 32 --iters 1"
    argv += " --block-m 16 --nibble-dots 1 0 --kernels triton tinygemm"  # (tinygemm: CUDA only, not float32)
    res = int4_gemm.main(argv.split() + ["--warmup", "0", "--json", str(out)])
    assert [(r["shape"], r["m"]) for r in res] == [("256:64", 1), ("256:64", 3)]
    for r in res:
        triton = [v for v in r["variants"] if v["kernel"] == "triton"]
        assert r["bf16_us"] > 0 and [v["block_n"] for v in triton] == [64, 64, 32, 32]
        assert [v["dots"] for v in triton] == ["P", "1", "P", "1"]
        assert all(v["us"] > 0 and v["rel_err"] < 1e-5 for v in triton)
        library = [v for v in r["variants"] if v["kernel"] != "triton"]
        if DEVICE == "cuda":
            assert [v["kernel"] for v in library] == ["tinygemm"] and "bfloat16" in library[0]["error"]
        else:
            assert not library
    assert json.loads(out.read_text())["rows"] == res
    argv = f"--device {DEVICE} --dtype float32 --shapes 256:64 --m 1 --group 128 --iters 1 --warmup 0"
    chosen = int4_gemm.main(argv.split() + ["--block-m", "0", "1", "--kernels", "triton"])
    assert [v["block_m"] for v in chosen[0]["variants"]] == [1]  # (one row: the GEMV, chosen; timed once)
    # the GEMV's loads pipelined (`--stages`; 0, the heuristic's 1, timed once): the same product
    staged = int4_gemm.main([*argv.split(), "--block-m", "1", "--stages", "0", "1", "3"])
    variants = staged[0]["variants"]
    assert [v["stages"] for v in variants] == [1, 3] and all(v["rel_err"] < 1e-5 for v in variants)
    # the factored GEMV (`--factored`, its dots column "fac"): the same product
    fac = int4_gemm.main([*argv.split(), "--block-m", "1", "--factored", "0", "1"])[0]["variants"]
    assert [(v["dots"], v["rel_err"] < 1e-5) for v in fac] == [("1", True), ("fac", True)]
    # the swapped tiles (`--swapped`, W x^T: dots column T), at 16 rows: a dot per value and one K tile
    argv = argv.replace("--m 1", "--m 3")
    swap = int4_gemm.main([*argv.split(), "--block-m", "16", "--swapped", "1", "--nibble-dots", "1", "0"])
    variants = swap[0]["variants"]
    assert [(v["dots"], v["rel_err"] < 1e-5) for v in variants] == [("TP", True), ("T1", True)]
