"""Fused elementwise kernels in Triton: what the decoder does between its GEMMs, one kernel per step.

Unfused, a decode step spends as much GPU time in small elementwise kernels as in attention (issue 11's
H100 profile: RMSNorm as pow/mean/add/rsqrt/mul, RoPE as neg/cat/mul, SiLU·mul, dtype copies, the KV
store's `index_copy_`), and each of them is a host launch in eager prefill. Here:

- `rms_norm`: the residual add and the RMSNorm in one pass over the row (vLLM's `norm(x, residual) ->
  (normed, new_residual)`), for the three RMSNorm arithmetics of `gapless.model.layers.RMS_NORMS`.
- `qk_norm_rope_store`: per token and head, Qwen3/Gemma 3's per-head q/k RMSNorm (when the family has
  one), RoPE on q and k from the model's cos/sin table, and the store of the rotated k and of v into the
  KV pool's slots; it returns the rotated q. This is the attention backend's contract (K/V are in the
  cache when `backend.forward` is called) kept by one kernel instead of the norm, rotate and copy ops.
- `act_and_mul`: SiLU(gate)·up and GeLU-tanh(gate)·up over the fused gate/up projection's output.

The norm and the activation can also write, beside their output, what the layer they feed would launch a
kernel for: x rounded to e4m3 for an FP8 layer (`RoundedRows`), x's columns in an int4 act-order layer's
order (`OrderedColumns`), carried on the output tensor.

Each rounds where the torch sequence it replaces rounds (a product of two bf16 tensors is computed in
fp32 and rounded to bf16 before the next op), so in bf16/fp16 they agree with the torch reference to the
last bit but for the order of the fp32 sum of squares and `rsqrt`'s own rounding; `gapless.model.fused`
checks them against it at start-up. Launchers take sizes from host ints and never sync the device.

As in `gapless.attention.triton_kernels`, whose notes on Triton's interpreter apply here too, the
reductions are called through its `_sum` (interpreted copies of `tl.sum` under `TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gapless import pdl
from gapless.attention.triton_kernels import INTERPRET, _sum
from gapless.memory.kv_pool import E5M2, FP8
from gapless.model.quant.base import OrderedColumns, RoundedRows, attach_order, attach_rounding
from gapless.model.quant.fp8_rounding import fp8_grid, round_rows, rounding_buffers
from gapless.model.triton_math import ACTIVATIONS, NORM_KINDS, act_mul, norm_scale, rounded

__all__ = ["INTERPRET", "ACTIVATIONS", "rms_norm", "qk_norm_rope_store", "act_and_mul"]

_ACT_BLOCK = 1024


@triton.jit
def _with_early(value, loaded):
    """`value` (float32, never -0: a square here) as it is, but computed after `loaded` arrives: 0 * loaded
    is +-0 or NaN, its minimum with 0 is +-0 (`tl.minimum` drops a NaN operand, as PTX's `min.f32` and the
    interpreter's `fmin` do), and adding +-0 leaves such a value as it was, a NaN included. ptxas issues a
    load whose value is first needed after a reduction's barrier only once the loads before that barrier
    have arrived (sm_90 SASS: the RMSNorm's weight), a second trip to memory in a kernel that at one row is
    a chain of them; used before the barrier, it goes out with them."""
    return value + tl.minimum(0.0 * loaded.to(tl.float32), 0.0)


@triton.jit
def _store_rounded(out, row, first, n, Q, S, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    """`out` (float32 [BLOCK]: columns [first, first + BLOCK) of a row of n, those past n zero) rounded to
    e4m3 per GROUP columns by the FP8 GEMM's own rounding (`round_rows`: the same bits as its launch would
    write from the stored row) into row `row` of Q [rows, n] and of its scales S [rows, ceil(n / GROUP)]."""
    q, scale = round_rows(tl.reshape(out, (BLOCK // GROUP, GROUP)))
    groups = first // GROUP + tl.arange(0, BLOCK // GROUP)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    tl.store(Q + row * n + cols, q, mask=cols < n)
    tl.store(S + row * tl.cdiv(n, GROUP) + groups, scale, mask=groups * GROUP < n)


def _rounding(rows: int, n: int, group: int, device: torch.device) -> RoundedRows | None:
    """Empty buffers for `rows` rows of n columns rounded to e4m3 per `group` columns (0: None)."""
    return RoundedRows(*rounding_buffers(rows, n, group, device), group) if group else None


def _ordering(out: torch.Tensor, order: torch.Tensor | None) -> OrderedColumns | None:
    """An empty buffer like `out` [rows, n] for its columns in `order` (None: None)."""
    return None if order is None else OrderedColumns(torch.empty_like(out), order)


def _carrying(out: torch.Tensor, rounded: RoundedRows | None, ordered: OrderedColumns | None) -> torch.Tensor:
    """`out` with what its kernel wrote beside it for the layer it feeds attached."""
    out = out if rounded is None else attach_rounding(out, rounded)
    return out if ordered is None else attach_order(out, ordered)


@triton.jit
def _rms_norm_kernel(
    X,
    R,
    W,
    Out,
    ROut,
    Q,
    S,
    Order,
    P,
    n_cols,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    eps,
    KIND: tl.constexpr,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
    ORDERED: tl.constexpr,
    PDL: tl.constexpr,
):
    """One row: (x + residual, rounded to the dtype and written out as the new residual, when HAS_RES),
    then its RMSNorm; with GROUP, the norm also rounded to e4m3 for an FP8 layer (`_store_rounded`); with
    ORDERED, also written to P [rows, n] with its columns in `Order` (column i: the norm's column
    Order[i]), computed again from x (and residual) gathered in that order, so the same bits."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    w = tl.load(W + offs, mask=mask, other=0.0)  # (a weight: before the wait, `gapless.pdl`)
    src, w_src = offs, w  # (the columns in `Order`, and their weights, where ORDERED)
    if ORDERED:
        src = tl.load(Order + offs, mask=mask, other=0)
        w_src = tl.load(W + src, mask=mask, other=0.0)
    pdl.wait_for_previous(PDL)
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    x_src = x.to(tl.float32)
    if ORDERED:
        x_src = tl.load(X + row * stride_x + src, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0)
        x32 = rounded(x.to(tl.float32) + r.to(tl.float32), ROut.dtype.element_ty)
        tl.store(ROut + row * stride_ro + offs, x32.to(ROut.dtype.element_ty), mask=mask)
        if ORDERED:
            r_src = tl.load(R + row * stride_r + src, mask=mask, other=0.0).to(tl.float32)
            x_src = rounded(x_src + r_src, ROut.dtype.element_ty)
    else:
        x32 = x.to(tl.float32)
    inv = tl.rsqrt(_sum(_with_early(x32 * x32, w), 0) / n_cols + eps)
    out = rounded(norm_scale(x32 * inv, w, KIND), Out.dtype.element_ty)
    tl.store(Out + row * stride_o + offs, out.to(Out.dtype.element_ty), mask=mask)
    if GROUP:
        _store_rounded(out, row, 0, n_cols, Q, S, BLOCK, GROUP)
    if ORDERED:
        ordered = rounded(norm_scale(x_src * inv, w_src, KIND), Out.dtype.element_ty)
        tl.store(P + row * n_cols + offs, ordered.to(P.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    kind: str,
    residual: torch.Tensor | None = None,
    round_group: int = 0,
    order: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of `x` [T, n] (the last dim contiguous); with `residual`, of `x + residual`, returned with
    that sum as the new residual (x's dtype). `round_group`: the norm also rounded to e4m3 per that many
    columns, carried on it for the FP8 layer it feeds (`RoundedRows`); 0: not. `order` ([n] int64): the
    norm also written with its columns in that order, carried on it for the int4 act-order layer it
    feeds (`OrderedColumns`); None: not."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res_out = None
    r_in, r_out = x2, out  # without a residual the kernel reads neither (HAS_RES=False)
    if residual is not None:
        r_in = residual.reshape(-1, n)
        res_out = r_out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    rows, block = x2.shape[0], max(triton.next_power_of_2(n), round_group)
    rounded, ordered = _rounding(rows, n, round_group, x.device), _ordering(out, order)
    if rows:
        _rms_norm_kernel[(rows,)](
            x2,
            r_in,
            weight,
            out,
            r_out,
            *(rounded[:2] if rounded is not None else (out, out)),  # (unwritten without GROUP)
            *(ordered[::-1] if ordered is not None else (out, out)),  # (Order, P; unread without ORDERED)
            n,
            x2.stride(0),
            r_in.stride(0),
            out.stride(0),
            r_out.stride(0),
            eps,
            KIND=NORM_KINDS[kind],
            HAS_RES=residual is not None,
            BLOCK=block,
            GROUP=round_group,
            ORDERED=ordered is not None,
            num_warps=min(max(block // 256, 1), 16),  # ~8 fp32 values a thread, whatever the width
            **pdl.launch_args(x.device),
        )
    normed = _carrying(out.view(x.shape), rounded, ordered)
    return normed if res_out is None else (normed, res_out.view(x.shape))


@triton.jit
def _qk_norm_rope_store_kernel(
    Q,
    K,
    V,
    Pos,
    CosSin,
    QW,
    KW,
    QOut,
    KCache,
    VCache,
    Slots,
    KScale,
    VScale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kt,
    stride_kh,
    stride_kct,
    stride_kch,
    stride_vt,
    stride_vh,
    stride_vct,
    stride_vch,
    stride_cs,
    num_q_heads,
    head_dim,
    eps,
    NORM: tl.constexpr,
    KIND: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (token t, head h): h < num_q_heads is query head h, written to QOut; the others are kv
    head h - num_q_heads, whose rotated k and whose v go to the token's KV slot (KV_FP8: divided by the
    layer's scale, saturated and rounded to e4m3, or with KV_FP8 2 to e5m2)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < head_dim
    half = head_dim // 2
    partner = tl.where(offs < half, offs + half, offs - half)  # rotate-half's source element
    is_q = h < num_q_heads
    kvh = h - num_q_heads
    pdl.wait_for_previous(PDL)
    # every load that waits on no other first (at one token the kernel is a chain of trips to memory):
    # the position (the table's loads wait on it), x and its rotate-half partners, a kv head's v and slot
    pos = tl.load(Pos + t).to(tl.int64)
    if is_q:
        src = Q + t * stride_qt + h * stride_qh
        w_ptr = QW
    else:
        src = K + t * stride_kt + kvh * stride_kh
        w_ptr = KW
    x = tl.load(src + offs, mask=mask, other=0.0)
    dtype = x.dtype
    xf = x.to(tl.float32)
    xp = tl.load(src + partner, mask=mask, other=0.0).to(tl.float32)
    v_mask = mask & (kvh + 0 * offs >= 0)  # (a vector: the interpreter's masks)
    v = tl.load(V + t * stride_vt + kvh * stride_vh + offs, mask=v_mask, other=0.0)
    slot = tl.load(Slots + t).to(tl.int64)  # (every token has one: read by the q heads too, unused)
    early = xp + v.to(tl.float32) + slot.to(tl.float32)
    k_scale, v_scale = 1.0, 1.0  # (an fp8 cache's, loaded now: the stores below wait on nothing more)
    if KV_FP8:
        k_scale, v_scale = tl.load(KScale), tl.load(VScale)
        early += k_scale + v_scale
    if NORM:  # the per-head RMSNorm, rounded to the dtype as its torch module returns it
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        wp = tl.load(w_ptr + partner, mask=mask, other=0.0)
        early += w.to(tl.float32) + wp.to(tl.float32)
        inv = tl.rsqrt(_sum(_with_early(xf * xf, early), 0) / head_dim + eps)
        xf = rounded(norm_scale(xf * inv, w, KIND), dtype)
        xp = rounded(norm_scale(xp * inv, wp, KIND), dtype)
    # the table's cos and signed sin, cast to the dtype as the torch reference casts them
    cos = rounded(tl.load(CosSin + pos * stride_cs + offs, mask=mask, other=0.0).to(tl.float32), dtype)
    sin = tl.load(CosSin + pos * stride_cs + head_dim + offs, mask=mask, other=0.0).to(tl.float32)
    sin = rounded(sin, dtype)
    rot = rounded(rounded(xf * cos, dtype) + rounded(xp * sin, dtype), dtype)
    if is_q:
        tl.store(QOut + t * stride_ot + h * stride_oh + offs, rot.to(QOut.dtype.element_ty), mask=mask)
    else:
        k_dst = KCache + slot * stride_kct + kvh * stride_kch + offs
        v_dst = VCache + slot * stride_vct + kvh * stride_vch + offs
        if KV_FP8:  # (v's rounding stored at once: Triton keeps a variable's type through the branch)
            rot = fp8_grid(rot, k_scale, KV_FP8 == 2)
            tl.store(
                v_dst,
                fp8_grid(v.to(tl.float32), v_scale, KV_FP8 == 2).to(VCache.dtype.element_ty),
                mask=mask,
            )
        else:
            tl.store(v_dst, v.to(VCache.dtype.element_ty), mask=mask)
        tl.store(k_dst, rot.to(KCache.dtype.element_ty), mask=mask)


_KV_FP8 = {FP8: 1, E5M2: 2}  # the store kernel's KV_FP8 for an fp8 cache


def qk_norm_rope_store(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    norm: tuple[torch.Tensor, torch.Tensor, float, str] | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotated q [T, heads, d] (contiguous); rotated k and v stored into `k_cache`/`v_cache` [slots,
    kv_heads, d] at `slots` [T]. q, k, v: [T, heads or kv_heads, d], any strides with the last dim
    contiguous (views of the fused qkv projection's output). `cos_sin`: [positions, 2, d] fp32, cos then
    rotate-half's signed sin (`gapless.model.layers.RotaryEmbedding`). `norm`: (q weight, k weight, eps,
    RMSNorm kind) of a per-head q/k norm applied first, or None. An fp8 (e4m3 or e5m2) cache comes with its
    `k_scale`/`v_scale` ([1] fp32 device tensors): it stores x / scale, saturated, as `KVPool.store`."""
    tokens, heads, d = q.shape
    out = torch.empty((tokens, heads, d), dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    kv_fp8 = _KV_FP8.get(k_cache.dtype, 0)
    if kv_fp8 and (k_scale is None or v_scale is None):
        raise ValueError("an fp8 KV cache needs its k_scale and v_scale")
    q_w, k_w, eps, kind = norm if norm is not None else (cos_sin, cos_sin, 0.0, "llama")
    _qk_norm_rope_store_kernel[(tokens, heads + k.shape[1])](
        q,
        k,
        v,
        positions,
        cos_sin,
        q_w,
        k_w,
        out,
        k_cache,
        v_cache,
        slots,
        k_scale if k_scale is not None else cos_sin,  # (not read without KV_FP8)
        v_scale if v_scale is not None else cos_sin,
        *q.stride()[:2],
        *out.stride()[:2],
        *k.stride()[:2],
        *k_cache.stride()[:2],
        *v.stride()[:2],
        *v_cache.stride()[:2],
        cos_sin.stride(0),
        heads,
        d,
        eps,
        NORM=norm is not None,
        KV_FP8=kv_fp8,
        KIND=NORM_KINDS[kind],
        BLOCK_D=triton.next_power_of_2(d),
        **pdl.launch_args(q.device),
    )
    return out


@triton.jit
def _act_and_mul_kernel(
    X,
    Out,
    Q,
    S,
    Order,
    P,
    n,
    stride_x,
    stride_o,
    ACT: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
    ORDERED: tl.constexpr,
    PDL: tl.constexpr,
):
    """One block of one row: act(gate) * up (`act_mul`), with gate = x[:n] and up = x[n:]. With GROUP
    (which divides BLOCK), the block also rounded to e4m3 for an FP8 layer (`_store_rounded`); with
    ORDERED, the block of P [rows, n] whose column i is the output's column Order[i] also written, from
    gate and up gathered in that order (the same bits)."""
    row = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * BLOCK
    offs = first + tl.arange(0, BLOCK)
    mask = offs < n
    src = offs  # (the output's columns in `Order`, where ORDERED)
    if ORDERED:
        src = tl.load(Order + offs, mask=mask, other=0)  # (a weight's order: before the wait)
    pdl.wait_for_previous(PDL)
    gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(X + row * stride_x + n + offs, mask=mask, other=0.0)
    if ORDERED:
        gate_src = tl.load(X + row * stride_x + src, mask=mask, other=0.0)
        up_src = tl.load(X + row * stride_x + n + src, mask=mask, other=0.0)
        tl.store(P + row * n + offs, act_mul(gate_src, up_src, ACT).to(P.dtype.element_ty), mask=mask)
    out = act_mul(gate, up, ACT)
    tl.store(Out + row * stride_o + offs, out.to(Out.dtype.element_ty), mask=mask)
    if GROUP:
        _store_rounded(out, row, first, n, Q, S, BLOCK, GROUP)  # (columns past n: 0, as loaded)


def act_and_mul(
    x: torch.Tensor, act: str, round_group: int = 0, order: torch.Tensor | None = None
) -> torch.Tensor:
    """act(gate) * up for x = [gate, up] along the last dim ([T, 2n] -> [T, n]); `act` a key of
    `ACTIVATIONS`. `round_group`, `order`: as `rms_norm` takes them."""
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n)
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    rounded, ordered = _rounding(x2.shape[0], n, round_group, x.device), _ordering(out, order)
    if x2.shape[0] and n:
        block = max(min(_ACT_BLOCK, triton.next_power_of_2(n)), round_group)
        _act_and_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](
            x2,
            out,
            *(rounded[:2] if rounded is not None else (out, out)),  # (unwritten without GROUP)
            *(ordered[::-1] if ordered is not None else (out, out)),  # (Order, P; unread without ORDERED)
            n,
            x2.stride(0),
            out.stride(0),
            ACT=ACTIVATIONS[act],
            BLOCK=block,
            GROUP=round_group,
            ORDERED=ordered is not None,
            **pdl.launch_args(x.device),
        )
    return _carrying(out.view(*x.shape[:-1], n), rounded, ordered)
