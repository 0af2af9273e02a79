"""GGUF matrices on the int4/int8 weight-only path (`gapless.model.quant.gguf_int4`), as a GPU and tensor
parallelism hold them: each type's form against the file's weights, whole-model greedy tokens against
transformers reading the same file, each rank's pieces against the dequantized model's, and on CUDA the
GPU's kernels."""

from __future__ import annotations

import pytest
import torch

from gapless import LLM, SamplingParams
from gapless.model import layers, loader, parallel
from gapless.model.quant import gguf_iq, weights_held
from gapless.model.quant.gguf_blocks import AFFINE, INT4_TYPES, TERNARY, int8_rows
from gapless.model.quant.gguf_int4 import DeviceRows, spec_for, unpacked
from gapless.model.quant.int4 import Int4LinearMethod
from gapless.testing.gguf_files import random_blocks, write_gguf
from gapless.testing.hf_reference import check_greedy, hf_greedy, make_prompts
from gapless.testing.ranks import load_as_ranks
from tests.model.test_quant_gguf import MAX_NEW, NEAR_TIE, _dequantized, _k_quant_gguf


@pytest.mark.parametrize("qtype", INT4_TYPES)
def test_4_bit_types_hold_the_files_values_in_groups_of_32(qtype):
    """`(q - zero) * scale` is the file's weights (to float32's rounding of the zero), q its 4-bit values;
    groups whose scale is 0 (every weight its offset) are exact too."""
    b = random_blocks(qtype, 40, 512)
    size = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144}[qtype]
    b.data.reshape(40, -1, size)[3, 0, 0:2] = 0  # row 3's first scale an f16 0 (Q4_K's d: 8 groups)
    w = unpacked(b, spec_for([b]))
    assert w.q.dtype == torch.int16 and 0 <= int(w.q.min()) and int(w.q.max()) <= 15
    assert w.scale.shape == w.zero.shape == (40, 512 // 32)
    ref = _dequantized(b)
    torch.testing.assert_close(w.dequantize(), ref, rtol=0, atol=1e-6 * ref.abs().max().item())
    flat = ref[3, : 256 if qtype == "Q4_K" else 32]
    torch.testing.assert_close(w.dequantize()[3, : flat.numel()], flat, rtol=0, atol=0)


@pytest.mark.parametrize("qtype", sorted(set(AFFINE) - set(gguf_iq.FORMS)))  # (the i-quants: test_gguf_iq)
def test_the_other_types_hold_the_files_values_and_scales(qtype):
    """Q8_0, Q5_0/Q5_1, Q5_K, Q6_K, Q3_K, Q2_K and the ternary TQ1_0/TQ2_0: their own values in groups of
    their own scales (`AFFINE`; Q3_K's 6-bit scales unpacked from their two places, TQ1_0's trits from
    base 3), the file's weights to float32's rounding, a group whose scale is 0 exact too; on the CPU,
    whose kernels take groups of 32 and more, Q6_K, Q3_K and Q2_K as int8 rows."""
    bits, group = AFFINE[qtype]
    b = random_blocks(qtype, 24, 512)
    scale_at = {"Q8_0": 0, "Q5_0": 0, "Q5_1": 0, "Q5_K": 0, "Q6_K": 208, "Q3_K": 108, "Q2_K": 80}
    scale_at = (scale_at | TERNARY)[qtype]
    size = {"Q8_0": 34, "Q5_0": 22, "Q5_1": 24, "Q5_K": 176, "Q6_K": 210, "Q3_K": 110, "Q2_K": 84}
    size = (size | {"TQ1_0": 54, "TQ2_0": 66})[qtype]
    b.data.reshape(24, -1, size)[5, 0, scale_at : scale_at + 2] = 0  # row 5's first d an f16 0
    spec = spec_for([b])
    assert (spec.bits, spec.group_size) == (bits, group) and spec.label == f"{qtype} as int{bits} g{group}"
    w = unpacked(b, spec)
    assert int(w.q.min()) >= 0 and int(w.q.max()) < 1 << bits and w.scale.shape == (24, 512 // group)
    ref = _dequantized(b)
    torch.testing.assert_close(w.dequantize(), ref, rtol=0, atol=1e-6 * ref.abs().max().item())
    assert bool((ref[5, :32] == ref[5, 0]).all()) or qtype in ("Q6_K", "Q3_K", "Q2_K")  # (d 0: offsets alone)
    torch.testing.assert_close(w.dequantize()[5, :32], ref[5, :32], rtol=0, atol=0)
    on_cpu = spec_for([b], cpu=True)
    assert on_cpu.group_size == (-1 if group < 32 else group), on_cpu


def test_on_the_cpu_groups_of_16_are_int8_rows():
    """With tensor parallelism on the CPU, whose kernels take groups of 32 and more, a Q6_K matrix is held
    as int8 rows: 8 bits one group a row, q + 128 less the zero 128, exactly `int8_rows`' requantized
    weights."""
    b = random_blocks("Q6_K", 24, 256)
    spec = spec_for([b], cpu=True)
    assert spec.label == "Q6_K as int8 per-row"
    w = unpacked(b, spec)
    q, scale = int8_rows(b)
    assert w.scale.shape == w.zero.shape == (24, 1) and bool((w.zero == 128).all())
    torch.testing.assert_close(w.dequantize(), q.float() * scale.float()[:, None], rtol=0, atol=0)


def test_a_projection_takes_its_parts_widest_bits_and_narrowest_groups():
    """A q/k/v of Q4_K q and k and a Q6_K v: 8 bits in groups of 16, every part its own values (Q4_K's
    group scales repeated over two groups); with a Q3_K part, 4 bits in groups of 16; on the CPU with a
    group of 16, int8 rows."""
    four, six = random_blocks("Q4_K", 32, 256), random_blocks("Q6_K", 16, 256, seed=1)
    assert spec_for([four, four]).label == "Q4_K as int4 g32"
    spec = spec_for([four, six])
    assert spec.label == "Q4_K+Q6_K as int8 g16"
    for b in (four, six):
        w = unpacked(b, spec)
        assert w.scale.shape == (b.rows, 256 // 16)
        ref = _dequantized(b)
        torch.testing.assert_close(w.dequantize(), ref, rtol=0, atol=1e-6 * ref.abs().max().item())
    three = random_blocks("Q3_K", 16, 256)
    assert spec_for([four, three]).label == "Q3_K+Q4_K as int4 g16"
    assert spec_for([four, three], cpu=True).label == "Q3_K+Q4_K as int8 per-row"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the CPU: the tests above)")
@pytest.mark.parametrize("qtype", INT4_TYPES + tuple(AFFINE))
def test_on_cuda_the_blocks_decode_as_on_the_cpu(qtype):
    """The values, scales and zeros a GPU reads from the blocks (a load decodes them on the layer's device)
    are the CPU's, bit for bit."""
    b = random_blocks(qtype, 24, 512)
    spec = spec_for([b])
    on_cpu, on_gpu = unpacked(b, spec), unpacked(b, spec, "cuda")
    for a, g in zip(on_cpu.tensors, on_gpu.tensors):
        assert g.is_cuda and torch.equal(a, g.cpu())


def assert_kept_on_the_path(model, label: str) -> None:
    """Every projection and the LM head on the int4/int8 path in the form `label` names, the embedding
    table held as the file's blocks (`DeviceRows`)."""
    gemms = [m for m in model.modules() if isinstance(m, layers._Linear)] + [model.lm_head]
    assert weights_held(model)[0][label] == len(gemms), weights_held(model)[0]
    assert all(isinstance(m.linear_method, Int4LinearMethod) for m in gemms)
    assert isinstance(model.model.embed_tokens.quantized_rows, DeviceRows)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q3_K", "TQ1_0"])
def test_greedy_equals_transformers_reading_the_file(ckpt_factory, tmp_path, monkeypatch, int4_path, qtype):
    """Each form in a whole model (the K-quants' files random blocks, which gguf-py cannot write from
    weights): transformers' greedy tokens reading the same file, divergences at near-ties only."""
    from transformers import AutoModelForCausalLM

    # (super-blocks of 256: the K-quants' and the ternary types' files are 256 wide, random blocks)
    wide = (
        dict(hidden_size=256, intermediate_size=256, head_dim=64)
        if qtype.endswith("_K") or qtype in TERNARY
        else {}
    )
    ckpt = ckpt_factory("llama", rope_scaling=None, **wide)
    path = tmp_path / f"llama.{qtype}.gguf"
    path = _k_quant_gguf(ckpt, path, monkeypatch, qtype) if wide else write_gguf(ckpt, path, qtype)
    prompts = make_prompts(1000, n=3, max_len=30, shared_prefix=8)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    with LLM(str(path), device="cpu", dtype="float32", kv_cache_tokens=2048, overlap=False) as llm:
        ours = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        model = llm.engine.runner.model
    bits, group = (4, 32) if qtype in INT4_TYPES else AFFINE[qtype]
    label = f"{qtype} as int{bits} g{group}"
    assert_kept_on_the_path(model, label)
    ref = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tol = NEAR_TIE["int4" if qtype in INT4_TYPES else "int8"]
    notes = [check_greedy(out, hf_greedy(ref, p, MAX_NEW), tol=tol) for out, p in zip(ours, prompts)]
    print(f"{qtype}: {sum(n is not None for n in notes)} of {len(prompts)} diverged at a near-tie")


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_a_tied_table_is_held_as_blocks_and_its_head_on_the_path(ckpt_factory, tmp_path, int4_path, qtype):
    """A tied embedding (Qwen2's): the table held as the file's blocks, the head a second, quantized form
    of the same blocks on the int4/int8 path, no float copy of either; transformers' greedy tokens."""
    from transformers import AutoModelForCausalLM

    path = write_gguf(ckpt_factory("qwen2"), tmp_path / f"qwen2.{qtype}.gguf", qtype)
    prompts = make_prompts(1000, n=3, max_len=30, shared_prefix=8)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    with LLM(str(path), device="cpu", dtype="float32", kv_cache_tokens=2048, overlap=False) as llm:
        ours = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        model = llm.engine.runner.model
    assert model.lm_head.weight.numel() == model.model.embed_tokens.weight.numel() == 0  # (no float copy)
    assert_kept_on_the_path(model, f"{qtype} as int{4 if qtype in INT4_TYPES else 8} g32")
    ref = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tol = NEAR_TIE["int4" if qtype in INT4_TYPES else "int8"]
    for out, p in zip(ours, prompts):
        check_greedy(out, hf_greedy(ref, p, MAX_NEW), tol=tol)


@pytest.mark.slow  # (two tensor-parallel rank processes, ~10 s)
def test_two_ranks_over_a_tied_gguf_give_transformers_tokens(ckpt_factory, tmp_path):
    """Tensor parallelism (gloo, one process per rank) over a tied GGUF file on the CPU's kernels: each
    rank looks up its rows of the table's blocks, its head rows on the int4 kernel; the greedy tokens are
    transformers' reading the file."""
    from transformers import AutoModelForCausalLM

    path = write_gguf(ckpt_factory("qwen2"), tmp_path / "qwen2.Q4_1.gguf", "Q4_1")
    prompts = make_prompts(1000, n=2, max_len=30, shared_prefix=8)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    with LLM(str(path), device="cpu", dtype="float32", kv_cache_tokens=1024, tensor_parallel_size=2) as llm:
        ours = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    ref = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    notes = [check_greedy(o, hf_greedy(ref, p, MAX_NEW), tol=NEAR_TIE["int4"]) for o, p in zip(ours, prompts)]
    assert sum(n is not None for n in notes) <= 1, notes


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q6_K", "Q3_K"])
def test_each_rank_holds_its_piece_of_the_files_weights(ckpt_factory, tmp_path, monkeypatch, qtype):
    """Two ranks (on the reference path, `GAPLESS_INT4_KERNEL=triton`: each type's own form, as a GPU
    holds it): every projection and the head quantized (q/k/v, gate/up and the head cut by rows; o and
    down by groups), each rank's weight the dequantized file's piece, its embedding rows the file's."""
    # (super-blocks of 256: the K-quants' and the ternary types' files are 256 wide, random blocks)
    wide = (
        dict(hidden_size=256, intermediate_size=256, head_dim=64)
        if qtype.endswith("_K") or qtype in TERNARY
        else {}
    )
    ckpt = ckpt_factory("llama", rope_scaling=None, **wide)
    path = tmp_path / f"m.{qtype}.gguf"
    path = _k_quant_gguf(ckpt, path, monkeypatch, qtype) if wide else write_gguf(ckpt, path, qtype)
    monkeypatch.setenv("GAPLESS_INT4_KERNEL", "triton")  # (the reference path: its weights dequantized)
    _, ranks = load_as_ranks(path)
    monkeypatch.setenv("GAPLESS_GGUF_WEIGHTS", "dequantize")
    monkeypatch.setenv("GAPLESS_CPU_GEMM", "plain")  # (the float weights as loaded, not packed)
    _, floats = load_as_ranks(path)
    for part, float_part in zip(ranks, floats):
        for name, m in part.named_modules():
            if isinstance(m, (layers._Linear, layers.ParallelLMHead)):
                assert isinstance(m.linear_method, Int4LinearMethod), name
                want = float_part.get_submodule(name).weight
                got = m.linear_method.dequantized(torch.float32)
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * want.abs().max().item())
        table, float_table = part.model.embed_tokens, float_part.model.embed_tokens.weight
        rows = table.quantized_rows.lookup(torch.arange(table.rows))  # (this rank's numbering)
        torch.testing.assert_close(rows, float_table, rtol=0, atol=0)
    assert parallel.current().size == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the CPU path: the tests above)")
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_on_cuda_the_gpus_kernels_give_the_dequantized_models_tokens(
    ckpt_factory, tmp_path, monkeypatch, qtype
):
    """A GGUF on a GPU: 4-bit layers on tinygemm at decode and the Triton GEMM above, Q8_0's 8 bits in
    groups of 32 on the Triton GEMM, greedy as the dequantized model within near-ties."""
    path = write_gguf(ckpt_factory("llama", rope_scaling=None), tmp_path / f"m.{qtype}.gguf", qtype)
    prompts = make_prompts(1000, n=3, max_len=30, shared_prefix=8)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=2)

    def run() -> tuple[list, dict]:
        with LLM(str(path), device="cuda", dtype="bfloat16", kv_cache_tokens=2048) as llm:
            outs = llm.generate(prompts, greedy, use_tqdm=False)
            return outs, dict(llm.engine.info.weight_formats)

    quantized, formats = run()
    label = "Q4_1 as int4 g32 (tinygemm" if qtype == "Q4_1" else "Q8_0 as int8 g32"
    assert any(f.startswith(label) for f in formats), formats
    monkeypatch.setenv("GAPLESS_GGUF_WEIGHTS", "dequantize")
    floats, float_formats = run()
    assert not any(qtype in f for f in float_formats), float_formats
    for q, f in zip(quantized, floats):
        for step, (a, b) in enumerate(zip(q.token_ids, f.token_ids)):
            if a != b:  # a near-tie of the float model's: its top two within the int4 layout's rounding
                assert f.top_logprobs is not None
                top = sorted((lp for _, lp in f.top_logprobs[step]), reverse=True)[:2]
                assert top[0] - top[1] < 2 * NEAR_TIE["int4"], (step, top)
                break


@pytest.mark.parametrize("m", [1, 5])
def test_the_triton_gemm_takes_fractional_zeros_exactly(m):
    """A GGUF layer's zeros are not integers: every tile of the Triton GEMM (on CUDA, else interpreted) in
    float32 gives the product of the weights as held to float32's rounding, a step in one group or over
    four (BLOCK_K 32 or 128 over groups of 32), where the values' 2^23 bias would have rounded each zero to
    an integer (1.6% of the largest output off, at one row) and the factored GEMV and PTX values, which
    hold integer zeros alone, are not taken."""
    from gapless.model.quant.int4_triton import GemmConfig, w4a16_matmul

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    b = random_blocks("Q4_1", 64, 256, seed=m)
    w = unpacked(b, spec_for([b]))
    assert not torch.equal(w.zero, w.zero.round())
    held = Int4LinearMethod(w, spec_for([b]), torch.float32, device, kernel="triton")
    assert held.zeros.dtype == torch.float32 and not held.integer_zeros
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m))
    ref = x.double() @ held.dequantized(torch.float32).double().cpu().t()
    configs = [None] + [GemmConfig(1, 32, bk, 2, 4, 1, factored=f) for bk in (32, 128) for f in (False, True)]
    configs += [
        GemmConfig(16, 32, 128, 2, 4, 3, nibble, swapped=sw)
        for nibble in (True, False)
        for sw in (False, True)
    ]
    for cfg in configs:
        y = w4a16_matmul(x.to(device), held.qweight, held.scales, held.zeros, 32, 4, cfg, integer_zeros=False)
        err = float((y.double().cpu() - ref).abs().max() / ref.abs().max())
        assert err < 1e-5, (cfg, err)


def test_fractional_zeros_are_held_in_float16_under_bfloat16():
    """Under bfloat16 activations a GGUF layer's zeros are held in float16 (8 bits of bfloat16 put a zero
    up to 1/32 of a step off), never made into values by PTX (on CUDA it would round each zero to an
    integer; interpreted, PTX never runs); a checkpoint's integer zeros stay bfloat16."""
    from gapless.model.quant import int4
    from gapless.model.quant.int4_triton import choose_config, w4a16_matmul

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    b = random_blocks("Q4_1", 64, 256)
    w = unpacked(b, spec_for([b]))
    held = Int4LinearMethod(w, spec_for([b]), torch.bfloat16, device, kernel="triton")
    assert held.zeros.dtype == torch.float16 and not held.integer_zeros
    torch.testing.assert_close(held.zeros.float().t().cpu(), w.zero.half().float(), rtol=0, atol=0)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(int4, "TRITON_ON_CPU", device.type == "cpu")
        y = held.apply(None, x.to(device))
    plain = choose_config(1, 64, 256, 32)._replace(ptx_values=False)
    args = (held.qweight, held.scales, held.zeros, 32, 4)
    assert torch.equal(y, w4a16_matmul(x.to(device), *args, config=plain, integer_zeros=False))
    ref = x.double() @ held.dequantized(torch.float32).double().cpu().t()
    assert float((y.double().cpu() - ref).abs().max() / ref.abs().max()) < 2e-2
    rounded = w._replace(zero=w.zero.round())
    integer = Int4LinearMethod(rounded, spec_for([b]), torch.bfloat16, device, "triton")
    assert integer.zeros.dtype == torch.bfloat16 and integer.integer_zeros


def test_each_projection_is_installed_as_soon_as_its_module_is_whole(ckpt_factory, tmp_path, int4_path):
    """The host holds the blocks of the projection still arriving, not the file's: every install comes
    during the read, with at most q and k waiting for v (or gate for up); none is left to `finish`."""
    from gapless.model.quant.gguf_int4 import GGUFLayers

    path = write_gguf(ckpt_factory("llama", rope_scaling=None), tmp_path / "m.Q4_0.gguf", "Q4_0")
    waiting, install = [], GGUFLayers._install

    def recorded(self, name, shards):
        waiting.append(len(self.pending))
        install(self, name, shards)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GGUFLayers, "_install", recorded)
        mp.setattr(GGUFLayers, "finish", lambda self: (not self.pending) and self.installed > 0)
        model = loader.load_model(path, torch.float32, torch.device("cpu"))
    projections = [m for m in model.modules() if isinstance(m, layers._Linear)]
    assert len(waiting) == len(projections) + 2 and max(waiting) <= 1, waiting  # (and the table and head)


def test_a_float_gguf_on_the_cpu_still_packs_its_gemms(ckpt_factory, tmp_path):
    """No matrix comes quantized from an F32 file: its layers are packed for the CPU as a checkpoint's."""
    from gapless.model.cpu_gemm import unavailable_reason

    why = unavailable_reason(torch.device("cpu"), torch.float32)
    if why is not None:
        pytest.skip(f"packed CPU GEMMs are off here: {why}")
    path = write_gguf(ckpt_factory("llama", rope_scaling=None), tmp_path / "m.F32.gguf", "F32")
    model = loader.load_model(path, torch.float32, torch.device("cpu"))
    assert all(m.cpu_gemm is not None for m in model.modules() if isinstance(m, layers._Linear))


def test_the_triton_gemm_in_a_whole_model_gives_the_reference_paths_tokens(ckpt_factory, tmp_path, int4_path):
    """A Q4_1 file's projections through the Triton GEMM (on CUDA where there is one, else under the
    interpreter) in a served model: the reference path's greedy tokens (float32; fractional zeros in every
    layer, groups of 32 over 128-wide K steps)."""
    from gapless.model.quant import int4, int4_triton

    path = write_gguf(ckpt_factory("llama", rope_scaling=None), tmp_path / "m.Q4_1.gguf", "Q4_1")
    prompts = make_prompts(1000, n=1, max_len=12, shared_prefix=4)
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def tokens(on: str) -> list[int]:
        with LLM(str(path), device=on, dtype="float32", kv_cache_tokens=1024, overlap=False) as llm:
            return llm.generate(prompts, greedy, use_tqdm=False)[0].token_ids

    reference = tokens("cpu")
    calls = []
    gemm = int4_triton.w4a16_matmul
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(int4_triton, "w4a16_matmul", lambda *a, **k: calls.append(k) or gemm(*a, **k))
        mp.setattr(int4, "TRITON_ON_CPU", device == "cpu")
        assert tokens(device) == reference
    assert len(calls) >= 3 * 2 * 4 and all(k["integer_zeros"] is False for k in calls)


def test_the_groups_layout_holds_a_q8_0_file_in_its_own_groups_on_one_cpu(
    ckpt_factory, tmp_path, monkeypatch
):
    """`GAPLESS_GGUF_LAYOUT=groups` on a one-rank CPU: every projection goes the GPU's way, a Q8_0 file's in
    its own values and groups of 32 on torch's CPU int4 kernel (`CpuInt8Groups`), each layer's output the
    file's weights' within the bfloat16 roundings, closer than the int8 rows of the other CPU layouts,
    which round each weight again (one scale a row)."""
    from gapless.model.quant import gguf_cpu
    from gapless.model.quant.int4_kernels import CpuInt8Groups

    path = write_gguf(ckpt_factory("llama", rope_scaling=None), tmp_path / "q.gguf", "Q8_0")
    monkeypatch.setenv("GAPLESS_GGUF_LAYOUT", "groups")
    assert loader.gguf_kept(path, torch.device("cpu")) == "int4"
    model = loader.load_model(path, torch.float32, torch.device("cpu"))
    formats = weights_held(model)[0]
    assert set(formats) == {"Q8_0 as int8 g32 (torch-cpu)"}, formats  # (every projection and the head)
    down = model.model.layers[0].mlp.down_proj
    assert isinstance(down.linear_method.library, CpuInt8Groups)
    monkeypatch.setenv("GAPLESS_GGUF_LAYOUT", "int8")
    rows = loader.load_model(path, torch.float32, torch.device("cpu")).model.layers[0].mlp.down_proj
    assert isinstance(rows.linear_method, gguf_cpu.Int8DynamicLinearMethod)

    blocks = next(
        b for n, b in loader.iter_weights(path, "int4") if n.endswith("layers.0.mlp.down_proj.weight")
    )
    w = _dequantized(blocks)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, w.shape[1], generator=gen).bfloat16().float()  # (the kernel takes x in bfloat16)
    ref = x @ w.t()
    err = {
        name: (m.linear_method.apply(m, x) - ref).abs().max().item()
        for name, m in (("groups", down), ("rows", rows))
    }
    assert err["groups"] <= 2 * 2.0**-8 * (x.abs() @ w.abs().t()).max().item(), err
    assert err["groups"] < err["rows"], err
