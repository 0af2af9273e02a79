"""Weight-only int4/int8 mixtures of experts (AWQ, GPTQ, compressed-tensors `pack-quantized`): each
expert's packed projections load into the stacked experts (`gapless.model.quant.int4_experts`),
the router stays float and a shared expert takes the dense int4 path. Tiny random mixtures are quantized
here into each layout (`gapless.testing.quant_checkpoints`); greedy tokens equal transformers' on the same
weights dequantized. The grouped GEMM's int path runs under Triton's interpreter against the per-expert
torch loop, and compiles for sm_90; tensor parallelism's cut of the experts and malformed expert tensors
are checked at load; act-order experts (each expert's inputs grouped in its own order) give the same
tokens, on either path and cut for two ranks."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from gapless import LLM, SamplingParams
from gapless.model import loader, parallel
from gapless.model.moe import WeightQuant, reference_experts, route
from gapless.model.quant import weights_held, weights_summary
from gapless.model.quant.formats import QuantFormatError
from gapless.model.quant.int4_layouts import pack_int32
from gapless.testing.hf_reference import check_greedy, hf_greedy, load_hf_model, make_prompts
from gapless.testing.quant_checkpoints import experts_of, layout_label, quantize, write_quantized
from gapless.testing.ranks import assert_experts_cut, load_as_ranks
from gapless.testing.triton_compile import compile_cases

MAX_NEW = 8
CPU = torch.device("cpu")
_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the CPU cases check the same)")

# the reference path, exact against the dequantized weights (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("int4_reference_path")


def _greedy(
    model: Path, prompts: list[list[int]], device: str = "cpu", fused: bool = False
) -> list[list[int]]:
    with LLM(str(model), device=device, dtype="float32", kv_cache_tokens=2048, overlap=False) as llm:
        if fused:  # every mixture layer on the grouped GEMM (interpreted on the CPU)
            for module in experts_of(llm.engine.runner.model):
                module.use_triton = True
        outs = llm.generate(
            prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True), use_tqdm=False
        )
    return [o.token_ids for o in outs]


@pytest.mark.parametrize(
    ("arch", "layout", "bits", "group", "sym", "device"),
    [
        ("qwen3_moe", "gptq", 4, 16, True, "cpu"),
        ("qwen3_moe", "awq", 4, 32, False, "cpu"),
        ("mixtral", "compressed-tensors", 4, 16, False, "cpu"),
        ("mixtral", "gptq_v2", 8, -1, False, "cpu"),
        ("qwen2_moe", "compressed-tensors", 8, 16, True, "cpu"),  # its shared expert: the dense int8 path
        ("qwen3_moe", "int-quantized", 8, -1, True, "cpu"),  # W8A8 INT8 experts, run as w8a16
        ("olmoe", "awq", 4, 16, False, "cpu"),
        ("qwen3_moe", "gptq", 3, 32, False, "cpu"),  # (3 bits held as 4)
        pytest.param("qwen3_moe", "gptq", 4, 16, False, "cuda", marks=_CUDA, id="qwen3_moe-gptq-cuda"),
    ],
)
def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(
    ckpt_factory, tmp_path, arch, layout, bits, group, sym, device
):
    """Each expert's projections packed in `layout`: the experts hold them packed (int32 words, the
    start-up line naming the format), the router float, and greedy tokens equal transformers' on the
    dequantized float32 weights (on CUDA: through the grouped GEMM's int path)."""
    qdir, refdir = write_quantized(ckpt_factory(arch), tmp_path, layout, bits=bits, group=group, sym=sym)
    model = loader.load_model(qdir, torch.float32, CPU)
    experts = experts_of(model)
    assert experts and all(m.gate_up_proj.dtype == torch.int32 and m.int_quant is not None for m in experts)
    assert all(m.int_quant is not None and m.int_quant[0].bits == max(bits, 4) for m in experts)
    label = f"{layout_label(layout, bits, group, sym)} experts"
    assert weights_held(model)[0].get(label) == len(experts), weights_summary(model)
    assert model.model.layers[0].mlp.gate.weight.dtype == torch.float32  # the router: as stored
    if arch == "qwen2_moe":
        shared = model.model.layers[0].mlp.shared_expert
        assert shared.gate_up_proj.linear_method.name.startswith(f"compressed-tensors w{bits}a16")
    prompts = make_prompts(1000, n=3, max_len=30, shared_prefix=6)
    ours = _greedy(qdir, prompts, device=device)
    hf = load_hf_model(refdir)
    notes = [check_greedy(o, hf_greedy(hf, p, MAX_NEW)) for o, p in zip(ours, prompts)]
    assert sum(n is not None for n in notes) <= 1, notes  # same weights: at most a rare near-tie


@pytest.mark.slow  # (~8 s)
def test_a_served_model_on_the_int_grouped_gemm_gives_the_reference_paths_tokens(ckpt_factory, tmp_path):
    """The GPU's path in a served model (interpreted without a GPU): every mixture layer through the
    grouped GEMM unpacking its int4 experts gives the CPU reference path's greedy tokens."""
    qdir, _ = write_quantized(ckpt_factory("qwen3_moe"), tmp_path, "gptq", bits=4, group=16, sym=False)
    prompts = make_prompts(1000, n=2, max_len=16, shared_prefix=4)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert _greedy(qdir, prompts, device=device, fused=True) == _greedy(qdir, prompts)


def _packed_experts(
    g: torch.Generator, e: int, rows: int, k: int, bits: int, group: int, ordered: bool = False
) -> tuple[torch.Tensor, WeightQuant, torch.Tensor]:
    """Random experts [E, rows, k] quantized: their packed words, quantization, and dequantized weights (in
    input order); `ordered`: each expert's inputs grouped in a random order of its own (act-order)."""
    orders = [torch.randperm(k, generator=g) if ordered else None for _ in range(e)]
    ws = [quantize(torch.randn(rows, k, generator=g) * 0.1, bits, group, False, o) for o in orders]
    packed = torch.stack([pack_int32(w.q.t(), bits, dim=0) for w in ws])
    scales, zeros = (
        torch.stack([t.t().contiguous() for t in ts]) for ts in zip(*((w.scale, w.zero) for w in ws))
    )
    gsize = k if group < 0 else group
    order = torch.stack([o for o in orders if o is not None]).int() if ordered else None
    quant = WeightQuant(scales, gsize, zeros, bits, order=order)
    return packed, quant, torch.stack([w.dequantize() for w in ws])


def _held_in(quant: WeightQuant, dtype: torch.dtype) -> WeightQuant:
    """`quant` with its scales and zeros in `dtype` (as a model of that dtype holds them)."""
    assert quant.zeros is not None
    return quant._replace(scales=quant.scales.to(dtype), zeros=quant.zeros.to(dtype))


def _dequantize(packed: torch.Tensor, quant: WeightQuant, bits: int) -> torch.Tensor:
    """Stacked packed experts [E, K / P, rows] as float32 weights [E, rows, K] (in input order), by the
    layout's formula."""
    from gapless.model.quant.int4_layouts import unpack_int32

    assert quant.zeros is not None
    out = []
    for e in range(packed.shape[0]):
        q = unpack_int32(packed[e], bits, dim=0).float()  # [K, rows]
        s, z = (t[e].float().repeat_interleave(quant.group, dim=0) for t in (quant.scales, quant.zeros))
        w = ((q - z) * s).t()  # (act-order: its columns in the expert's order, put back in the inputs')
        out.append(w if quant.order is None else torch.empty_like(w).index_copy_(1, quant.order[e].long(), w))
    return torch.stack(out)


def _zero_adapters(experts: int, hidden: int, inter: int) -> object:
    """An `ExpertLoRA` whose adapters are all zero (so the adapter path's result is the plain one's), as
    `gapless.testing.triton_compile` builds it."""
    from gapless.lora.table import ExpertLoRA

    shapes = {"gate_up_proj": (hidden, 2 * inter), "down_proj": (inter, hidden)}
    tables = {
        k: (torch.zeros(2, experts, 8, i), torch.zeros(2, experts, o, 8)) for k, (i, o) in shapes.items()
    }
    table = SimpleNamespace(kernel=True, token_slots=torch.tensor([0, -1, 1, 0, -1, 1, 0, 0, -1]))
    return ExpertLoRA(table, tables)  # type: ignore[arg-type]  # a stand-in for LoRATable


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the interpreter's run; on a GPU the cuda model test runs the kernel"
)
@pytest.mark.parametrize(
    ("bits", "group", "inter", "ordered"),
    [(4, 16, 48, False), (4, -1, 32, False), (8, 32, 64, False), (4, 16, 32, True)],
)
def test_fused_experts_over_int_weights_equal_the_dequantized_reference(bits, group, inter, ordered):
    """The grouped GEMM over packed experts (each tile unpacked, its group's zero subtracted and scale
    applied) equals the per-expert torch loop over the dequantized weights, on the plain path and the
    adapter path's (each GEMM's output whole); `ordered`: gate/up's inputs in each expert's act-order,
    each K step's columns of x gathered in it."""
    from gapless.model.moe_triton import fused_experts

    g = torch.Generator().manual_seed(bits + inter)
    tokens, e, h = 9, 4, 64
    x = torch.randn(tokens, h, generator=g)
    q13, s13, w13 = _packed_experts(g, e, 2 * inter, h, bits, group, ordered)
    q2, s2, w2 = _packed_experts(g, e, h, inter, bits, group)
    weights, ids = route(torch.randn(tokens, e, generator=g), 2, True, False)
    want = reference_experts(x, w13, w2, weights, ids)
    torch.testing.assert_close(fused_experts(x, q13, q2, weights, ids, scales=(s13, s2)), want)
    lora = _zero_adapters(e, h, inter)
    torch.testing.assert_close(fused_experts(x, q13, q2, weights, ids, lora, (s13, s2)), want)
    # bf16 activations, scales and zeros held in bf16 (as a bf16 model holds them): the reference's
    # weights from the same rounded scales, the sums within bf16's rounding
    half = [_held_in(s, torch.bfloat16) for s in (s13, s2)]
    w13h, w2h = (_dequantize(q, s, bits) for q, s in ((q13, half[0]), (q2, half[1])))
    got = fused_experts(x.bfloat16(), q13, q2, weights.bfloat16(), ids, scales=(half[0], half[1]))
    assert got.dtype == torch.bfloat16
    want = reference_experts(x, w13h, w2h, weights, ids)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the interpreter's run; on a GPU the cuda model test runs the kernel"
)
def test_fused_experts_over_a_codebooks_weights_equal_the_dequantized_reference():
    """Experts whose values index a codebook (IQ4's levels; `WeightQuant.levels`, no zeros) through the
    grouped GEMM: the per-expert torch loop over `levels[q] * scale`, float32 and bfloat16."""
    from gapless.model.moe_triton import fused_experts
    from gapless.model.quant.gguf_iq import levels

    g = torch.Generator().manual_seed(5)
    tokens, e, h, inter, table = 9, 4, 64, 32, levels()

    def experts(rows: int, k: int) -> tuple[torch.Tensor, WeightQuant, torch.Tensor]:
        q = torch.randint(0, 16, (e, rows, k), generator=g)
        scale = (torch.rand(e, rows, k // 32, generator=g) / 1000).bfloat16().float()  # (as bf16 holds it)
        w = table[q] * scale.repeat_interleave(32, dim=2)
        packed = torch.stack([pack_int32(x.t(), 4, dim=0) for x in q])
        return packed, WeightQuant(scale.transpose(1, 2).contiguous(), 32, None, 4, table), w

    x = torch.randn(tokens, h, generator=g)
    (q13, s13, w13), (q2, s2, w2) = experts(2 * inter, h), experts(h, inter)
    weights, ids = route(torch.randn(tokens, e, generator=g), 2, True, False)
    want = reference_experts(x, w13, w2, weights, ids)
    torch.testing.assert_close(fused_experts(x, q13, q2, weights, ids, scales=(s13, s2)), want)
    half = tuple(s._replace(scales=s.scales.bfloat16()) for s in (s13, s2))
    got = fused_experts(x.bfloat16(), q13, q2, weights.bfloat16(), ids, scales=half)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


@pytest.mark.parametrize("layout", ["gptq", "awq", "compressed-tensors", "int-quantized"])
def test_tensor_parallel_ranks_hold_their_experts_pieces(ckpt_factory, tmp_path, layout):
    """A mixture's int4 checkpoint built as rank r of 2: each rank's experts, dequantized, are its gate/up
    rows and down columns (whole groups) of the whole model's."""
    src = ckpt_factory("qwen3_moe", moe_intermediate_size=64)
    qdir, _ = write_quantized(src, tmp_path, layout, bits=4, group=16, sym=False)
    whole, ranks = load_as_ranks(qdir)
    experts = [m.model.layers[0].mlp.experts for m in ranks]
    assert all(e.gate_up_proj.shape == (8, 64 // 8, 64) for e in experts)  # (each rank's packed words)
    assert_experts_cut(whole.model.layers[0].mlp.experts, experts)


def test_a_group_a_ranks_cut_would_split_is_refused_in_one_line(ckpt_factory, tmp_path, monkeypatch):
    """96 inputs of each expert's down projection in three groups of 32: two ranks cannot each hold whole
    groups."""
    src = ckpt_factory("qwen3_moe", moe_intermediate_size=96)
    qdir, _ = write_quantized(src, tmp_path, "gptq", bits=4, group=32, sym=False)
    monkeypatch.setattr(parallel, "_current", parallel.TPGroup(rank=0, size=2))
    with pytest.raises(QuantFormatError) as e:
        loader.load_model(qdir, torch.float32, CPU)
    msg = str(e.value)
    assert "\n" not in msg and "down's 3 groups of 32 inputs do not split over 2 ranks" in msg, msg


def test_one_group_a_row_splits_as_per_channel(ckpt_factory, tmp_path):
    """32 inputs of each expert's down projection in one group of 32 (or per channel, int8 rows): each of
    two ranks holds its columns with the row's scale and zero, exactly its piece of the whole layer."""
    src = ckpt_factory("qwen3_moe")
    for group in (32, -1):
        qdir, _ = write_quantized(src, tmp_path / str(group), "gptq", bits=4, group=group, sym=False)
        whole, ranks = load_as_ranks(qdir)
        experts = [m.model.layers[0].mlp.experts for m in ranks]
        assert all(e.int_quant is not None and e.int_quant[1].group == 16 for e in experts)
        assert_experts_cut(whole.model.layers[0].mlp.experts, experts)


@pytest.mark.parametrize(
    ("layout", "tensor", "says"),
    [
        ("gptq", "scales", "with scales (64, 1) and zeros (64, 2): not groups of 16"),
        ("compressed-tensors", "weight_packed", "expert 3 down weight (64, 16) does not fit (64, 32)"),
        ("awq", None, "the awq checkpoint lacks qweight"),
    ],
)
def test_a_malformed_expert_tensor_is_refused_in_one_line(ckpt_factory, tmp_path, layout, tensor, says):
    """An expert's scales of the wrong shape, a packed weight for fewer inputs, a missing weight: each
    refused in one line naming the expert's module."""
    qdir, _ = write_quantized(ckpt_factory("qwen3_moe"), tmp_path, layout, bits=4, group=16, sym=False)
    tensors = load_file(str(qdir / "model.safetensors"))
    prefix = "model.layers.0.mlp.experts.3.down_proj"
    if tensor == "scales":  # [K / G, N] = [2, 64] -> [1, 64]
        tensors[f"{prefix}.scales"] = tensors[f"{prefix}.scales"][:1].contiguous()
    elif tensor == "weight_packed":  # [64, 32 / 8] -> half the inputs
        tensors[f"{prefix}.weight_packed"] = tensors[f"{prefix}.weight_packed"][:, :2].contiguous()
        tensors[f"{prefix}.weight_scale"] = tensors[f"{prefix}.weight_scale"][:, :1].contiguous()
        tensors[f"{prefix}.weight_zero_point"] = tensors[f"{prefix}.weight_zero_point"][:, :1].contiguous()
        tensors[f"{prefix}.weight_shape"] = torch.tensor([64, 16])
    else:
        del tensors[f"{prefix}.qweight"]
    save_file(tensors, str(qdir / "model.safetensors"))
    with pytest.raises(QuantFormatError) as e:
        loader.load_model(qdir, torch.float32, CPU)
    msg = str(e.value)
    assert "\n" not in msg and "model.layers.0.mlp.experts" in msg and says in msg, msg


@pytest.mark.slow  # (22 sm_90 compiles, ~20 s)
def test_int_experts_compile_for_sm90():
    """The grouped GEMM's int4 and int8 variants (plain and adapter paths, both half-precision dtypes, a
    GGUF file's experts under bfloat16: 4-bit g32 gate/up, 8-bit g16 down, float16 zeros, and IQ4's
    codebook experts: 24 specializations with the adapters' own kernels, and the sort by expert's kernel
    once a case: 8) compile for sm_90 (`gapless.testing.triton_compile`), none failing."""
    built = compile_cases("moe", " int")
    if built is None:
        pytest.skip("this triton has no NVIDIA backend to compile with")
    assert built.kernels[:3] == ["_align_kernel", "_grouped_gemm_kernel", "_lora_expand_kernel"], built
    assert built.compilations == 24 + 8 and not built.failed, built


@pytest.mark.parametrize(("arch", "layout"), [("qwen3_moe", "gptq"), ("mixtral", "compressed-tensors")])
def test_act_order_experts_give_transformers_tokens(ckpt_factory, tmp_path, arch, layout):
    """Experts with act-order (GPTQ's `desc_act`, compressed-tensors' `actorder: group`: each expert's
    inputs grouped in its own order, gate and up sharing x's): down's order is taken onto gate's and up's
    rows at load (down then plain), gate/up's kept for the grouped GEMM to gather x by; greedy tokens equal
    transformers' on the dequantized weights, on the CPU's path and (interpreted) on the grouped GEMM."""
    qdir, refdir = write_quantized(ckpt_factory(arch), tmp_path, layout, group=16, act_order=True)
    model = loader.load_model(qdir, torch.float32, CPU)
    experts = experts_of(model)
    assert experts
    for m in experts:
        assert m.int_quant is not None and m.inter_order is not None
        order13, order2 = m.int_quant[0].order, m.int_quant[1].order
        assert order2 is None and order13 is not None and order13.dtype == torch.int32
        assert len({tuple(o.tolist()) for o in order13}) == m.num_experts  # (each expert its own)
        assert not torch.equal(m.inter_order[0], torch.arange(m.inter))
    prompts = make_prompts(1000, n=3, max_len=30, shared_prefix=6)
    ours = _greedy(qdir, prompts)
    hf = load_hf_model(refdir)
    notes = [check_greedy(o, hf_greedy(hf, p, MAX_NEW)) for o, p in zip(ours, prompts)]
    assert sum(n is not None for n in notes) <= 1, notes
    if arch == "qwen3_moe":
        assert _greedy(qdir, prompts[:2], fused=True) == ours[:2]


def test_act_order_experts_cut_for_tensor_parallelism(ckpt_factory, tmp_path):
    """Two ranks of an act-order mixture: down plain after the reorder, so each rank holds whole groups of
    the reordered intermediate, its gate/up rows the ones that write them; the ranks' experts summed give
    the whole layer's."""
    src = ckpt_factory("qwen3_moe", moe_intermediate_size=64)
    qdir, _ = write_quantized(src, tmp_path, "gptq", bits=4, group=16, sym=False, act_order=True)
    whole, ranks = load_as_ranks(qdir)
    experts = [m.model.layers[0].mlp.experts for m in ranks]
    full = whole.model.layers[0].mlp.experts
    assert_experts_cut(full, experts)
    assert full.cpu_weights is not None and all(e.cpu_weights is not None for e in experts)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, full.cpu_weights[0].shape[2], generator=g)
    weights, ids = route(torch.randn(7, full.num_experts, generator=g), 2, True, False)
    summed = sum(reference_experts(x, *e.cpu_weights, weights, ids) for e in experts if e.cpu_weights)
    torch.testing.assert_close(summed, reference_experts(x, *full.cpu_weights, weights, ids))


def test_act_order_experts_whose_gate_and_up_orders_differ_are_refused(ckpt_factory, tmp_path):
    """The grouped GEMM gathers x once for an expert's gate and up: an expert whose two g_idx order x
    differently is refused in one line naming it."""
    qdir, _ = write_quantized(ckpt_factory("qwen3_moe"), tmp_path, "gptq", group=16, act_order=True)
    tensors = load_file(str(qdir / "model.safetensors"))
    name = "model.layers.0.mlp.experts.3.up_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()  # (still 16 inputs a group, another order)
    save_file(tensors, str(qdir / "model.safetensors"))
    with pytest.raises(QuantFormatError) as e:
        loader.load_model(qdir, torch.float32, CPU)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("model.layers.0.mlp.experts: expert 3's gate and up"), msg
