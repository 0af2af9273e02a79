"""GGUF mixtures of experts (`gapless.model.gguf`): Qwen2-MoE, Qwen3-MoE, and Mixtral, which llama.cpp
writes as `llama` with experts. The config comes from the file's metadata; the stacked experts load one
expert at a time and stay quantized on every device (`gguf_int4.install_experts`), gate/up and down each in
their own form; greedy tokens and prompt logprobs against transformers reading the same file; each rank's
piece; the grouped GEMM over a file's experts; and what gapless's routers do not compute refused by name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from gapless import LLM, SamplingParams
from gapless.model import gguf, loader
from gapless.model.config import load_model_config
from gapless.model.moe import Experts, reference_experts, route
from gapless.model.quant import weights_held, weights_summary
from gapless.model.quant.gguf_int4 import install_experts
from gapless.testing.gguf_files import random_blocks, write_gguf, write_random_gguf
from gapless.testing.hf_reference import check_greedy, hf_greedy, hf_logits, load_hf_model, make_prompts
from gapless.testing.quant_checkpoints import experts_of
from gapless.testing.ranks import assert_experts_cut, load_as_ranks
from tests.model.test_quant_gguf import NEAR_TIE, _dequantized

MAX_NEW = 8
CPU = torch.device("cpu")
# the tiny mixtures as llama.cpp can write them: its qwen3moe has no dense layers among the sparse ones
# (`mlp_only_layers`), and every matrix is whole blocks of 32 (Qwen2-MoE's shared expert 64 wide)
_TINY = {
    "qwen3_moe": dict(mlp_only_layers=None),
    "qwen2_moe": dict(shared_expert_intermediate_size=64),
    "mixtral": {},
}


def _generate(path: Path, prompts: list[list[int]], params: SamplingParams) -> list:
    with LLM(str(path), device="cpu", dtype="float32", kv_cache_tokens=2048, overlap=False) as llm:
        return llm.generate(prompts, params, use_tqdm=False)


def _greedy(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in _generate(path, prompts, params)]


def _reference(ckpt: Path, path: Path, tmp_path: Path) -> torch.nn.Module:
    """transformers on the file's weights: reading the file itself (its Qwen mixtures, given the
    checkpoint's config: its GGUF reader does not map `expert_feed_forward_length`), or, for Mixtral, which
    it reads only as a dense llama, the checkpoint's model holding the file's weights as gguf-py
    dequantizes them (`gguf.iter_weights`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(ckpt)
    if config.model_type != "mixtral":
        return AutoModelForCausalLM.from_pretrained(
            str(path.parent),
            gguf_file=path.name,
            config=config,
            dtype=torch.float32,
            attn_implementation="eager",
        ).eval()
    copy = tmp_path / "dequantized"
    copy.mkdir()
    for f in ckpt.iterdir():
        if f.suffix != ".safetensors":
            (copy / f.name).write_bytes(f.read_bytes())
    save_file(
        {_mixtral_name(n): w.contiguous() for n, w in gguf.iter_weights(path)}, copy / "model.safetensors"
    )
    return load_hf_model(copy)


def _mixtral_name(name: str) -> str:
    """A Hugging Face name as Mixtral's checkpoints spell it (`block_sparse_moe`, experts' w1/w3/w2)."""
    for ours, theirs in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
        name = re.sub(rf"(\.experts\.\d+)\.{ours}\.", rf"\1.{theirs}.", name)
    return name.replace(".mlp.experts.", ".block_sparse_moe.experts.").replace(
        ".mlp.gate.", ".block_sparse_moe.gate."
    )


@pytest.mark.parametrize("arch", sorted(_TINY))
def test_a_mixtures_config_comes_from_the_files_metadata(ckpt_factory, tmp_path, arch):
    """The file's config is the checkpoint's: its family, experts, experts a token, their width, the shared
    expert's, every layer routed, and whether the chosen weights are renormalised (llama.cpp's rule:
    Qwen3-MoE yes, Qwen2-MoE no, Mixtral always)."""
    ckpt = ckpt_factory(arch, **_TINY[arch])
    ours, theirs = load_model_config(write_gguf(ckpt, tmp_path / f"{arch}.gguf")), load_model_config(ckpt)
    fields = ("architecture", "moe", "moe_layers", "num_experts", "num_experts_per_tok")
    fields += ("moe_intermediate_size", "norm_topk_prob", "shared_expert_intermediate_size")
    assert {f: getattr(ours, f) for f in fields} == {f: getattr(theirs, f) for f in fields}
    assert ours.num_experts == 8 and all(ours.moe_layers)


def test_a_layer_without_a_router_is_a_dense_one(ckpt_factory, tmp_path, monkeypatch):
    """A layer whose router (`ffn_gate_inp`) the file lacks runs a dense MLP (`mlp_only_layers`)."""
    path = write_gguf(ckpt_factory("qwen3_moe", **_TINY["qwen3_moe"]), tmp_path / "m.gguf")
    names = gguf.tensor_names(path) - {"blk.1.ffn_gate_inp.weight"}
    monkeypatch.setattr(gguf, "tensor_names", lambda p: names)
    assert gguf.config_dict(path)["mlp_only_layers"] == [1]
    assert load_model_config(path).moe_layers == (True, False)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"qwen3moe.expert_gating_func": 2}, "qwen3moe: expert_gating_func 2 is not supported"),
        ({"qwen3moe.expert_count": 0}, "a qwen3moe file without qwen3moe.expert_count"),
    ],
)
def test_what_the_routers_do_not_compute_is_refused_by_name(
    ckpt_factory, tmp_path, monkeypatch, change, says
):
    """A sigmoid-gated router, or a Qwen mixture's file that names no experts: refused in one line."""
    path = write_gguf(ckpt_factory("qwen3_moe", **_TINY["qwen3_moe"]), tmp_path / "m.gguf")
    meta = gguf.metadata(path) | change
    monkeypatch.setattr(gguf, "metadata", lambda p: meta)
    with pytest.raises(ValueError, match=says) as e:
        load_model_config(path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("arch", "qtype", "label"),
    [
        ("qwen3_moe", "Q4_1", "Q4_1 as int4 g32"),
        ("qwen3_moe", "Q8_0", "Q8_0 as int8 g32"),
        ("qwen2_moe", "Q4_0", "Q4_0 as int4 g32"),  # (its shared expert: the dense int4 path)
        ("mixtral", "Q5_1", "Q5_1 as int8 g32"),
    ],
)
def test_greedy_equals_transformers_on_the_files_weights(
    ckpt_factory, tmp_path, int4_path, arch, qtype, label
):
    """Every layer's experts held packed in the file's own form (int32 words; the start-up line names it),
    the router float, and greedy tokens equal transformers' on the same weights (at most a near-tie)."""
    ckpt = ckpt_factory(arch, **_TINY[arch])
    path = write_gguf(ckpt, tmp_path / f"{arch}.{qtype}.gguf", qtype)
    model = loader.load_model(path, torch.float32, CPU)
    experts = experts_of(model)
    assert len(experts) == 2 and all(m.gate_up_proj.dtype == torch.int32 for m in experts)
    assert weights_held(model)[0].get(f"{label} experts") == 2, weights_summary(model)
    assert model.model.layers[0].mlp.gate.weight.dtype == torch.float32
    prompts = make_prompts(1000, n=3, max_len=30, shared_prefix=6)
    ours = _greedy(path, prompts)
    ref = _reference(ckpt, path, tmp_path)
    notes = [check_greedy(o, hf_greedy(ref, p, MAX_NEW)) for o, p in zip(ours, prompts)]
    assert sum(n is not None for n in notes) <= 1, notes


def test_a_float_mixtral_file_is_the_checkpoints_model(ckpt_factory, tmp_path):
    """Mixtral written as llama.cpp writes it (`llama` with experts, q/k rows permuted, experts stacked),
    read back in F32: greedy tokens equal transformers' on the checkpoint it was written from (the check of
    the names and layouts that the quantized Mixtral's reference, built from them, cannot make)."""
    ckpt = ckpt_factory("mixtral")
    path = write_gguf(ckpt, tmp_path / "mixtral.F32.gguf", "F32")
    prompts = make_prompts(1000, n=3, max_len=30, shared_prefix=6)
    ref = load_hf_model(ckpt)
    for out, p in zip(_greedy(path, prompts), prompts):
        assert check_greedy(out, hf_greedy(ref, p, MAX_NEW)) is None


def _prompt_logprobs_equal_transformers(ckpt, path, tmp_path):
    """Every prompt position's logprob equals transformers' reading the same file, within 1e-3."""
    prompts = make_prompts(1000, n=2, max_len=24, shared_prefix=4)
    outs = _generate(path, prompts, SamplingParams(max_tokens=1, prompt_logprobs=0))
    ref = _reference(ckpt, path, tmp_path)
    for prompt, out in zip(prompts, outs):
        ours = torch.tensor([next(iter(lp.values())).logprob for lp in out.prompt_logprobs[1:]])
        theirs = (
            hf_logits(ref, prompt).log_softmax(-1)[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        )
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-3)


def test_a_q4_k_m_files_experts_hold_gate_up_and_down_each_in_its_form(ckpt_factory, tmp_path, int4_path):
    """llama.cpp's Q4_K_M mix (random blocks: gguf-py cannot write K-quants): gate/up Q4_K as 4 bits in
    groups of 32, down Q6_K (of 3 layers, in the last) as 8 bits in groups of 16, Q4_K elsewhere; every
    prompt position's logprob equals transformers' reading the same file."""
    wide = dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=256, head_dim=64)
    ckpt = ckpt_factory("qwen3_moe", num_hidden_layers=3, **_TINY["qwen3_moe"], **wide)
    path = write_random_gguf(ckpt, tmp_path / "m.Q4_K_M.gguf")
    model = loader.load_model(path, torch.float32, CPU)
    labels = [m.weight_format for m in experts_of(model)]
    mixed = "Q4_K as int4 g32, down Q6_K as int8 g16 experts"
    assert labels == ["Q4_K as int4 g32 experts"] * 2 + [mixed], labels
    _prompt_logprobs_equal_transformers(ckpt, path, tmp_path)


@pytest.mark.parametrize(
    ("qtype", "form"),
    [
        ("IQ3_S", "int4 g32"),
        ("IQ2_XS", "iq2 codes g16"),
        ("IQ4_XS", "iq4_nl codes g32"),
        ("MXFP4", "mxfp4 codes g32"),
    ],
)
def test_i_quant_experts_hold_the_files_values(ckpt_factory, tmp_path, int4_path, qtype, form):
    """A mixture written in an i-quant (random blocks; IQ3_S's 4 bits with a zero of 7.5, IQ2_XS's 4-bit
    indices into IQ2's levels in groups of 16, IQ4_XS's into IQ4's) or in MXFP4 (llama.cpp's MXFP4_MOE
    files' experts: indices into e2m1's values): every expert held in that form, every prompt position's
    logprob equal to transformers' reading the same file."""
    wide = dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=256, head_dim=64)
    ckpt = ckpt_factory("qwen3_moe", **_TINY["qwen3_moe"], **wide)
    path = write_random_gguf(ckpt, tmp_path / f"m.{qtype}.gguf", qtype)
    model = loader.load_model(path, torch.float32, CPU)
    assert [m.weight_format for m in experts_of(model)] == [f"{qtype} as {form} experts"] * 2
    _prompt_logprobs_equal_transformers(ckpt, path, tmp_path)


def test_on_one_cpu_rank_the_experts_run_the_cpus_kernels(ckpt_factory, tmp_path):
    """The CPU's default (`auto`): the experts on torch's CPU kernels (bfloat16 activations), the dense
    layers `gguf_cpu`'s; greedy tokens equal transformers' within the int8 rounding's near-ties."""
    ckpt = ckpt_factory("qwen3_moe", **_TINY["qwen3_moe"])
    path = write_gguf(ckpt, tmp_path / "m.Q8_0.gguf", "Q8_0")
    model = loader.load_model(path, torch.float32, CPU)
    assert all(m.weight_format.startswith("Q8_0 as int8 g32") for m in experts_of(model)), weights_summary(
        model
    )
    prompts = make_prompts(1000, n=3, max_len=30, shared_prefix=6)
    ref = _reference(ckpt, path, tmp_path)
    for out, p in zip(_greedy(path, prompts), prompts):
        check_greedy(out, hf_greedy(ref, p, MAX_NEW), tol=NEAR_TIE["int8"])


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_each_rank_holds_its_piece_of_the_files_experts(ckpt_factory, tmp_path, monkeypatch, qtype):
    """Two ranks (the reference path): each rank's experts are its gate/up rows and down columns of the
    whole model's, which are the file's weights dequantized."""
    ckpt = ckpt_factory("qwen3_moe", moe_intermediate_size=64, **_TINY["qwen3_moe"])
    path = write_gguf(ckpt, tmp_path / f"m.{qtype}.gguf", qtype)
    monkeypatch.setenv("GAPLESS_INT4_KERNEL", "triton")
    whole, ranks = load_as_ranks(path)
    for layer in range(2):
        experts = whole.model.layers[layer].mlp.experts
        assert_experts_cut(experts, [r.model.layers[layer].mlp.experts for r in ranks])
        assert experts.cpu_weights is not None
        for e in range(8):
            for proj, held in (
                ("up_proj", experts.cpu_weights[0][e, 64:]),
                ("down_proj", experts.cpu_weights[1][e]),
            ):
                want = dict(gguf.iter_weights(path))[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"]
                torch.testing.assert_close(held, want, rtol=0, atol=1e-6 * want.abs().max().item())


def test_on_the_cpus_kernels_two_ranks_split_experts_held_as_int8_rows(ckpt_factory, tmp_path):
    """On the CPU's kernels (`auto`), which take no groups of 16, Q6_K experts are int8 rows; split over two
    ranks each rank's down columns keep their row's scale, and the ranks' outputs sum to one rank's."""
    wide = dict(hidden_size=256, moe_intermediate_size=512, intermediate_size=256, head_dim=64)
    path = write_random_gguf(
        ckpt_factory("qwen3_moe", **_TINY["qwen3_moe"], **wide), tmp_path / "m.gguf", "Q6_K"
    )
    whole, ranks = load_as_ranks(path)
    one, parts = whole.model.layers[0].mlp.experts, [r.model.layers[0].mlp.experts for r in ranks]
    assert all(m.weight_format.startswith("Q6_K as int8 per-row") for m in [one, *parts]), one.weight_format
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 256, generator=g)
    weights, ids = route(torch.randn(5, 8, generator=g), 2, True, False)
    want = reference_experts(x, *one.cpu_weights, weights, ids)
    got = sum(reference_experts(x, *m.cpu_weights, weights, ids) for m in parts)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-2 * want.abs().max().item())


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the interpreter's run; on a GPU the cuda model test runs the kernel"
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate_up_type", ["Q4_K", "IQ4_XS", "MXFP4"])
def test_the_grouped_gemm_runs_a_files_experts(int4_reference_path, dtype, gate_up_type):
    """The grouped GEMM (interpreted) over experts held from a file's blocks: gate/up Q4_K (4 bits g32,
    fractional zeros), IQ4_XS or MXFP4 (4-bit indices into its levels, no zeros), down Q6_K (8 bits g16),
    equals the per-expert loop over the dequantized weights; under bfloat16 Q4_K's zeros are held in
    float16."""
    from gapless.model.moe_triton import fused_experts

    e, hidden, inter = 4, 256, 256
    experts = Experts(e, hidden, inter).to(dtype)
    shards = {
        (i, p): random_blocks(gate_up_type, inter, hidden, seed=2 * i + (p == "up"))
        for i in range(e)
        for p in ("gate", "up")
    }
    shards |= {(i, "down"): random_blocks("Q6_K", hidden, inter, seed=100 + i) for i in range(e)}
    install_experts(experts, shards, dtype, "experts")
    gate_up, down = experts.int_quant
    assert (gate_up.bits, gate_up.group, down.bits, down.group) == (4, 32, 8, 16)
    assert down.levels is None and (gate_up.levels is not None) == (gate_up_type != "Q4_K")
    if gate_up.levels is None:
        assert gate_up.zeros.dtype == (torch.float16 if dtype == torch.bfloat16 else dtype)
    w13 = torch.stack([torch.cat([_dequantized(shards[(i, p)]) for p in ("gate", "up")]) for i in range(e)])
    w2 = torch.stack([_dequantized(shards[(i, "down")]) for i in range(e)])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, hidden, generator=g) * 4
    weights, ids = route(torch.randn(9, e, generator=g), 2, True, False)
    want = reference_experts(x, w13, w2, weights, ids)
    got = fused_experts(
        x.to(dtype), experts.gate_up_proj, experts.down_proj, weights.to(dtype), ids, scales=experts.int_quant
    )
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the CPU path: the tests above)")
def test_on_cuda_a_files_experts_give_the_dequantized_models_tokens(ckpt_factory, tmp_path, monkeypatch):
    """A Q4_1 mixture on a GPU in bfloat16 (the grouped GEMM, fractional zeros in float16): greedy as the
    dequantized model within near-ties."""
    path = write_gguf(ckpt_factory("qwen3_moe", **_TINY["qwen3_moe"]), tmp_path / "m.Q4_1.gguf", "Q4_1")
    prompts = make_prompts(1000, n=3, max_len=30, shared_prefix=8)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=2)

    def run() -> tuple[list, dict]:
        with LLM(str(path), device="cuda", dtype="bfloat16", kv_cache_tokens=2048) as llm:
            return llm.generate(prompts, greedy, use_tqdm=False), dict(llm.engine.info.weight_formats)

    quantized, formats = run()
    assert any(f.startswith("Q4_1 as int4 g32") and f.endswith("experts") for f in formats), formats
    monkeypatch.setenv("GAPLESS_GGUF_WEIGHTS", "dequantize")
    floats, _ = run()
    for q, f in zip(quantized, floats):
        for step, (a, b) in enumerate(zip(q.token_ids, f.token_ids)):
            if a != b:
                assert f.top_logprobs is not None
                top = sorted((lp for _, lp in f.top_logprobs[step]), reverse=True)[:2]
                assert top[0] - top[1] < 2 * NEAR_TIE["int4"], (step, top)
                break
