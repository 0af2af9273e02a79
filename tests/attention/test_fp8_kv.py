"""An fp8 KV cache (e4m3, and e5m2) read by the Triton kernels: decode, extend and verify-shaped extend
batches over the same fp8 cache as the torch reference, pages of 1 and 16 slots, with the per-tensor scales
applied (k folded into the scores, v into the output). Under Triton's interpreter without CUDA."""

from __future__ import annotations

import pytest
import torch

from gapless.attention import TorchRefBackend  # noqa: E402
from gapless.attention.triton_backend import TritonBackend  # noqa: E402
from gapless.attention.triton_kernels import DecodeTuning  # noqa: E402
from gapless.memory.kv_pool import E5M2, E5M2_MAX, FP8, FP8_MAX, quantize_fp8  # noqa: E402
from tests.attention.test_triton import DECODE, DEVICE, EXTEND, make_batch

# a verify batch: each request's K+1 = 4 positions after its accepted prefix, run by the extend kernel
VERIFY = dict(prefix_lens=[7, 40, 129], extend_lens=[4, 4, 4])
LENS = {"extend": EXTEND, "decode": DECODE, "verify": VERIFY}
K_SCALE, V_SCALE = 2.0**-5, 0.011  # randn / scale well inside e4m3's range; one not a power of two
_CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (the float32 cases check the same)"
)


def fp8_batch(seed, mode, page_size, dtype, d=32, garbage=True, kv=FP8):
    """`make_batch`'s batch with its caches stored as the KV pool stores them (`kv`, e4m3 or e5m2, of
    x / scale); the scales as `forward` takes them, and the clean caches (unused slots zero) in fp8 too."""
    q, k, v, meta, clean = make_batch(
        seed, heads=4, kv_heads=2, d=d, page_size=page_size, dtype=dtype, garbage=garbage, **LENS[mode]
    )
    ks, vs = torch.tensor([K_SCALE], device=DEVICE), torch.tensor([V_SCALE], device=DEVICE)
    k8, v8 = quantize_fp8(k, ks, kv), quantize_fp8(v, vs, kv)
    clean8 = (quantize_fp8(clean[0], ks, kv), quantize_fp8(clean[1], vs, kv))
    return q, k8, v8, meta, clean8, {"k_scale": ks, "v_scale": vs}


def torch_ref(q, caches, meta, scale, scales, **layer):
    ref = TorchRefBackend()
    return ref.forward(q, caches[0], caches[1], ref.prepare(meta), scale, **layer, **scales)


@pytest.mark.parametrize("kv", [FP8, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("mode", ["extend", "decode", "verify"])
def test_kernels_over_fp8_cache_match_reference(mode, page_size, dtype, kv):
    """Each kernel over an fp8 cache equals the torch reference over the same cache (NaN in every slot
    outside the contexts stays unread); the decode merges 3 splits, each scaled by v before merging."""
    q, k8, v8, meta, clean8, scales = fp8_batch(3, mode, page_size, dtype, kv=kv)
    backend = TritonBackend(num_splits=3)
    out = backend.forward(q, k8, v8, backend.prepare(meta), 0.3, **scales)
    want = torch_ref(q.float(), clean8, meta, 0.3, scales)
    assert out.dtype == dtype and out.shape == want.shape and torch.isfinite(out).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    err = float((out.float() - want).abs().max() / want.abs().max())
    assert err < tol, f"{mode}: relative error {err:.3g}"
    # the scales matter: read as if 1.0, the answer is another
    ones = {n: torch.ones_like(s) for n, s in scales.items()}
    assert (backend.forward(q, k8, v8, backend.prepare(meta), 0.3, **ones).float() - want).abs().max() > 0.1


@pytest.mark.parametrize("mode", ["extend", "decode"])
def test_fp8_cache_with_window_and_softcap(mode):
    """The k scale folded into a soft-capped layer's scores, and a sliding window, as the reference."""
    q, k8, v8, meta, clean8, scales = fp8_batch(5, mode, 16, torch.float32)
    layer = {"window": 24, "softcap": 2.0}
    backend = TritonBackend(num_splits=2)
    out = backend.forward(q, k8, v8, backend.prepare(meta), 0.5, **layer, **scales)
    torch.testing.assert_close(out, torch_ref(q, clean8, meta, 0.5, scales, **layer), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "tuning",
    [
        DecodeTuning(block_n=16, whole_blocks=True),
        DecodeTuning(block_n=16, values_in_pairs=True),
        DecodeTuning(whole_blocks=True, values_in_pairs=True),
        DecodeTuning(block_n=16, values_in_pairs=True, prefetch=True),
        DecodeTuning(block_n=16, values_in_pairs=True, num_stages=5),
    ],
    ids=["whole-blocks", "pairs", "both", "prefetch-pairs", "staged-pairs"],
)
@pytest.mark.parametrize("layer", [{}, {"window": 24, "softcap": 2.0}], ids=["plain", "window-softcap"])
@pytest.mark.parametrize(
    ("d", "dtype", "kv"),
    [
        (32, torch.float32, FP8),
        (24, torch.float32, FP8),
        pytest.param(32, torch.float32, E5M2, id="32-e5m2"),  # (e5m2's pairs by shifts)
        pytest.param(24, torch.bfloat16, E5M2, id="24-bf16-e5m2"),
        pytest.param(32, torch.bfloat16, FP8, marks=_CUDA, id="32-bf16"),  # (PTX pairs, fp16 queries)
    ],
)
def test_decode_kernel_tunings_over_fp8_cache(tuning, layer, d, dtype, kv):
    """`DecodeTuning.whole_blocks` (whole key blocks without masks, the partial one after),
    `values_in_pairs` (the values read as 16-bit pairs, widened a pair at once: under the interpreter by
    Triton's conversions, on sm_89+ by PTX's), `prefetch` (each block's keys and values loaded a block
    ahead) and 5 stages (Triton's copies a block ahead, on a GPU) over an fp8 cache, at a head dim the
    block covers and one it pads, over e4m3 and e5m2: the reference's answer, in one split or three, NaN
    outside the contexts unread."""
    q, k8, v8, meta, clean8, scales = fp8_batch(9, "decode", 16, dtype, d=d, kv=kv)
    want = torch_ref(q.float(), clean8, meta, 0.5, scales, **layer)
    for splits in (1, 3):
        backend = TritonBackend(num_splits=splits, decode_tuning=tuning)
        out = backend.forward(q, k8, v8, backend.prepare(meta), 0.5, **layer, **scales)
        err = float((out.float() - want).abs().max() / want.abs().max())
        assert err < (1e-5 if dtype == torch.float32 else 2e-2), (splits, err)


def test_reference_dequantizes_as_scale_times_fp8():
    """The torch reference over an fp8 cache is attention over `fp8 * scale` in q's dtype."""
    q, k8, v8, meta, clean8, scales = fp8_batch(7, "extend", 1, torch.float32, garbage=False)
    deq = (clean8[0].float() * K_SCALE, clean8[1].float() * V_SCALE)
    torch.testing.assert_close(torch_ref(q, clean8, meta, 0.3, scales), torch_ref(q, deq, meta, 0.3, {}))
    # within e4m3's rounding of the original: half a step, 2^-4 of the value (subnormals: 2^-10 * scale)
    x = make_batch(7, heads=4, kv_heads=2, d=32, page_size=1, **EXTEND)[4][0]
    assert ((deq[0] - x).abs() <= x.abs() / 16 + K_SCALE * 2**-10).all()


def test_fp8_cache_without_scales_is_refused():
    q, k8, v8, meta, _, _ = fp8_batch(1, "decode", 16, torch.bfloat16)
    backend = TritonBackend()
    with pytest.raises(ValueError, match="needs its k_scale and v_scale"):
        backend.forward(q, k8, v8, backend.prepare(meta), 0.3)
    ref = TorchRefBackend()
    with pytest.raises(ValueError, match="needs its k_scale and v_scale"):
        ref.forward(q, k8, v8, ref.prepare(meta), 0.3)


def test_quantize_saturates_and_rounds_to_nearest_even():
    x = torch.tensor([1e6, -1e6, 448.0, 1.0625, 1.1875, 0.0])  # 1.0625: a tie between 1.0 and 1.125
    got = quantize_fp8(x, torch.tensor([1.0])).float()
    assert got.tolist() == [FP8_MAX, -FP8_MAX, 448.0, 1.0, 1.25, 0.0]
    assert quantize_fp8(x, torch.tensor([4.0])).dtype == FP8
    # e5m2: two mantissa bits (1.125 a tie between 1.0 and 1.25), saturated at 57344, not 448
    y = torch.tensor([1e6, -1e6, 500.0, 1.125, 1.375, 2.0**-17])  # 2^-17: half e5m2's least subnormal
    got = quantize_fp8(y, torch.tensor([1.0]), E5M2)
    assert got.dtype == E5M2 and got.float().tolist() == [E5M2_MAX, -E5M2_MAX, 512.0, 1.0, 1.5, 0.0]


@pytest.mark.parametrize("kv", [FP8, E5M2], ids=["e4m3", "e5m2"])
def test_start_up_self_check_runs_an_fp8_probe(kv):
    """`attention_backend="auto"`'s self-check with the model's fp8 cache: the kernels pass; a backend
    that reads the cache without its v scale is caught."""
    from gapless.attention.selfcheck import Probe, disagreement

    probe = Probe(4, 2, 32, torch.bfloat16, kv_dtype=kv)
    assert probe.kv_scales(DEVICE)["k_scale"].device.type == DEVICE.type
    assert disagreement(TritonBackend(), probe, DEVICE) is None
    assert disagreement(TorchRefBackend(), probe, DEVICE) is None

    class NoVScale(TritonBackend):
        def forward(self, *args, v_scale=None, **kw):
            return super().forward(*args, v_scale=torch.ones_like(v_scale), **kw)

    why = disagreement(NoVScale(), probe, DEVICE)
    assert why is not None and "relative error" in why, why


def test_a_bfloat16_query_past_float16s_range_stays_finite():
    """Over an fp8 cache a bfloat16 query runs the dots in float16 (`clamped_fp16`): a component past
    float16's range is clamped to it, not turned to inf (and the scores' NaN); the softmax it peaks is the
    reference's."""
    q, k8, v8, meta, clean8, scales = fp8_batch(3, "decode", 16, torch.bfloat16)
    q[:, 0, 0] = torch.where(q[:, 0, 0] >= 0, 1e5, -1e5).to(q.dtype)
    backend = TritonBackend(num_splits=3)
    out = backend.forward(q, k8, v8, backend.prepare(meta), 0.3, **scales)
    want = torch_ref(q.float(), clean8, meta, 0.3, scales)
    assert torch.isfinite(out).all()
    assert float((out.float() - want).abs().max() / want.abs().max()) < 2e-2


@pytest.mark.slow  # (a compile over a cold Triton cache: ~10 s)
def test_fp8_keys_widen_to_float16_in_the_compiled_kernel():
    """Compiled for sm_90 (the harness's stand-in driver, in a child process without the interpreter): the
    decode kernel over an fp8 cache under a bfloat16 query widens e4m3 with the pairwise hardware
    conversion and never goes on to bfloat16 (three more instructions a pair on sm_90)."""
    from gapless.testing.triton_compile import compile_child

    script = (
        "import torch\n"
        "from gapless.attention import selfcheck\n"
        "from gapless.attention.triton_backend import TritonBackend\n"
        "from gapless.testing.triton_compile import Compiler\n"
        "backend = type('C', (TritonBackend,), {'interpreted': True})(num_splits=1)\n"
        "probe = selfcheck.Probe(8, 2, 128, torch.bfloat16, kv_dtype=torch.float8_e4m3fn)\n"
        "cpu = torch.device('cpu')\n"
        "with Compiler(90) as c, torch.inference_mode():\n"
        "    q, k, v, meta = selfcheck.batch(probe, *selfcheck.CASES['decode'], cpu, 0, ())\n"
        "    backend.forward(q, k, v, backend.prepare(meta), 0.1, **probe.layer(), **probe.kv_scales(cpu))\n"
        "ptx = [kern.asm['ptx'] for name, kern in c.compiled if 'decode' in name]\n"
        "count = lambda op: sum(op in p for p in ptx)\n"
        "print(len(ptx), count('cvt.rn.f16x2.e4m3x2'), count('cvt.bf16.f16'))\n"
    )
    out = compile_child(script, "compiling the fp8 decode kernel")
    if out is None:
        pytest.skip("this Triton has no NVIDIA backend to compile with")
    kernels, widened, through_bf16 = map(int, out.split()[-3:])
    assert kernels >= 1 and widened == kernels and through_bf16 == 0, out


@pytest.mark.slow  # (~40 s of compiles over a cold Triton cache)
def test_an_e5m2_cache_compiles_for_sm80_where_e4m3_cannot():
    """Compiled for sm_80 (an A100, whose Triton has no e4m3; the harness's stand-in driver in a child
    process): every attention probe over an e5m2 cache (extend, decode split and whole, the sweep's
    tunings) and the fused store into one compile; the decode kernel over e4m3 does not, which is why
    `--kv-cache-dtype fp8` asks for sm_89 and fp8_e5m2 does not."""
    from gapless.testing.triton_compile import compile_child

    script = (
        "import torch\n"
        "from gapless.model import fused\n"
        "from gapless.model.fused import triton_kernels\n"
        "from gapless.model.loader import load_model\n"
        "from gapless.testing.checkpoints import cached_checkpoint\n"
        "from gapless.testing.triton_compile import Compiler\n"
        "from gapless.testing.triton_cases import attention_cases\n"
        "cpu = torch.device('cpu')\n"
        "model = load_model(cached_checkpoint('qwen3'), torch.bfloat16, cpu)\n"
        "fused.set_fused(model, triton_kernels)\n"
        "with Compiler(80) as c, torch.inference_mode():\n"
        "    for name, case in attention_cases().items():\n"
        "        if 'float8_e5m2' in name:\n"
        "            case()\n"
        "    fused._probes(model, cpu, torch.float8_e5m2)['qk_norm_rope_store']()\n"
        "    print(sorted({n for n, _ in c.compiled}), len(c.failed))\n"
        "    try:\n"
        "        next(case for name, case in attention_cases().items() if 'float8_e4m3fn' in name)()\n"
        "    except Exception as e:\n"
        "        print('e4m3:', 'fp8e4nv not supported' in repr(e.__cause__ or e))\n"
    )
    out = compile_child(script, "compiling the e5m2 kernels for sm_80")
    if out is None:
        pytest.skip("this Triton has no NVIDIA backend to compile with")
    built, e4m3 = out.strip().splitlines()[-2:]
    assert built == "['_decode_split_kernel', '_extend_kernel', '_qk_norm_rope_store_kernel'] 0", out
    assert e4m3 == "e4m3: True", out
