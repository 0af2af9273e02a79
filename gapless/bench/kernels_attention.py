"""The attention part of `python -m gapless.bench.kernels`: decode attention's KV read bandwidth against a
copy's, and extend attention's FLOP/s against a matmul's, each over a bf16 or an fp8 cache, with Triton for
each kernel variant asked for (`DecodeTuning`, `ExtendTuning`). Its batches are built here as the engine
builds them (`decode_metadata`, `extend_metadata`): pages scattered over the pool, slot 0 left free."""

from __future__ import annotations

import argparse
import itertools
from functools import partial
from typing import Any

import torch

from gapless.attention import make_backend
from gapless.attention.base import AttentionMetadata
from gapless.bench.timing import cold_copies, copy_tb_s, cycling, median_us
from gapless.memory.kv_pool import FP8_DTYPES, kv_cache_dtype


def decode_metadata(batch: int, context: int, page_size: int, device: torch.device) -> AttentionMetadata:
    """A decode batch of `batch` requests of `context` tokens each, their pages scattered over the pool
    (slot 0 and page 0 left free, as the engine keeps them)."""
    pages_per_req = -(-context // page_size)
    g = torch.Generator().manual_seed(1)
    pages = (torch.randperm(batch * pages_per_req, generator=g) + 1).view(batch, pages_per_req)
    offsets = torch.arange(pages_per_req * page_size) % page_size
    table = (pages.repeat_interleave(page_size, 1) * page_size + offsets)[:, :context]
    return AttentionMetadata(
        rows=torch.arange(batch, device=device),
        prefix_lens=torch.full((batch,), context - 1, device=device),
        extend_lens=torch.ones(batch, dtype=torch.int64, device=device),
        q_start=torch.arange(batch, device=device),
        req_table=table.to(device=device, dtype=torch.int32),
        max_extend_len=1,
        max_seq_len=context,
        is_decode=True,
    )


def attention_rows(
    args: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> list[dict[str, Any]]:
    """One row per (batch, context, page size, decode tuning): decode attention's achieved KV read
    bandwidth, and a copy's of as many bytes."""
    backend = make_backend(args.attention, device)
    return [
        row
        for batch in args.batch
        for context in args.context
        for page_size in args.page_size
        for kv in args.kv_cache_dtype
        for row in _attention_case(args, backend, batch, context, page_size, device, dtype, kv)
    ]


def decode_tunings(args: argparse.Namespace, backend: Any) -> list[Any]:
    """The decode kernel variants to time (every combination of the `--decode-*` options) when the backend
    is Triton's; [None] (the backend as it is) otherwise."""
    if not hasattr(backend, "decode_tuning"):
        return [None]
    from gapless.attention.triton_kernels import MIN_SPLIT_LEN, DecodeTuning

    combos = itertools.product(  # block_n, warps, stages, programs/SM, min split, max registers, 4 flags
        args.decode_block_n, args.decode_warps, args.decode_stages, args.decode_programs_per_sm,
        args.decode_min_split_len, args.decode_max_registers, args.decode_heads_first,
        args.decode_whole_blocks, args.decode_values_in_pairs, args.decode_prefetch,
    )  # fmt: skip
    flags = ("heads_first", "whole_blocks", "values_in_pairs", "prefetch")  # (None: DecodeTuning's default)
    tunings = []
    for n, w, st, pps, msl, regs, *on in combos:
        named = {f: bool(v) for f, v in zip(flags, on) if v is not None}
        if named.get("prefetch") and named.get("whole_blocks"):
            continue  # (exclusive: DecodeTuning refuses both)
        tunings.append(
            DecodeTuning(n or None, w, st, pps, msl or MIN_SPLIT_LEN, max_registers=regs or None, **named)
        )
    return tunings


def extend_tunings(args: argparse.Namespace, backend: Any) -> list[Any]:
    """The extend kernel variants to time (`--extend-block-m/-block-n/-warps/-stages`, every combination)
    when the backend is Triton's; [None] (the backend as it is) otherwise."""
    if not hasattr(backend, "extend_tuning"):
        return [None]
    from gapless.attention.triton_kernels import ExtendTuning

    return [
        ExtendTuning(block_m=m or None, block_n=n or None, num_warps=w, num_stages=st)
        for m in args.extend_block_m
        for n in args.extend_block_n
        for w in args.extend_warps
        for st in args.extend_stages
    ]


def _time_attention(
    backend: Any,
    knob: str,
    tuning: Any,
    meta: AttentionMetadata,
    q: torch.Tensor,
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    args: argparse.Namespace,
    **scales: torch.Tensor,
) -> tuple[float, Any]:
    """Median µs of `backend`'s attention over `meta`'s batch with `tuning` set as its `knob`
    ("decode_tuning" or "extend_tuning"; None: the backend as it is), and the batch's prepared state
    (where the decode split count shows). `scales`: an fp8 cache's k_scale and v_scale."""
    if tuning is not None:
        setattr(backend, knob, tuning)
    scale = q.shape[-1] ** -0.5
    with torch.inference_mode():
        state = backend.prepare(meta)
        calls = [partial(backend.forward, q, k, v, state, scale, **scales) for k, v in caches]
        us = median_us(cycling(calls), q.device, args)
    return us, state


def _attention_case(
    args: argparse.Namespace,
    backend: Any,
    batch: int,
    context: int,
    page_size: int,
    device: torch.device,
    dtype: torch.dtype,
    kv: str = "auto",
) -> list[dict[str, Any]]:
    B, H, KVH, D = batch, args.heads, args.kv_heads, args.head_dim
    meta = decode_metadata(B, context, page_size, device)
    slots = (B * -(-context // page_size) + 1) * page_size
    kv_dtype = kv_cache_dtype(kv, dtype)
    kv_bytes = 2 * B * context * KVH * D * kv_dtype.itemsize
    scales = _cache_scales(kv_dtype, device)
    # as many caches as keep each call's KV out of L2 (a lone request's 4k context fits an H100's)
    cache = lambda: torch.randn(slots, KVH, D, device=device, dtype=dtype).to(kv_dtype)  # noqa: E731
    caches = [(cache(), cache()) for _ in range(cold_copies(kv_bytes, device))]
    q = torch.randn(B, H, D, device=device, dtype=dtype)
    copy_tbs = copy_tb_s(kv_bytes, device, args)
    rows = []
    for tuning in decode_tunings(args, backend):
        t_attn, state = _time_attention(backend, "decode_tuning", tuning, meta, q, caches, args, **scales)
        attn_tbs = kv_bytes / t_attn / 1e6
        splits = [s[0] for s in getattr(state, "scratch", {}).values()]
        rows.append(
            {
                "batch": B,
                "context": context,
                "page_size": page_size,
                "kv_dtype": kv,
                "block_n": tuning.keys_per_block(D) if tuning is not None else None,
                "num_warps": tuning.num_warps if tuning is not None else None,
                "num_stages": tuning.num_stages if tuning is not None else None,
                "programs_per_sm": tuning.programs_per_sm if tuning is not None else None,
                "min_split_len": tuning.min_split_len if tuning is not None else None,
                "heads_first": tuning.heads_first if tuning is not None else None,
                "whole_blocks": tuning.whole_blocks if tuning is not None else None,
                "values_in_pairs": tuning.pairs(D) if tuning is not None else None,
                "prefetch": tuning.prefetch if tuning is not None else None,
                "max_registers": tuning.max_registers if tuning is not None else None,
                "splits": splits[0] if splits else None,
                "attention_us": t_attn,
                "attention_tb_s": attn_tbs,
                "copy_tb_s": copy_tbs,
                "ratio": attn_tbs / copy_tbs,
            }
        )
    return rows


def extend_metadata(tokens: int, req_len: int, device: torch.device) -> AttentionMetadata:
    """An extend batch of `tokens` new tokens in requests of `req_len` (the last one shorter), no prefix;
    request b's tokens in slots 1 + b * req_len onwards."""
    lens = [min(req_len, tokens - start) for start in range(0, tokens, req_len)]
    ext = torch.tensor(lens)
    starts = torch.cumsum(ext, 0) - ext
    table = (starts[:, None] + torch.arange(req_len)[None, :] + 1).clamp(max=tokens)
    return AttentionMetadata(
        rows=torch.arange(len(lens), device=device),
        prefix_lens=torch.zeros(len(lens), dtype=torch.int64, device=device),
        extend_lens=ext.to(device),
        q_start=starts.to(device),
        req_table=table.to(device=device, dtype=torch.int32),
        max_extend_len=max(lens),
        max_seq_len=max(lens),
        is_decode=False,
    )


def _cache_scales(kv_dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """An fp8 cache's k and v scales (1: its values are randn, as the others'); none for another cache."""
    one = torch.ones(1, device=device)
    return {"k_scale": one, "v_scale": one} if kv_dtype in FP8_DTYPES else {}


def extend_rows(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[dict[str, Any]]:
    """One row per `--extend-tokens` and KV dtype: extend attention's TFLOP/s, and a square matmul's."""
    backend = make_backend(args.attention, device)
    H, KVH, D, n = args.heads, args.kv_heads, args.head_dim, args.matmul_n
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    with torch.inference_mode():
        matmul_tflops = 2 * n**3 / median_us(lambda: torch.mm(a, b), device, args) / 1e6
    rows = []
    for tokens, kv in itertools.product(args.extend_tokens, args.kv_cache_dtype):
        meta = extend_metadata(tokens, args.extend_len, device)
        q = torch.randn(tokens, H, D, device=device, dtype=dtype)
        kv_dtype = kv_cache_dtype(kv, dtype)
        k, v = (torch.randn(tokens + 1, KVH, D, device=device, dtype=dtype).to(kv_dtype) for _ in range(2))
        flops = sum(4 * H * D * L * (L + 1) // 2 for L in meta.extend_lens.tolist())
        for tuning in extend_tunings(args, backend):
            scales = _cache_scales(kv_dtype, device)
            t, _ = _time_attention(backend, "extend_tuning", tuning, meta, q, [(k, v)], args, **scales)
            tflops = flops / t / 1e6
            blocks = tuning.blocks(D, q.element_size()) if tuning is not None else (None, None)
            rows.append(
                {
                    "tokens": tokens,
                    "kv_dtype": kv,
                    "req_len": args.extend_len,
                    "block_m": blocks[0],
                    "block_n": blocks[1],
                    "num_warps": tuning.num_warps if tuning is not None else None,
                    "num_stages": tuning.num_stages if tuning is not None else None,
                    "attention_us": t,
                    "attention_tflop_s": tflops,
                    "matmul_tflop_s": matmul_tflops,
                    "ratio": tflops / matmul_tflops,
                }
            )
    return rows
