"""GGUF's i-quants (`gapless.model.quant.gguf_iq`): each type's values and scales against the `gguf`
package's dequantization bit for bit, the form each is held in, and whole models written in them against
transformers reading the same file, on the int4/int8 path (a GPU's, tensor parallelism) and the CPU's
kernels (int8 rows)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from gapless import LLM, SamplingParams
from gapless.model.quant import gguf_iq, weights_held
from gapless.model.quant.gguf_blocks import affine_parts, dequantize_rows
from gapless.model.quant.gguf_int4 import spec_for, unpacked
from gapless.testing.gguf_files import random_blocks
from gapless.testing.hf_reference import check_greedy, hf_greedy, make_prompts
from tests.model.test_quant_gguf import MAX_NEW, NEAR_TIE, _dequantized, _k_quant_gguf
from tests.model.test_quant_gguf_int4 import assert_kept_on_the_path


def _zero_first_scale(b, qtype: str, row: int) -> None:
    """Row `row`'s first block's f16 scale set to 0 (IQ1_M's is the top nibbles of its four scale words);
    MXFP4's e8m0 has no 0: its values are set to level 0 instead."""
    size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][1]
    blk = b.data.reshape(b.rows, -1, size)
    if qtype == "IQ1_M":
        blk[row, 0, 49:56:2] &= 0x0F
    elif qtype == "MXFP4":
        blk[row, 0, 1:] = 0
    else:
        blk[row, 0, 0:2] = 0


@pytest.mark.parametrize("qtype", sorted(gguf_iq.FORMS))
def test_each_i_quant_is_the_files_weights_bit_for_bit(qtype):
    """The values (table levels, lattice points with their signs) and group scales read from the blocks
    are the file's weights exactly, in the form `FORMS` gives (IQ3_S and IQ1_* in 4 bits with a zero of
    7.5 or 4.5, the rest in 8), a block whose scale is 0 too; those in 8 bits also as 4-bit indices into
    their codebook's levels (the form a GPU holds them in); on the CPU's kernels groups of 16 are int8
    rows."""
    bits, group = gguf_iq.FORMS[qtype]
    b = random_blocks(qtype, 24, 512)
    _zero_first_scale(b, qtype, 5)
    ref = _dequantized(b)
    assert bool((ref[5, :32] == 0).all()) and ref.abs().max() > 0
    spec = spec_for([b], codebook=False)
    assert (spec.bits, spec.group_size) == (bits, group) and spec.label == f"{qtype} as int{bits} g{group}"
    w = unpacked(b, spec)
    assert int(w.q.min()) >= 0 and int(w.q.max()) < 1 << bits and w.scale.shape == (24, 512 // group)
    torch.testing.assert_close(w.dequantize(), ref, rtol=0, atol=0)
    if qtype in gguf_iq.CODEBOOKS:
        assert bits == 8
        spec = spec_for([b])
        book = gguf_iq.CODEBOOKS[qtype]
        assert (spec.bits, spec.group_size, spec.label) == (4, group, f"{qtype} as {book} codes g{group}")
        w = unpacked(b, spec)
        assert int(w.q.max()) < 16 and w.levels is not None and not bool(w.zero.any())
        torch.testing.assert_close(w.dequantize(), ref, rtol=0, atol=0)
    else:
        assert bits == 4
        assert spec_for([b]) == spec
    assert spec_for([b], cpu=True).group_size == (-1 if group < 32 else group)
    # the same values whatever the rows read (a chunked read), and the float rows the CPU's int8 rows and
    # the embedding table take are gguf's
    q, scale, zero = affine_parts(b)
    part = type(b)(qtype, b.cols, b.data[7:19])
    assert all(torch.equal(a[7:19], p) for a, p in zip((q, scale, zero), affine_parts(part)))
    torch.testing.assert_close(dequantize_rows(b, 7, 19), ref[7:19], rtol=0, atol=0)


def test_the_sign_parity_and_the_levels_are_llama_cpps():
    """The 7-bit sign indices' eighth sign is their parity (llama.cpp's `ksigns_iq2xs` table, which gguf
    ships), IQ4's levels are its 16 non-uniform ones, MXFP4's its doubled e2m1 values with half of each
    e8m0 scale, and each lattice's codebook is its points' values with both signs (IQ2_XS's and IQ2_S's
    lattices have IQ2_XXS's values)."""
    ksigns = np.frombuffer(gguf.quants.IQ2_XXS.ksigns, dtype=np.uint8)
    assert gguf_iq._even_signs(torch.arange(128)).tolist() == ksigns.tolist()
    assert gguf_iq._table("IQ4_XS", torch.device("cpu")).tolist() == list(gguf.quants.IQ4_NL.kvalues)
    assert gguf_iq.levels("iq4_nl").tolist() == list(gguf.quants.IQ4_NL.kvalues)
    mxfp4 = list(gguf.quants.MXFP4.kvalues)  # (e2m1's values doubled, the codebook's e2m1 ones)
    assert gguf_iq._table("MXFP4", torch.device("cpu")).tolist() == mxfp4
    assert (gguf_iq.levels("mxfp4") * 2).tolist() == mxfp4
    e = np.arange(256, dtype=np.uint8)  # every e8m0 byte: subnormal halves below 2, 2^127 at 255
    want = gguf.quants.MXFP4.e8m0_to_fp32_half(e)
    assert gguf_iq._e8m0_half(torch.from_numpy(e)).numpy().tobytes() == want.tobytes()
    iq3 = [4, 12, 20, 28, 36, 44, 52, 62]
    assert gguf_iq.levels("iq3_xxs").tolist() == [-v for v in reversed(iq3)] + iq3
    assert gguf_iq.levels("iq2").tolist() == [-43, -25, -8, 8, 25, 43] + [0] * 10
    for qtype in ("IQ2_XS", "IQ2_S"):
        assert gguf_iq._table(qtype, torch.device("cpu")).unique().tolist() == [8, 25, 43]


def test_a_projection_fused_from_two_codebooks_is_held_affine():
    """q/k/v in IQ2_XXS and IQ3_XXS (two codebooks, no one table of 16 holds both) stack in the affine
    form, 8 bits in the narrower group; IQ2_XXS with IQ2_XS share theirs, in groups of 16: each the file's
    weights."""
    parts = [random_blocks(t, 8, 256) for t in ("IQ2_XXS", "IQ3_XXS", "IQ2_XS")]
    assert spec_for(parts[:2]).label == "IQ2_XXS+IQ3_XXS as int8 g32"
    shared = spec_for([parts[0], parts[2]])
    assert shared.label == "IQ2_XS+IQ2_XXS as iq2 codes g16"
    for spec, pair in ((spec_for(parts[:2]), parts[:2]), (shared, [parts[0], parts[2]])):
        for b in pair:
            w = unpacked(b, spec)
            assert w.scale.shape == (8, 256 // spec.group_size)
            torch.testing.assert_close(w.dequantize(), _dequantized(b), rtol=0, atol=0)


def test_an_unknown_type_is_refused_where_blocks_are_read():
    blk = torch.zeros(2, 1, 66, dtype=torch.uint8)
    with pytest.raises(ValueError, match="TQ2_0 is not an i-quant"):
        gguf_iq.parts("TQ2_0", blk)


WIDE = dict(hidden_size=256, intermediate_size=256, head_dim=64)  # (i-quants' super-blocks are 256 wide)


def _model_of(ckpt_factory, tmp_path, monkeypatch, qtype):
    ckpt = ckpt_factory("llama", rope_scaling=None, **WIDE)
    return _k_quant_gguf(ckpt, tmp_path / f"llama.{qtype}.gguf", monkeypatch, qtype)


def _check_against_transformers(path, qtype, tol):
    from transformers import AutoModelForCausalLM

    prompts = make_prompts(1000, n=3, max_len=30, shared_prefix=8)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    with LLM(str(path), device="cpu", dtype="float32", kv_cache_tokens=2048, overlap=False) as llm:
        ours = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        model = llm.engine.runner.model
    ref = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    notes = [check_greedy(out, hf_greedy(ref, p, MAX_NEW), tol=tol) for out, p in zip(ours, prompts)]
    print(f"{qtype}: {sum(n is not None for n in notes)} of {len(prompts)} diverged at a near-tie")
    return model


@pytest.mark.parametrize("qtype", ["IQ4_XS", "MXFP4", "IQ3_XXS", "IQ3_S", "IQ2_XS", "IQ1_M"])
def test_greedy_on_the_int4_path_equals_transformers(ckpt_factory, tmp_path, monkeypatch, int4_path, qtype):
    """A whole model in each form (indices into IQ4's levels, into IQ3_XXS's lattice values and IQ2's in
    groups of 16; 4 bits with a fractional zero in groups of 32 and 16), every projection on the int4
    path as a GPU holds it: transformers' greedy tokens reading the same file, divergences at near-ties
    only."""
    path = _model_of(ckpt_factory, tmp_path, monkeypatch, qtype)
    model = _check_against_transformers(path, qtype, NEAR_TIE["int4"])
    bits, group = gguf_iq.FORMS[qtype]
    form = f"{gguf_iq.CODEBOOKS[qtype]} codes" if qtype in gguf_iq.CODEBOOKS else f"int{bits}"
    assert_kept_on_the_path(model, f"{qtype} as {form} g{group}")
    if qtype in gguf_iq.CODEBOOKS:  # (4 bits a weight, where the affine form takes 8)
        gemms = [m.linear_method for m in model.modules() if hasattr(m, "linear_method")]
        assert all(g.qweight.numel() * 8 == g.out_features * g.in_features for g in gemms)


@pytest.mark.parametrize("qtype", ["IQ4_NL", "MXFP4", "IQ2_XXS"])
def test_greedy_on_the_cpus_kernels_equals_transformers(ckpt_factory, tmp_path, monkeypatch, qtype):
    """The CPU's default layout holds an i-quant's projections as int8 rows (requantized from the file's
    weights) and runs them on torch's int8 kernels: transformers' greedy tokens, near-ties aside."""
    path = _model_of(ckpt_factory, tmp_path, monkeypatch, qtype)
    model = _check_against_transformers(path, qtype, NEAR_TIE["int8"])
    formats = weights_held(model)[0]
    assert any(f.startswith(f"{qtype} as int8 per-row") for f in formats), formats
