"""`python -m gapless.bench.kernels` runs end to end (tiny shapes; on a CPU under Triton's interpreter,
where its figures mean nothing but every path runs): each fused kernel against torch, and decode attention
against a copy, for every batch, context, page size and decode kernel variant asked for, extend attention
against a matmul, and the sampler's torch paths against the fused draw, the fused penalties and the partial
sort."""

from __future__ import annotations

import pytest
import torch

from gapless.testing.triton import import_kernels_or_skip

fk = import_kernels_or_skip("gapless.model.fused.triton_kernels")

from gapless.bench import kernels, kernels_attention, kernels_sampling  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs the kernels under the interpreter


@pytest.mark.slow  # (every table of the benchmark, ~7 s)
def test_kernels_bench_reports_every_kernel_and_attention_case(tmp_path, capsys):
    argv = (
        f"--device {DEVICE} --dtype float32 --tokens 3 --hidden 37 --heads 2 --kv-heads 1 --head-dim 12 "
        "--intermediate 20 --batch 2 3 --context 20 --page-size 1 4 --attention triton --iters 1 --warmup 0 "
        "--decode-block-n 0 16 --decode-programs-per-sm 2 32 "
        "--extend-tokens 24 --extend-len 10 --extend-block-m 0 16 --extend-stages 1 2 "
        "--matmul-n 16 --sample-batch 1 2 --vocab 1100"
    ).split() + ["--json", str(tmp_path / "k.json")]
    res = kernels.main(argv)
    assert [r["kernel"] for r in res["fused"]] == [
        "add + RMSNorm",
        "q/k norm + RoPE + KV store",
        "SiLU·mul",
        "GeLU(tanh)·mul",
    ]
    assert all(r["torch_us"] > 0 and r["triton_us"] > 0 for r in res["fused"])
    cases = [
        (r["batch"], r["context"], r["page_size"], r["block_n"], r["programs_per_sm"])
        for r in res["attention_rows"]
    ]
    assert cases == [  # block n 0: the default, 64
        (b, 20, p, n, pps) for b in (2, 3) for p in (1, 4) for n in (64, 16) for pps in (2, 32)
    ]
    assert all(r["splits"] >= 1 and r["num_warps"] == 4 for r in res["attention_rows"])
    assert all(r["attention_tb_s"] > 0 and r["copy_tb_s"] > 0 for r in res["attention_rows"])
    variants = [(r["tokens"], r["block_m"], r["block_n"], r["num_stages"]) for r in res["extend_rows"]]
    assert variants == [(24, m, 64, st) for m in (64, 16) for st in (1, 2)]  # block n: the default, 64
    assert all(r["attention_tflop_s"] > 0 and r["matmul_tflop_s"] > 0 for r in res["extend_rows"])
    modes = [(m, "engine") for m in kernels_sampling.MODES]
    comparisons = [
        ("seeded draw (temperature only)", "triton draw"),
        ("torch penalties vs triton", "triton penalties"),
        ("top-k 50 + top-p 0.95, full sort vs partial", "partial sort"),
        ("top-p 0.9, full sort vs nucleus", "triton nucleus"),  # (vocab 1100: past the window)
    ]
    got = [(r["rows"], r["case"], r["path"]) for r in res["sampling"]]
    assert got == [(rows, case, path) for rows in (1, 2) for case, path in (*modes, *comparisons)]
    assert all(r["path_us"] > 0 and r["logits_read_us"] > 0 for r in res["sampling"])
    assert all((r["torch_us"] is None) == (r["path"] == "engine") for r in res["sampling"])
    assert all(r["torch_us"] > 0 for r in res["sampling"] if r["path"] != "engine")
    out = capsys.readouterr().out
    assert "attention / copy" in out and "triton / torch" in out and "attention / matmul" in out
    assert "path / torch" in out
    assert (tmp_path / "k.json").exists()


def test_decode_attention_rows_over_an_fp8_cache():
    """`--kv-cache-dtype auto fp8`: each case once per KV dtype, the fp8 one counting 1 byte an element
    (so its KV read bandwidth is half bf16's at the same time); extend attention over each too."""
    args = kernels.parse_args(
        f"--device {DEVICE} --dtype bfloat16 --heads 2 --kv-heads 1 --head-dim 16 --batch 2 --context 20 "
        "--page-size 4 --attention triton --iters 1 --warmup 0 --kv-cache-dtype auto fp8 --extend-tokens 24 "
        "--extend-len 16 --matmul-n 16".split()
    )
    extend = kernels_attention.extend_rows(args, torch.device(DEVICE), torch.bfloat16)
    assert [r["kv_dtype"] for r in extend] == ["auto", "fp8"] and all(r["attention_us"] > 0 for r in extend)
    rows = kernels_attention.attention_rows(args, torch.device(DEVICE), torch.bfloat16)
    assert [r["kv_dtype"] for r in rows] == ["auto", "fp8"]
    assert all(r["attention_us"] > 0 for r in rows)
    read = [r["attention_tb_s"] * r["attention_us"] for r in rows]  # bytes / 1e6
    assert abs(read[0] - 2 * read[1]) < 1e-9 * read[0]


def test_decode_tunings_leave_an_unnamed_flag_at_its_default():
    """The decode variants: a flag not on the command line keeps `DecodeTuning`'s default (an fp8 cache's
    values in pairs at 64-key blocks), one named takes each value given."""
    from gapless.attention.triton_kernels import DecodeTuning

    triton_backend = type("Backend", (), {"decode_tuning": DecodeTuning()})()
    plain = kernels_attention.decode_tunings(kernels.parse_args([]), triton_backend)
    assert plain == [DecodeTuning()] and plain[0].pairs(128)
    both = kernels_attention.decode_tunings(
        kernels.parse_args("--decode-values-in-pairs 0 1".split()), triton_backend
    )
    assert [t.values_in_pairs for t in both] == [False, True] and not both[0].pairs(128)
    lens = kernels_attention.decode_tunings(
        kernels.parse_args("--decode-min-split-len 0 256".split()), triton_backend
    )
    assert [t.min_split_len for t in lens] == [DecodeTuning().min_split_len, 256]
    # prefetch and whole blocks together are skipped (DecodeTuning refuses them), the rest all kept
    mixed = kernels_attention.decode_tunings(
        kernels.parse_args("--decode-prefetch 0 1 --decode-whole-blocks 0 1".split()), triton_backend
    )
    assert [(t.whole_blocks, t.prefetch) for t in mixed] == [(False, False), (False, True), (True, False)]
    capped = kernels_attention.decode_tunings(
        kernels.parse_args("--decode-max-registers 0 96".split()), triton_backend
    )
    assert [t.max_registers for t in capped] == [None, 96]
    not_triton = object()
    assert kernels_attention.decode_tunings(kernels.parse_args([]), not_triton) == [None]
