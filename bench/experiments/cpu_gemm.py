"""The CPU's GEMMs alone: a model's linear layers and LM head at a few row counts, plain `torch.mm` on the
checkpoint layout against the prepacked weights of `gapless.model.cpu_gemm`, interleaved in one run.

    python bench/experiments/cpu_gemm.py [--rows 1 8 32] [--threads 1] [--dtype float32]

The shapes default to SmolLM2-135M's (hidden 576, intermediate 1536, q/k/v 960, vocab 49,152, 30
layers), random weights, each layer its own (so that, as in a decode step, the weights come from memory,
not from a warm cache). Per row count: the time of one pass over every layer and of the LM head, median
of `--rounds` rounds in which plain and packed alternate, and packed/plain, the ratio to trust on a shared
machine; and packed against `packed_direct`, oneDNN's call on a lone row as it is, which `PackedLinear`
replaces by a call on copies of the row (the same call from 2 rows on); and `read`, a `sum` over each
checkpoint-layout weight: one pass reading the same bytes, the memory's floor for a GEMM of few rows,
measured in the same rounds. It also prints the largest difference between plain and packed (float32
reassociation).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from gapless.bench import cli
from gapless.model.cpu_gemm import PackedLinear

Gemm = Callable[[torch.Tensor], torch.Tensor]


def _passes(fns: list[Gemm], xs: list[torch.Tensor]) -> tuple[float, float]:
    """ms of one pass over the layers (all but the last) and of the last (the LM head)."""
    t0 = time.perf_counter()
    for f, x in zip(fns[:-1], xs[:-1], strict=True):
        f(x)
    t1 = time.perf_counter()
    fns[-1](xs[-1])
    return (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(
        prog="python bench/experiments/cpu_gemm.py", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--rows", type=cli.positive_int, nargs="+", default=[1, 8, 32])
    p.add_argument("--threads", type=cli.positive_int, default=1)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--layers", type=cli.positive_int, default=30)
    p.add_argument("--hidden", type=cli.positive_int, default=576)
    p.add_argument("--intermediate", type=cli.positive_int, default=1536)
    p.add_argument("--qkv", type=cli.positive_int, default=960)
    p.add_argument("--vocab", type=cli.positive_int, default=49152)
    p.add_argument("--rounds", type=cli.positive_int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    h, i = args.hidden, args.intermediate
    shapes = [(args.qkv, h), (h, h), (2 * i, h), (h, i)] * args.layers + [(args.vocab, h)]
    weights = [(torch.randn(o, k, generator=g) * 0.05).to(dtype) for o, k in shapes]
    packed = [PackedLinear(w, None) for w in weights]
    variants: dict[str, list[Gemm]] = {
        "plain": [lambda x, w=w: torch.mm(x, w.t()) for w in weights],
        "packed": packed,
        # oneDNN's own one-row kernel, without `PackedLinear`'s lone row as copies (the same at 2+ rows)
        "packed_direct": [g.direct for g in packed],
        # the floor: the same weights read once, no arithmetic to speak of
        "read": [lambda x, w=w: w.sum() for w in weights],
    }
    rows = []
    for n in args.rows:
        xs = [torch.randn(n, k, generator=g).to(dtype) for _, k in shapes]
        diff = max(
            (a(x).float() - b(x).float()).abs().max().item()
            for a, b, x in zip(variants["plain"], variants["packed"], xs, strict=True)
        )
        times: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
        for _ in range(args.rounds):
            for v, fns in variants.items():
                times[v].append(_passes(fns, xs))
        med = {v: tuple(statistics.median(t[j] for t in ts) for j in (0, 1)) for v, ts in times.items()}
        row = dict(rows=n, threads=args.threads, dtype=args.dtype, max_abs_diff=diff)
        for v, (layers_ms, head_ms) in med.items():
            row[v] = dict(layers_ms=layers_ms, head_ms=head_ms)
        row["layers_packed_over_plain"] = med["packed"][0] / med["plain"][0]
        row["head_packed_over_plain"] = med["packed"][1] / med["plain"][1]
        row["layers_packed_over_direct"] = med["packed"][0] / med["packed_direct"][0]
        row["head_packed_over_direct"] = med["packed"][1] / med["packed_direct"][1]
        row["layers_packed_over_read"] = med["packed"][0] / med["read"][0]
        row["head_packed_over_read"] = med["packed"][1] / med["read"][1]
        rows.append(row)
        print(
            f"rows {n}, {args.threads} threads, {args.dtype}: layers {med['plain'][0]:.1f} -> "
            f"{med['packed'][0]:.1f} ms ({row['layers_packed_over_plain']:.2f}x; "
            f"{row['layers_packed_over_direct']:.2f}x oneDNN's direct call), LM head "
            f"{med['plain'][1]:.1f} -> {med['packed'][1]:.1f} ms ({row['head_packed_over_plain']:.2f}x; "
            f"{row['head_packed_over_direct']:.2f}x direct), max |diff| {diff:.1e}; reading the weights "
            f"once: layers {med['read'][0]:.1f} ms (packed {row['layers_packed_over_read']:.2f}x that), "
            f"LM head {med['read'][1]:.1f} ms ({row['head_packed_over_read']:.2f}x)",
            flush=True,
        )
    return rows


if __name__ == "__main__":
    main()
