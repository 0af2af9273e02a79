"""The Triton backend against the torch reference, and `make_backend`.

Without CUDA the kernels run under Triton's interpreter on CPU tensors. The interpreter is chosen when
`@triton.jit` runs, so TRITON_INTERPRET is set here, before the kernels module is first imported.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (or does not import here)")

from gapless.attention import TorchRefBackend, make_backend  # noqa: E402
from gapless.attention import triton_kernels as tk  # noqa: E402
from gapless.attention.base import AttentionMetadata  # noqa: E402
from gapless.attention.triton_backend import TritonBackend  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and not tk.INTERPRET:
    pytest.skip(
        "triton_kernels was imported before TRITON_INTERPRET was set, so it cannot run on CPU",
        allow_module_level=True,
    )

NUM_ROWS = 8


def make_batch(
    seed: int,
    *,
    heads: int,
    kv_heads: int,
    d: int,
    prefix_lens: list[int],
    extend_lens: list[int],
    page_size: int,
    dtype: torch.dtype = torch.float32,
    garbage: bool = False,
):
    """A random batch with K/V laid out in pages of `page_size` slots, scattered over the pool.

    Returns (q, k_cache, v_cache, meta, clean): `clean` is (k, v) with every slot outside the batch's
    contexts zeroed, for the reference; with `garbage`, the caches given to the kernels hold NaN there
    (slot 0 too, which masked table loads fall back to), and the table entries past each context point at
    such slots."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    max_ctx = max(seq_lens) + 2 * page_size
    pages_per_req = [-(-s // page_size) for s in seq_lens]
    num_pages = sum(pages_per_req) + 8  # spare pages, left unused
    k = torch.randn(num_pages * page_size, kv_heads, d, generator=g).to(dtype)
    v = torch.randn(num_pages * page_size, kv_heads, d, generator=g).to(dtype)
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()  # page 0: padding, never a context
    rows = torch.randperm(NUM_ROWS, generator=g)[: len(seq_lens)]
    table = torch.zeros(NUM_ROWS, max_ctx, dtype=torch.int32)
    used = torch.zeros(num_pages * page_size, dtype=torch.bool)
    for row, s, n_pages in zip(rows.tolist(), seq_lens, pages_per_req):
        pages = torch.tensor([perm.pop() for _ in range(n_pages)])
        slots = (pages[:, None] * page_size + torch.arange(page_size)[None, :]).reshape(-1)[:s]
        table[row, :s] = slots.int()
        used[slots] = True
    clean_k, clean_v = k.masked_fill(~used[:, None, None], 0), v.masked_fill(~used[:, None, None], 0)
    if garbage:
        k = k.masked_fill(~used[:, None, None], float("nan"))
        v = v.masked_fill(~used[:, None, None], float("nan"))
        unused = (~used).nonzero().reshape(-1).int()
        for row, s in zip(rows.tolist(), seq_lens):
            table[row, s:] = unused[torch.randint(len(unused), (max_ctx - s,), generator=g)]
    else:
        k, v = clean_k, clean_v
    ext = torch.tensor(extend_lens)
    q = torch.randn(int(ext.sum()), heads, d, generator=g).to(dtype)
    meta = AttentionMetadata(
        rows=rows.to(DEVICE),
        prefix_lens=torch.tensor(prefix_lens, device=DEVICE),
        extend_lens=ext.to(DEVICE),
        q_start=(torch.cumsum(ext, 0) - ext).to(DEVICE),
        req_table=table.to(DEVICE),
        max_extend_len=max(extend_lens),
        max_seq_len=max(seq_lens),
        is_decode=all(e == 1 for e in extend_lens),
    )
    dev = (q.to(DEVICE), k.to(DEVICE), v.to(DEVICE))
    return (*dev, meta, (clean_k.to(DEVICE), clean_v.to(DEVICE)))


def reference(q, clean, meta, scale, **layer):
    ref = TorchRefBackend()
    return ref.forward(q.float(), clean[0].float(), clean[1].float(), ref.prepare(meta), scale, **layer)


def check(out, ref, dtype):
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.isfinite(out).all(), "non-finite values in the attention output"
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    else:
        err = (out.float() - ref).abs().max() / ref.abs().max()
        assert err < 2e-2, f"relative error {err:.3g} in {dtype}"


# empty prefix (0), prefixes off any page boundary (13, 21, 100), a request longer than one query block
# (70, after a prefix) and one whose prefix spans two key blocks (100)
EXTEND = dict(prefix_lens=[0, 13, 21, 100], extend_lens=[9, 1, 70, 20])
# a context of one token (0 + 1), and ones long enough for several splits with a short last split
DECODE = dict(prefix_lens=[0, 5, 300, 130], extend_lens=[1, 1, 1, 1])

SHAPES = [  # heads, kv_heads, head_dim, page_size
    pytest.param(4, 2, 16, 1, id="gqa-d16-page1"),
    pytest.param(4, 2, 32, 16, id="gqa-d32-page16"),
    pytest.param(4, 1, 16, 16, id="mqa-d16-page16"),
    pytest.param(2, 2, 64, 16, id="mha-d64-page16"),
    pytest.param(4, 2, 128, 1, id="gqa-d128-page1"),
    pytest.param(2, 1, 80, 16, id="mqa-d80-page16"),  # not a power of two: padded and masked
]


@pytest.mark.parametrize(("heads", "kv_heads", "d", "page_size"), SHAPES)
def test_extend_matches_reference(heads, kv_heads, d, page_size):
    q, k, v, meta, clean = make_batch(0, heads=heads, kv_heads=kv_heads, d=d, page_size=page_size, **EXTEND)
    backend = TritonBackend()
    out = backend.forward(q, k, v, backend.prepare(meta), d**-0.5)
    check(out, reference(q, clean, meta, d**-0.5), torch.float32)


@pytest.mark.parametrize(("heads", "kv_heads", "d", "page_size"), SHAPES)
def test_decode_matches_reference(heads, kv_heads, d, page_size):
    q, k, v, meta, clean = make_batch(1, heads=heads, kv_heads=kv_heads, d=d, page_size=page_size, **DECODE)
    backend = TritonBackend(num_splits=6)  # 5 non-empty splits of 64 keys for the 301-token context, 1 empty
    out = backend.forward(q, k, v, backend.prepare(meta), d**-0.5)
    check(out, reference(q, clean, meta, d**-0.5), torch.float32)


@pytest.mark.parametrize(("window", "softcap"), [(24, None), (None, 2.0), (7, 2.0), (1, None), (10**9, None)])
@pytest.mark.parametrize("mode", ["extend", "decode"])
def test_sliding_window_and_softcap_match_reference(mode, window, softcap):
    """Gemma's window and soft-cap in both kernels. Extend: a chunk starting at 0 and ones after prefixes
    shorter and longer than the window (a prefix hit inside it, chunks across its edge, a 70-token chunk
    spanning several key blocks, so whole blocks before the window are skipped); decode: contexts shorter
    and longer than the window, over several splits of what the window leaves. A window of 1 sees only the
    token itself; one past every context is plain causal attention. NaN outside the contexts stays unread."""
    lens = EXTEND if mode == "extend" else DECODE
    q, k, v, meta, clean = make_batch(8, heads=4, kv_heads=2, d=16, page_size=16, garbage=True, **lens)
    backend = TritonBackend(num_splits=3)
    layer = {"window": window, "softcap": softcap}
    out = backend.forward(q, k, v, backend.prepare(meta), 0.5, **layer)
    check(out, reference(q, clean, meta, 0.5, **layer), torch.float32)
    if window == 10**9:
        check(out, reference(q, clean, meta, 0.5, softcap=softcap), torch.float32)
    else:  # the window or cap changes the answer, so matching the reference checks it
        plain = reference(q, clean, meta, 0.5)
        assert (out - plain).abs().max() > 1e-2


@pytest.mark.parametrize("window", [None, 100, 150, 64])
def test_extend_blocks_every_query_sees_whole_run_unmasked_and_no_others(window):
    """The extend kernel runs the key blocks every query of a query block sees whole without a mask, and
    the window's edge and the causal diagonal with one. Contexts of several key blocks (64 keys here) with
    and without a window, chunks after long prefixes and one from 0 spanning several query blocks: each
    query block has blocks of every kind, and NaN outside the contexts shows if an unmasked block read
    past one; the window changes the answer, so matching the reference checks its edge."""
    lens = dict(prefix_lens=[300, 0, 150, 64], extend_lens=[40, 200, 90, 1])
    q, k, v, meta, clean = make_batch(11, heads=4, kv_heads=2, d=16, page_size=16, garbage=True, **lens)
    backend = TritonBackend()
    out = backend.forward(q, k, v, backend.prepare(meta), 0.5, window=window)
    check(out, reference(q, clean, meta, 0.5, window=window), torch.float32)
    if window is not None:
        assert (out - reference(q, clean, meta, 0.5)).abs().max() > 1e-2


@pytest.mark.parametrize(("window", "page_size"), [(None, 16), (24, 1)])
def test_extend_query_limits_match_reference(window, page_size):
    """Queries that see past themselves up to a bound (`q_limits`: an image's tokens seeing their whole
    image, Gemma 3): spans inside a query block, across query blocks, after a prefix and at a request's
    end, with and without a window; the bounds change the answer, so matching the reference checks them."""
    lens = dict(prefix_lens=[0, 40, 7], extend_lens=[90, 30, 5])
    q, k, v, meta, clean = make_batch(5, heads=4, kv_heads=2, d=16, page_size=page_size, garbage=True, **lens)
    pos = torch.cat([torch.arange(p, p + e) for p, e in zip(lens["prefix_lens"], lens["extend_lens"])])
    limits = pos.clone()
    for start, n in [(3, 10), (20, 60), (95, 20), (121, 4)]:  # flat spans, each inside one request
        limits[start : start + n] = pos[start + n - 1]
    causal = reference(q, clean, meta, 0.5, window=window)
    meta.q_limits = limits.to(DEVICE)
    backend = TritonBackend()
    out = backend.forward(q, k, v, backend.prepare(meta), 0.5, window=window)
    want = reference(q, clean, meta, 0.5, window=window)
    check(out, want, torch.float32)
    outside = limits == pos  # tokens with no bound past themselves attend as before
    torch.testing.assert_close(want[outside.to(DEVICE)], causal[outside.to(DEVICE)])
    assert (want - causal).abs().amax(dim=(1, 2))[~outside.to(DEVICE)].min() > 1e-3


@pytest.mark.parametrize("num_splits", [None, 1, tk.MAX_SPLITS])
def test_decode_split_counts(num_splits):
    """Any split count gives the same answer; the default picks several for a long context."""
    q, k, v, meta, clean = make_batch(2, heads=4, kv_heads=1, d=32, page_size=16, **DECODE)
    backend = TritonBackend(num_splits=num_splits)
    state = backend.prepare(meta)
    out = backend.forward(q, k, v, state, 0.2)
    check(out, reference(q, clean, meta, 0.2), torch.float32)
    ((splits, *_),) = state.scratch.values()
    assert splits == (num_splits or tk.decode_num_splits(4, 1, 301, backend._num_sms(DEVICE)))
    if num_splits is None:
        assert splits > 1


# the decode kernel's knobs (`DecodeTuning`), page sizes 1 and 16: key blocks of 16 to 128 (more than the
# 6- and 1-key contexts, several for the 301-key one), warps/stages (5: two buffers) and the register cap
# (GPU-only knobs: still checked to launch), a split heuristic pushed to many short splits, whole blocks,
# and prefetch
TUNINGS = [
    pytest.param(tk.DecodeTuning(block_n=16, num_warps=2, num_stages=1), 1, torch.float32, id="n16-page1"),
    pytest.param(tk.DecodeTuning(block_n=32, num_warps=8, num_stages=3), 16, torch.float32, id="n32-page16"),
    pytest.param(tk.DecodeTuning(block_n=128), 16, torch.bfloat16, id="n128-page16-bf16"),
    pytest.param(
        tk.DecodeTuning(programs_per_sm=16, min_split_len=16), 1, torch.float16, id="splits-page1-fp16"
    ),
    pytest.param(
        tk.DecodeTuning(programs_per_sm=16, min_split_len=16, heads_first=True),
        16,
        torch.bfloat16,
        id="heads-first-splits-page16-bf16",
    ),
    pytest.param(tk.DecodeTuning(block_n=16, whole_blocks=True), 16, torch.float32, id="whole-blocks-page16"),
    pytest.param(
        tk.DecodeTuning(programs_per_sm=16, min_split_len=16, whole_blocks=True),
        1,
        torch.bfloat16,
        id="whole-blocks-splits-page1-bf16",
    ),
    pytest.param(tk.DecodeTuning(block_n=16, prefetch=True), 16, torch.float32, id="prefetch-page16"),
    pytest.param(tk.DecodeTuning(max_registers=96), 1, torch.bfloat16, id="capped-page1-bf16"),
    pytest.param(tk.DecodeTuning(num_stages=5), 16, torch.bfloat16, id="staged-page16-bf16"),
    pytest.param(
        tk.DecodeTuning(programs_per_sm=16, min_split_len=16, prefetch=True),
        1,
        torch.bfloat16,
        id="prefetch-splits-page1-bf16",
    ),
]


@pytest.mark.parametrize(("tuning", "page_size", "dtype"), TUNINGS)
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 1), (6, 2)], ids=["group8", "group3"])
def test_decode_tunings_match_reference(tuning, page_size, dtype, heads, kv_heads):
    """Every tuning computes the same attention: a whole GQA group (8, or 3 padded to 16 rows) in one
    program per kv head, NaN outside the contexts never read."""
    q, k, v, meta, clean = make_batch(
        5, heads=heads, kv_heads=kv_heads, d=24, page_size=page_size, dtype=dtype, garbage=True, **DECODE
    )
    backend = TritonBackend(decode_tuning=tuning)
    state = backend.prepare(meta)
    out = backend.forward(q, k, v, state, 24**-0.5)
    check(out, reference(q, clean, meta, 24**-0.5), dtype)
    ((splits, *_),) = state.scratch.values()
    assert splits == tk.decode_num_splits(4, kv_heads, 301, backend._num_sms(DEVICE), tuning)


def test_decode_whole_blocks_at_contexts_of_whole_blocks():
    """`whole_blocks` where every context is a multiple of the key block (no partial block after the
    unmasked loop) and where none is: the reference's answer, split or not."""
    for prefix_lens in ([31, 63, 15], [2, 40, 17]):
        q, k, v, meta, clean = make_batch(
            11,
            heads=4,
            kv_heads=2,
            d=32,
            page_size=16,
            garbage=True,
            prefix_lens=prefix_lens,
            extend_lens=[1] * 3,
        )
        want = reference(q, clean, meta, 32**-0.5)
        for splits in (1, 2):
            backend = TritonBackend(
                num_splits=splits, decode_tuning=tk.DecodeTuning(block_n=16, whole_blocks=True)
            )
            check(backend.forward(q, k, v, backend.prepare(meta), 32**-0.5), want, torch.float32)


def test_decode_tuning_is_checked():
    with pytest.raises(ValueError, match="block_n=24: must be a power of two >= 16"):
        tk.DecodeTuning(block_n=24)
    with pytest.raises(ValueError, match="prefetch and whole_blocks: one or the other"):
        tk.DecodeTuning(prefetch=True, whole_blocks=True)
    with pytest.raises(ValueError, match=r"max_registers=300: must be in \[24, 255\]"):
        tk.DecodeTuning(max_registers=300)
    with pytest.raises(ValueError, match="num_warps=0: must be >= 1"):
        tk.DecodeTuning(num_warps=0)
    assert tk.DecodeTuning().keys_per_block(128) == 64 and tk.DecodeTuning().keys_per_block(256) == 32
    # an fp8 cache's values in pairs by default where the blocks are 64 keys or more (where an H200 timed it
    # faster), as set otherwise
    assert tk.DecodeTuning().pairs(128) and not tk.DecodeTuning().pairs(256)
    assert not tk.DecodeTuning(block_n=32).pairs(128) and tk.DecodeTuning(block_n=128).pairs(256)
    assert tk.DecodeTuning(block_n=32, values_in_pairs=True).pairs(128)
    assert not tk.DecodeTuning(values_in_pairs=False).pairs(128)
    # the split heuristic follows the occupancy target: 4 programs per SM of 132 over 1 x 8 programs
    assert tk.decode_num_splits(1, 8, 32768, 132, tk.DecodeTuning(programs_per_sm=4)) == 64
    assert tk.decode_num_splits(1, 8, 32768, 132, tk.DecodeTuning(programs_per_sm=1)) == 17
    assert tk.decode_num_splits(1, 8, 1000, 132, tk.DecodeTuning(min_split_len=500)) == 2


@pytest.mark.parametrize(
    ("tuning", "dtype"),
    [
        pytest.param(
            tk.ExtendTuning(block_m=16, block_n=16, num_warps=2, num_stages=1), torch.float32, id="m16n16"
        ),
        pytest.param(
            tk.ExtendTuning(block_m=128, block_n=32, num_warps=8, num_stages=3), torch.float32, id="m128n32"
        ),
        pytest.param(tk.ExtendTuning(block_m=32, block_n=128), torch.bfloat16, id="m32n128-bf16"),
    ],
)
@pytest.mark.parametrize("window", [None, 40])
def test_extend_tunings_match_reference(tuning, dtype, window):
    """Every extend tuning computes the same attention, a window's edge and the diagonal included: query
    blocks smaller and larger than the chunks, key blocks smaller and larger than the prefixes."""
    lens = dict(prefix_lens=[0, 13, 150], extend_lens=[70, 1, 90])
    q, k, v, meta, clean = make_batch(
        5, heads=4, kv_heads=2, d=32, page_size=16, dtype=dtype, garbage=True, **lens
    )
    backend = TritonBackend(extend_tuning=tuning)
    out = backend.forward(q, k, v, backend.prepare(meta), 0.3, window=window)
    check(out, reference(q, clean, meta, 0.3, window=window), dtype)


def test_extend_tuning_is_checked():
    with pytest.raises(ValueError, match="extend block_m=48: must be a power of two >= 16"):
        tk.ExtendTuning(block_m=48)
    with pytest.raises(ValueError, match="extend num_stages=0: must be >= 1"):
        tk.ExtendTuning(num_stages=0)
    assert tk.ExtendTuning().blocks(128, 2) == (64, 64) and tk.ExtendTuning().blocks(128, 4) == (64, 32)
    assert tk.ExtendTuning().blocks(256, 2) == (32, 32) and tk.ExtendTuning(block_n=128).blocks(64, 4) == (
        64,
        128,
    )


def test_decode_scratch_is_reused_across_layers():
    """A second layer with other caches reuses the first's split buffers and still gets its own answer."""
    q, k, v, meta, clean = make_batch(3, heads=4, kv_heads=2, d=16, page_size=1, **DECODE)
    backend = TritonBackend(num_splits=4)
    state = backend.prepare(meta)
    out1 = backend.forward(q, k, v, state, 0.25)
    out2 = backend.forward(q, -2 * k, v.flip(-1), state, 0.25)
    assert len(state.scratch) == 1
    # the last split of each (request, kv head) set its arrival counter back to zero for the next layer
    ((*_, arrivals),) = state.scratch.values()
    assert arrivals.shape == (4 * 2,) and not arrivals.any()
    check(out1, reference(q, clean, meta, 0.25), torch.float32)
    check(out2, reference(q, (-2 * clean[0], clean[1].flip(-1)), meta, 0.25), torch.float32)
    assert not torch.allclose(out1, out2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["extend", "decode"])
def test_half_precision(dtype, mode):
    lens = EXTEND if mode == "extend" else DECODE
    q, k, v, meta, clean = make_batch(4, heads=4, kv_heads=2, d=32, page_size=16, dtype=dtype, **lens)
    backend = TritonBackend(num_splits=5)
    out = backend.forward(q, k, v, backend.prepare(meta), 32**-0.5)
    check(out, reference(q, clean, meta, 32**-0.5), dtype)


@pytest.mark.parametrize(
    ("mode", "dtype"), [("extend", torch.float32), ("decode", torch.float32), ("extend", torch.float16)]
)
def test_garbage_outside_contexts_is_never_read(mode, dtype):
    """Unused slots hold NaN and the table's tail points at them; masked loads must skip them (a NaN value
    row read under a zero weight would still make the output NaN)."""
    lens = EXTEND if mode == "extend" else DECODE
    q, k, v, meta, clean = make_batch(
        5, heads=4, kv_heads=2, d=16, page_size=16, dtype=dtype, garbage=True, **lens
    )
    assert k.isnan().any() and v.isnan().any()
    backend = TritonBackend(num_splits=4)
    out = backend.forward(q, k, v, backend.prepare(meta), 0.25)
    check(out, reference(q, clean, meta, 0.25), dtype)


def test_poison_inside_a_context_does_show():
    """The garbage test could fail: a NaN in a slot a request does read reaches that request's output."""
    q, k, v, meta, _ = make_batch(6, heads=2, kv_heads=1, d=16, page_size=16, **DECODE)
    b = 2  # the 301-token request: poison a key in the middle of its context
    k[meta.req_table[meta.rows[b], 150].long()] = float("nan")
    backend = TritonBackend(num_splits=4)
    out = backend.forward(q, k, v, backend.prepare(meta), 0.25)
    assert out[b].isnan().all()
    others = [i for i in range(4) if i != b]
    assert torch.isfinite(out[others]).all()


def test_empty_batch():
    q, k, v, meta, _ = make_batch(7, heads=2, kv_heads=1, d=16, page_size=1, prefix_lens=[3], extend_lens=[2])
    for name in ("rows", "prefix_lens", "extend_lens", "q_start"):
        setattr(meta, name, getattr(meta, name)[:0])
    meta.max_extend_len = meta.max_seq_len = 0
    backend = TritonBackend()
    for meta.is_decode in (False, True):
        assert backend.forward(q[:0], k, v, backend.prepare(meta), 0.25).shape == (0, 2, 16)


def test_decode_num_splits():
    long_small = tk.decode_num_splits(batch=1, kv_heads=8, max_seq_len=32768, num_sms=132)
    assert 1 < long_small <= tk.MAX_SPLITS and long_small * 8 >= 132  # every SM gets a program
    assert tk.decode_num_splits(batch=256, kv_heads=8, max_seq_len=32768, num_sms=132) == 1  # grid is full
    assert tk.decode_num_splits(batch=1, kv_heads=1, max_seq_len=60, num_sms=132) == 1  # too short to split
    assert tk.decode_num_splits(batch=1, kv_heads=1, max_seq_len=10**6, num_sms=132) == tk.MAX_SPLITS


def test_decode_num_splits_fill_the_gpu_for_few_requests():
    """A lone request's context is spread over enough programs for every SM of an H100/H200, in splits of
    at least one 64-key block: 16 x 8 kv heads = 128 programs at 1k, 33 x 8 at 4k (2 per SM)."""
    assert tk.decode_num_splits(1, 8, 1024, 132) == 16
    assert tk.decode_num_splits(1, 8, 4096, 132) == 33
    assert tk.decode_num_splits(8, 8, 4096, 132) == 5
    assert tk.decode_num_splits(64, 8, 4096, 132) == 1


@pytest.mark.parametrize(
    ("heads", "kv_heads", "d", "page_size", "window", "softcap"),
    [
        pytest.param(8, 1, 72, 1, None, None, id="group8-d72-page1"),
        pytest.param(6, 2, 40, 16, 500, 5.0, id="group3-d40-page16-window-softcap"),
    ],
)
def test_decode_of_one_request_over_many_splits(heads, kv_heads, d, page_size, window, softcap):
    """One request, 64 splits of 16 keys: the last split merges them a tile at a time (more splits than
    one merge tile holds), with a window and soft-capping where given; a second call (the next layer)
    finds the arrival counters at zero again and gives the same answer."""
    q, k, v, meta, clean = make_batch(
        8, heads=heads, kv_heads=kv_heads, d=d, page_size=page_size, prefix_lens=[1023], extend_lens=[1]
    )
    backend = TritonBackend(num_splits=tk.MAX_SPLITS, decode_tuning=tk.DecodeTuning(block_n=16))
    state = backend.prepare(meta)
    layer = {"window": window, "softcap": softcap}
    out = backend.forward(q, k, v, state, d**-0.5, **layer)
    check(out, reference(q, clean, meta, d**-0.5, **layer), torch.float32)
    torch.testing.assert_close(backend.forward(q, k, v, state, d**-0.5, **layer), out, atol=0, rtol=0)
    ((splits, *_),) = state.scratch.values()
    assert splits == tk.MAX_SPLITS


@pytest.mark.skipif(
    DEVICE.type != "cuda", reason="races between programs need a GPU (the CPU runs them in turn)"
)
def test_cuda_merge_by_the_last_split_is_race_free():
    """On the GPU the splits run at once and any of them may arrive last: 200 launches (bf16, a group of
    8, 64 splits of 64 keys, many requests so programs of several (request, kv head) interleave) give
    the same bits every time (the merge reads the splits in their order, whoever does it), and match the
    reference; a merge that read a split before it was written would show as a difference."""
    lens = dict(prefix_lens=[4095, 3000, 4095, 17, 2500, 4095], extend_lens=[1] * 6)
    q, k, v, meta, clean = make_batch(
        10, heads=16, kv_heads=2, d=128, page_size=16, dtype=torch.bfloat16, **lens
    )
    backend = TritonBackend(num_splits=tk.MAX_SPLITS)
    state = backend.prepare(meta)
    first = backend.forward(q, k, v, state, 128**-0.5)
    check(first, reference(q, clean, meta, 128**-0.5), torch.bfloat16)
    for _ in range(200):
        assert torch.equal(backend.forward(q, k, v, state, 128**-0.5), first)
    ((*_, arrivals),) = state.scratch.values()
    assert not arrivals.any()


def test_one_split_writes_the_output_without_scratch():
    """A batch whose split count is 1 (a full GPU) runs the kernel without the merge: its scratch is a
    token buffer, never read, and the answer is the reference's."""
    q, k, v, meta, clean = make_batch(9, heads=4, kv_heads=2, d=48, page_size=16, **DECODE)
    backend = TritonBackend(num_splits=1)
    state = backend.prepare(meta)
    out = backend.forward(q, k, v, state, 0.2)
    check(out, reference(q, clean, meta, 0.2), torch.float32)
    ((splits, mid_o, mid_lse, arrivals),) = state.scratch.values()
    assert splits == 1 and mid_o.numel() == mid_lse.numel() == arrivals.numel() == 1


def test_make_backend_choices(monkeypatch):
    assert isinstance(make_backend("torch", "cpu"), TorchRefBackend)
    assert isinstance(make_backend("auto", "cpu"), TorchRefBackend)  # the interpreter is never automatic
    assert isinstance(make_backend("auto", "cuda"), TritonBackend)
    assert isinstance(make_backend("triton", DEVICE), TritonBackend)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if tk.INTERPRET:
        assert isinstance(make_backend("triton", torch.device("cpu")), TritonBackend)
    else:  # built for the GPU: the variable came too late for this process
        with pytest.raises(RuntimeError, match="imported before TRITON_INTERPRET was set"):
            make_backend("triton", "cpu")
    with pytest.raises(ValueError, match="unknown attention backend 'flash'.*auto, torch, triton"):
        make_backend("flash", "cpu")


def test_make_backend_errors(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="on CPU it needs Triton's interpreter.*TRITON_INTERPRET=1"):
        make_backend("triton", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(tk, "INTERPRET", False)  # as if the kernels had been imported before the env var
    with pytest.raises(RuntimeError, match="imported before TRITON_INTERPRET was set"):
        make_backend("triton", "cpu")
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    with pytest.raises(RuntimeError, match="needs the triton package"):
        make_backend("triton", "cuda")
    assert isinstance(make_backend("auto", "cuda"), TorchRefBackend)


def test_package_imports_without_triton():
    """Importing the attention package (and the backend module) neither needs Triton nor loads the
    kernels; "auto" then falls back to torch even on CUDA."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import gapless.attention, gapless.attention.triton_backend\n"
        "from gapless.attention import make_backend, TorchRefBackend\n"
        "assert 'gapless.attention.triton_kernels' not in sys.modules\n"
        "assert isinstance(make_backend('auto', 'cuda'), TorchRefBackend)\n"
        "try:\n    make_backend('triton', 'cuda')\nexcept RuntimeError as e:\n    print(e)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "needs the triton package" in res.stdout


# ----------------------------------------------------------------------------- the start-up self-check
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_self_check_passes_the_kernels(dtype):
    from gapless.attention import Probe, checked
    from gapless.attention.selfcheck import disagreement

    probe = Probe(heads=4, kv_heads=2, head_dim=32, dtype=dtype)
    assert disagreement(TritonBackend(), probe, DEVICE) is None
    backend = TritonBackend()
    assert checked(backend, probe, DEVICE) is backend


class _Broken(TorchRefBackend):
    """The reference, broken one way: a launch error, a NaN, or outputs 10% off."""

    def __init__(self, how: str) -> None:
        self.how = how

    def forward(self, q, k_cache, v_cache, state, scale):
        if self.how == "raises":
            raise RuntimeError("no kernel image is available for execution on the device")
        out = super().forward(q, k_cache, v_cache, state, scale).clone()
        if self.how == "nan":
            out[0, 0, 0] = float("nan")
        else:
            out *= 1.1
        return out


@pytest.mark.parametrize(
    ("how", "says"), [("raises", "failed"), ("nan", "non-finite"), ("wrong", "relative error")]
)
def test_self_check_replaces_a_backend_that_does_not_work(how, says, caplog):
    from gapless.attention import Probe, checked
    from gapless.attention.selfcheck import disagreement

    probe = Probe(heads=4, kv_heads=1, head_dim=16, dtype=torch.float32)
    broken = _Broken(how)
    assert says in disagreement(broken, probe, DEVICE)
    with caplog.at_level("WARNING"):
        chosen = checked(broken, probe, DEVICE)
    assert type(chosen) is TorchRefBackend and says in caplog.text


_DECODE_SASS = """
import re, torch
from gapless.attention import selfcheck, triton_kernels
from gapless.attention.triton_backend import TritonBackend
from gapless.testing.sass import cuobjdump, resources
from gapless.testing.triton_compile import Compiler
compile_only = type("CompileOnly", (TritonBackend,), {"interpreted": True})
tunings = {"default": {}, "prefetch": {"prefetch": True}, "capped": {"max_registers": 96},
           "staged": {"num_stages": 5}}
for kv in (None, torch.float8_e4m3fn):
    for name, knobs in tunings.items():
        backend = compile_only(num_splits=1, decode_tuning=triton_kernels.DecodeTuning(**knobs))
        probe = selfcheck.Probe(8, 2, 128, torch.bfloat16, kv_dtype=kv)
        with Compiler(90) as c, torch.inference_mode():
            q, k, v, meta = selfcheck.batch(probe, *selfcheck.CASES["decode"], torch.device("cpu"), 0, ())
            backend.forward(q, k, v, backend.prepare(meta), 0.1, **probe.layer(), **probe.kv_scales("cpu"))
        kernel = c.compiled[-1][1]
        sass = cuobjdump(kernel, "-sass")
        at = r"/\\*([0-9a-f]{4,})\\*/\\s+(?:@!?U?P\\w+\\s+)?"  # an instruction's address, a predicate
        ops = [(int(a, 16), op) for a, op in re.findall(at + r"([A-Z][A-Za-z0-9_.]*)", sass)]
        jumps = [(int(a, 16), int(t, 16)) for a, t in re.findall(at + r"BRA\\s+0x([0-9a-f]+)", sass)]
        # the key loop: the longest backward branch's body
        end, top = max(((a, t) for a, t in jumps if t < a), key=lambda r: r[0] - r[1])
        body = [op.split(".")[0] for a, op in ops if top <= a <= end]
        early = body[: body.index("HMMA")].count("LDG")
        # the most copy groups a wait in the loop leaves in flight (DEPBAR.LE SB0, n)
        waits = re.findall(at + r"DEPBAR\\.LE\\s+SB0,\\s*0x([0-9a-f]+)", sass)
        pending = max([int(n, 16) for a, n in waits if top <= int(a, 16) <= end] or [-1])
        res = resources(kernel)
        print(kv is not None, name, body.count("DEPBAR"), body.count("LDGSTS"), early, pending,
              res["registers"], res["spill_bytes"])
"""


@pytest.mark.slow  # (eight sm_90 compiles in a child process, ~80 s)
def test_decode_tunings_binaries_prefetch_stage_and_cap_registers():
    """Compiled for sm_90 (bf16 queries, head dim 128, over a bf16 and an fp8 cache): the default decode
    loop copies the next block asynchronously (LDGSTS) and waits for every copy (DEPBAR, none left in
    flight) in the loop; at 5 stages its wait leaves the next block's copies in flight; `prefetch` has
    neither, and issues its global loads of the next block (LDG) before the loop body's first matrix
    instruction, so they are in flight during the block's compute; `max_registers=96` holds each kernel
    to 96 registers a thread without spilling."""
    from gapless.testing.triton_compile import compile_child

    out = compile_child(_DECODE_SASS, "compiling the decode kernel")
    if out is None:
        pytest.skip("this Triton has no NVIDIA backend to compile with")
    got = {
        (fp8 == "True", name): [int(x) for x in rest] for fp8, name, *rest in map(str.split, out.splitlines())
    }
    assert len(got) == 8, out
    for fp8 in (False, True):
        waits, copies, _, pending, _, _ = got[fp8, "default"]
        assert waits >= 1 and copies >= 8 and pending == 0, (fp8, got)
        waits, copies, _, pending, _, _ = got[fp8, "staged"]
        assert waits >= 1 and copies >= 8 and pending >= 2, (fp8, got)  # (the keys' and values' groups)
        waits, copies, early_loads, _, _, _ = got[fp8, "prefetch"]
        assert waits == 0 and copies == 0 and early_loads >= 8, (fp8, got)
        *_, registers, spilled = got[fp8, "capped"]
        assert registers <= 96 and spilled == 0, (fp8, got)


def test_the_environment_caps_the_default_decode_registers(monkeypatch):
    """`GAPLESS_DECODE_MAX_REGISTERS`: the backend's default decode tuning takes the cap (and keeps every
    other default); a tuning given keeps its own; unset, the plain default; out of range, an error naming
    the variable."""
    monkeypatch.setenv("GAPLESS_DECODE_MAX_REGISTERS", "96")
    assert TritonBackend().decode_tuning == tk.DecodeTuning(max_registers=96)
    assert TritonBackend(decode_tuning=tk.DecodeTuning(block_n=16)).decode_tuning.max_registers is None
    monkeypatch.setenv("GAPLESS_DECODE_MAX_REGISTERS", "")
    assert TritonBackend().decode_tuning is tk.DEFAULT_DECODE
    monkeypatch.setenv("GAPLESS_DECODE_MAX_REGISTERS", "512")
    with pytest.raises(ValueError, match=r"GAPLESS_DECODE_MAX_REGISTERS='512': not in \[24, 255\]"):
        TritonBackend()


def test_the_environment_stages_the_default_decode_kernel(monkeypatch):
    """`GAPLESS_DECODE_STAGES`: the backend's default decode tuning takes the pipelining depth, beside a
    register cap; a tuning given keeps its own; out of range, an error naming the variable."""
    monkeypatch.setenv("GAPLESS_DECODE_STAGES", "5")
    assert TritonBackend().decode_tuning == tk.DecodeTuning(num_stages=5)
    monkeypatch.setenv("GAPLESS_DECODE_MAX_REGISTERS", "128")
    assert TritonBackend().decode_tuning == tk.DecodeTuning(num_stages=5, max_registers=128)
    assert TritonBackend(decode_tuning=tk.DecodeTuning(block_n=16)).decode_tuning.num_stages == 2
    monkeypatch.setenv("GAPLESS_DECODE_STAGES", "9")
    with pytest.raises(ValueError, match=r"GAPLESS_DECODE_STAGES='9': not in \[1, 8\]"):
        TritonBackend()
