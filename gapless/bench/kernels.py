"""Microbenchmarks of the decoder's kernels, each against its yardstick measured in the same run.

    python -m gapless.bench.kernels --device cuda [--dtype bfloat16] [--tokens 256] [--batch 1 64 256]
        [--context 1024 4096 8192] [--page-size 1 16] [--kv-cache-dtype auto fp8]
        [--decode-block-n 0 32 64 128] [--decode-warps 4 8]
        [--decode-stages 2 5] [--decode-programs-per-sm 2 32] [--decode-heads-first 0 1]
        [--decode-whole-blocks 0 1]
        [--extend-block-m 0 128]
        [--extend-block-n 0 32] [--extend-warps 4 8] [--extend-stages 2 5] [--sample-batch 1 8 64 256]
        [--vocab 151936] [--json FILE]

1. Each fused Triton kernel of `gapless.model.fused` against the torch sequence it replaces (residual
   add + RMSNorm, q/k norm + RoPE + KV store, SiLU·mul, GeLU·mul), on `--tokens` rows of a model shape
   (default Qwen3-0.6B's: hidden 1024, 16 heads, 8 kv heads, head dim 128, intermediate 3072): median
   microseconds of each and the ratio.
2. Decode attention (`gapless.bench.kernels_attention`; `--attention`, default the Triton backend on CUDA,
   torch elsewhere) for each batch of `--batch`, context, page size and KV dtype (`--kv-cache-dtype`: fp8 and
   fp8_e5m2 read 1 byte an element), and with Triton for each decode kernel variant (every combination of
   `--decode-block-n` (0: the default), `--decode-warps`, `--decode-stages`, `--decode-programs-per-sm`,
   the split heuristic's target (the row shows the split count it chose), `--decode-heads-first`, the
   grid's order, `--decode-whole-blocks`, the unmasked loop over whole key blocks, and
   `--decode-values-in-pairs`, an fp8 cache's values read as 16-bit pairs; a flag not given keeps its
   default): the KV bytes a step must read (K and V of every cached token, once) over its median time,
   against a device-to-device copy of as many bytes in the same run (its bandwidth counts the bytes read
   and written), so the ratio says how near attention runs to what this device's memory delivers.
3. Extend (prefill) attention over `--extend-tokens` new tokens a batch (requests of `--extend-len`
   tokens, no cached prefix) for each KV dtype: causal attention's FLOPs (4 * heads * head_dim * L(L+1)/2
   a request) over its median time, against a `--matmul-n` square matmul in the same dtype measured in
   the same run; with Triton for each extend kernel variant (every combination of `--extend-block-m`,
   `--extend-block-n` (0: the default), `--extend-warps` and `--extend-stages`).
4. Sampling on each `--sample-batch` count of rows of `--vocab` logits (`gapless.bench.kernels_sampling`):
   each sampling mode on the engine's sampler, then the torch paths against the fused kernels; beside each
   row, the time a read of its logits takes at the copy bandwidth of the same run.

On a CPU the Triton columns run only under Triton's interpreter (TRITON_INTERPRET=1, for tests; the
figures mean nothing there); without it they print "-". On CUDA each figure is device time: `--iters`
calls captured in a CUDA graph, its replays timed with events (`median_us`), each call reading memory
rather than L2 where its working set is small (`cold_copies`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

from gapless.bench import cli
from gapless.bench.kernels_attention import attention_rows, extend_rows
from gapless.bench.kernels_sampling import sampling_rows
from gapless.bench.timing import median_us
from gapless.model.layers import GATED_ACTIVATIONS, RotaryEmbedding, make_rms_norm


def _triton_kernels(device: torch.device) -> Any:
    """The fused kernels module, or None where it cannot run (no Triton; a CPU without the interpreter)."""
    try:
        from gapless.model.fused import triton_kernels as fk
    except ImportError:
        return None
    return fk if device.type == "cuda" or fk.INTERPRET else None


def fused_rows(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[dict[str, Any]]:
    """One row per fused kernel: torch's and Triton's median microseconds."""
    fk = _triton_kernels(device)
    g = torch.Generator().manual_seed(0)
    rand = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    T, H, KVH, D = args.tokens, args.heads, args.kv_heads, args.head_dim
    norm = make_rms_norm(args.hidden, 1e-6, "llama").to(device=device, dtype=dtype)
    qk_norm = make_rms_norm(D, 1e-6, "llama").to(device=device, dtype=dtype)
    rope = RotaryEmbedding(D, 32768, 1e6, None).to(device)
    x, res = rand(T, args.hidden), rand(T, args.hidden)
    qkv = rand(T, (H + 2 * KVH) * D)
    q, k, v = (t.view(T, -1, D) for t in qkv.split([H * D, KVH * D, KVH * D], -1))
    pos = torch.randint(0, 4096, (T,), generator=g).to(device)
    slots = torch.randperm(T, generator=g).to(device)
    k_cache, v_cache = rand(T, KVH, D), rand(T, KVH, D)
    gate_up = rand(T, 2 * args.intermediate)

    def torch_rope_store() -> None:
        qn, kn = rope(pos, qk_norm(q), qk_norm(k))
        k_cache.index_copy_(0, slots, kn)
        v_cache.index_copy_(0, slots, v)

    norm_args = (qk_norm.weight, qk_norm.weight, qk_norm.eps, "llama")
    cases: dict[str, tuple[Callable[[], object], Callable[[], object] | None]] = {
        "add + RMSNorm": (
            lambda: norm.normalize(x + res),
            fk and (lambda: fk.rms_norm(x, norm.weight, norm.eps, "llama", res)),
        ),
        "q/k norm + RoPE + KV store": (
            torch_rope_store,
            fk
            and (
                lambda: fk.qk_norm_rope_store(pos, q, k, v, rope.cos_sin, k_cache, v_cache, slots, norm_args)
            ),
        ),
        "SiLU·mul": (
            lambda: GATED_ACTIVATIONS["silu"](gate_up),
            fk and (lambda: fk.act_and_mul(gate_up, "silu")),
        ),
        "GeLU(tanh)·mul": (
            lambda: GATED_ACTIVATIONS["gelu_pytorch_tanh"](gate_up),
            fk and (lambda: fk.act_and_mul(gate_up, "gelu_pytorch_tanh")),
        ),
    }
    rows = []
    with torch.inference_mode():
        for name, (ref, fused) in cases.items():
            t_ref = median_us(ref, device, args)
            t_fused = median_us(fused, device, args) if fused else None
            rows.append({"kernel": name, "torch_us": t_ref, "triton_us": t_fused})
    return rows


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def _opt(x: int | None) -> str:
    return "-" if x is None else str(x)


def _table(
    rows: list[dict[str, Any]], columns: list[tuple[str, str, Callable[[Any], str]]], align: str = ""
) -> list[str]:
    """A markdown table: one (header, row key, format) a column; right-aligned (numbers) unless `align`
    says otherwise."""
    header = [c[0] for c in columns]
    return cli.markdown_table(
        header, [[fmt(r[key]) for _, key, fmt in columns] for r in rows], align or "r" * len(columns)
    )


def _versus_torch(rows: list[dict[str, Any]], other: str) -> list[dict[str, Any]]:
    """`rows` with "vs_torch": the time of their `other` key over their torch time ("-" where unmeasured)."""

    def ratio(r: dict[str, Any]) -> str:
        return "-" if r[other] is None or not r["torch_us"] else f"{r[other] / r['torch_us']:.2f}x"

    return [{**r, "vs_torch": ratio(r)} for r in rows]


def report(res: dict[str, Any]) -> list[str]:
    lines = [cli.machine_line(res["machine"]), f"dtype {res['dtype']}; command: {res['command']}", ""]
    lines += _table(
        _versus_torch(res["fused"], "triton_us"),
        [
            ("fused kernel", "kernel", str),
            (f"torch µs ({res['tokens']} rows)", "torch_us", _fmt),
            ("triton µs", "triton_us", _fmt),
            ("triton / torch", "vs_torch", str),
        ],
        "lrrr",
    )
    lines += ["", f"decode attention ({res['attention']}):"]
    lines += _table(
        res["attention_rows"],
        [
            ("batch", "batch", str),
            ("context", "context", str),
            ("page size", "page_size", str),
            ("KV", "kv_dtype", str),
            ("block n", "block_n", _opt),
            ("warps", "num_warps", _opt),
            ("stages", "num_stages", _opt),
            ("programs/SM", "programs_per_sm", _opt),
            ("min split", "min_split_len", _opt),
            ("heads first", "heads_first", _opt),
            ("whole blocks", "whole_blocks", _opt),
            ("value pairs", "values_in_pairs", _opt),
            ("prefetch", "prefetch", _opt),
            ("max regs", "max_registers", _opt),
            ("splits", "splits", _opt),
            ("µs", "attention_us", _fmt),
            ("KV read TB/s", "attention_tb_s", "{:.3f}".format),
            ("copy TB/s", "copy_tb_s", "{:.3f}".format),
            ("attention / copy", "ratio", "{:.0%}".format),
        ],
    )
    lines += ["", f"sampling, rows of {res['vocab']} logits:"]
    lines += _table(
        _versus_torch(res["sampling"], "path_us"),
        [
            ("rows", "rows", str),
            ("case", "case", str),
            ("torch µs", "torch_us", _fmt),
            ("path", "path", str),
            ("its µs", "path_us", _fmt),
            ("path / torch", "vs_torch", str),
            ("logits read once µs", "logits_read_us", "{:.1f}".format),
        ],
        "rlrlrrr",
    )
    lines += ["", f"extend attention ({res['attention']}), requests of {res['extend_len']} tokens:"]
    lines += _table(
        res["extend_rows"],
        [
            ("tokens", "tokens", str),
            ("KV", "kv_dtype", str),
            ("block m", "block_m", _opt),
            ("block n", "block_n", _opt),
            ("warps", "num_warps", _opt),
            ("stages", "num_stages", _opt),
            ("µs", "attention_us", _fmt),
            ("attention TFLOP/s", "attention_tflop_s", "{:.2f}".format),
            (f"matmul {res['matmul_n']}³ TFLOP/s", "matmul_tflop_s", "{:.2f}".format),
            ("attention / matmul", "ratio", "{:.0%}".format),
        ],
    )
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gapless.bench.kernels", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--tokens", type=cli.positive_int, default=256, help="rows of the fused-kernel inputs")
    p.add_argument("--hidden", type=cli.positive_int, default=1024)
    p.add_argument("--heads", type=cli.positive_int, default=16)
    p.add_argument("--kv-heads", type=cli.positive_int, default=8)
    p.add_argument("--head-dim", type=cli.positive_int, default=128)
    p.add_argument("--intermediate", type=cli.positive_int, default=3072)
    p.add_argument(
        "--batch", type=cli.positive_int, nargs="+", default=[1, 64, 256], help="decode attention's batches"
    )
    p.add_argument("--context", type=cli.positive_int, nargs="+", default=[1024, 4096, 8192])
    p.add_argument("--page-size", type=cli.positive_int, nargs="+", default=[1, 16])
    p.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        default=["auto"],
        choices=["auto", "fp8", "fp8_e5m2"],
        help="decode's KV",
    )
    tune = "decode kernel variants to time, every combination (Triton backend)"
    p.add_argument("--decode-block-n", type=int, nargs="+", default=[0], help=f"{tune}; 0: its default")
    p.add_argument("--decode-warps", type=cli.positive_int, nargs="+", default=[4], help=tune)
    p.add_argument("--decode-stages", type=cli.positive_int, nargs="+", default=[2], help=tune)
    p.add_argument(
        "--decode-max-registers",
        type=int,
        nargs="+",
        default=[0],
        help=f"{tune}: a cap on a thread's registers (Triton's maxnreg); 0: none",
    )
    p.add_argument(
        "--decode-programs-per-sm",
        type=cli.positive_int,
        nargs="+",
        default=[2],
        help=f"{tune}: the split count aims at this many programs per SM",
    )
    p.add_argument(
        "--decode-min-split-len",
        type=int,
        nargs="+",
        default=[0],
        help=f"{tune}: no split shorter than this many keys; 0: its default",
    )
    for flag, what in (
        ("heads-first", "1 launches a request's kv heads side by side (grid order)"),
        ("whole-blocks", "1 runs a split's whole key blocks without masks, its partial block after"),
        ("values-in-pairs", "1 reads an fp8 cache's values as 16-bit pairs, widened a pair at once"),
        ("prefetch", "1 loads each key block's keys and values into registers a block ahead"),
    ):
        p.add_argument(
            f"--decode-{flag}", type=int, nargs="+", choices=(0, 1), default=[None], help=f"{tune}: {what}"
        )
    p.add_argument("--extend-tokens", type=cli.positive_int, nargs="+", default=[2048, 16384])
    p.add_argument("--extend-len", type=cli.positive_int, default=1024, help="tokens per extend request")
    tune = "extend kernel variants to time, every combination (Triton backend)"
    p.add_argument("--extend-block-m", type=int, nargs="+", default=[0], help=f"{tune}; 0: its default")
    p.add_argument("--extend-block-n", type=int, nargs="+", default=[0], help=f"{tune}; 0: its default")
    p.add_argument("--extend-warps", type=cli.positive_int, nargs="+", default=[4], help=tune)
    p.add_argument("--extend-stages", type=cli.positive_int, nargs="+", default=[2], help=tune)
    p.add_argument("--matmul-n", type=cli.positive_int, default=8192, help="the square matmul's size")
    p.add_argument("--attention", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument(
        "--sample-batch",
        type=cli.positive_int,
        nargs="+",
        default=[1, 8, 64, 256],
        help="the sampler's rows, each count in turn",
    )
    p.add_argument("--vocab", type=cli.positive_int, default=151936, help="the sampler's logits per row")
    p.add_argument("--iters", type=cli.positive_int, default=20, help="timed calls (the median is kept)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first")
    p.add_argument("--json", default=None, help="also write the figures here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    res: dict[str, Any] = {
        "machine": cli.machine(args.device),
        "command": cli.command_line("gapless.bench.kernels", argv if argv is not None else []),
        "dtype": args.dtype,
        "tokens": args.tokens,
        "batch": args.batch,
        "attention": args.attention,
        "fused": fused_rows(args, device, dtype),
        "attention_rows": attention_rows(args, device, dtype),
        "extend_len": args.extend_len,
        "matmul_n": args.matmul_n,
        "extend_rows": extend_rows(args, device, dtype),
        "sample_batch": args.sample_batch,
        "vocab": args.vocab,
        "sampling": sampling_rows(args, device, dtype),
    }
    print("\n".join(report(res)))
    if args.json:
        cli.write_json(args.json, res)
    return res


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
