"""LoRA under tensor parallelism: each rank's A and B are the whole adapter cut as the layer it adapts is
cut (the weight loader's own cut is the reference, GQA and replicated KV heads included), and two ranks
on the CPU (gloo) give the greedy tokens of transformers + peft for rows of three adapters and the base
mixed."""

from __future__ import annotations

import os

import pytest
import torch

from gapless import LLM
from gapless.config import EngineConfig
from gapless.lora.adapter import MLP_LAYERS, layer_shapes, load_adapter
from gapless.lora.table import LoRALoad, LoRATable
from gapless.model import parallel
from gapless.model.config import load_model_config
from gapless.model.decoder import CausalLM
from gapless.model.layers import MergedColumnParallelLinear
from gapless.testing.lora import ATTENTION, MLP, make_adapter
from gapless.testing.server import descendants
from tests.lora.test_lora_parity import _check, _generate, _names, family  # noqa: F401  # the fixture

pytest.importorskip("peft", reason="the reference is transformers + peft")


def _whole_delta(weights, i: int, name: str, shape) -> torch.Tensor:
    """The dense delta [out, in] the adapter adds to layer `i`'s `name` on one rank holding it all."""
    w = torch.zeros(shape.out_features, shape.in_features)
    for d in weights.deltas:
        if (d.layer, d.name) == (i, name):
            w[d.row : d.row + d.b.shape[0]] += d.b @ d.a
    return w


def _cut_like_weight(linear, whole: torch.Tensor, local_shape: tuple[int, int]) -> torch.Tensor:
    """`whole` cut by the layer's own weight loader (how its checkpoint weight reaches this rank)."""
    local = torch.zeros(local_shape)
    if isinstance(linear, MergedColumnParallelLinear):
        for shard, (off, n) in linear.checkpoint_offsets.items():
            linear.load_shard(local, whole[off : off + n], shard)
    else:
        linear.load_shard(local, whole)
    return local


def _rank_table(cfg, rank: int, size: int, path) -> LoRATable:
    """Rank `rank` of `size`'s model and its LoRA table, adapter `path` loaded into slot 1."""
    parallel.use(parallel.TPGroup(rank, size))
    try:
        model = CausalLM(cfg)
    finally:
        parallel.use(parallel.SINGLE)
    table = LoRATable(model, cfg, 2, 8, 2, 4, torch.float32, torch.device("cpu"))
    table.load(LoRALoad(1, 7, "a", str(path)))
    return table


@pytest.mark.parametrize(("arch", "size"), [("qwen3", 2), ("mistral", 2), ("llama", 4), ("phi3", 2)])
def test_each_ranks_slices_are_the_adapter_cut_like_the_layer(ckpt_factory, tmp_path, arch, size):
    """For every rank, B_rank A_rank of every adapted layer equals the whole adapter's delta cut by that
    layer's weight loader: q/k/v and gate/up by output rows (Mistral's one KV head, and Llama's two over
    four ranks, replicated), o and down by input columns (so the ranks' partial deltas sum to the whole);
    Phi-3-style fused names land in the same places as separate ones."""
    base = ckpt_factory(arch)
    path = make_adapter(base, tmp_path / "a", ATTENTION + MLP, r=4, seed=3)
    cfg = load_model_config(str(base))
    whole = load_adapter("a", path, cfg, 8)
    shapes = layer_shapes(cfg)
    sums: dict[tuple[int, str], torch.Tensor] = {}
    for rank in range(size):
        table = _rank_table(cfg, rank, size, path)
        for (i, name), lora in table.layers.items():
            got = lora.b[1] @ lora.a[1]
            delta = _whole_delta(whole, i, name, shapes[name])
            want = _cut_like_weight(table.linears[(i, name)], delta, tuple(got.shape))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {i}.{name}")
            if name in ("o_proj", "down_proj"):  # the all-reduce of the partial deltas gives the whole
                x = torch.randn(shapes[name].in_features, generator=torch.Generator().manual_seed(i))
                part = lora.b[1] @ (lora.a[1] @ parallel.TPGroup(rank, size).part(x, size))
                sums[(i, name)] = sums.get((i, name), 0) + part
                if rank == size - 1:
                    torch.testing.assert_close(sums[(i, name)], delta @ x, rtol=1e-4, atol=1e-5)
        assert any(n in MLP_LAYERS for _, n in table.layers), "the MLP was meant to be adapted"
    assert sums, "row-parallel layers were meant to be checked"


def test_tensor_parallel_lora_is_accepted():
    """The start-up check no longer refuses LoRA with more than one rank."""
    cfg = EngineConfig(model="x", enable_lora=True, tensor_parallel_size=2)
    assert cfg.tensor_parallel_size == 2 and cfg.enable_lora


@pytest.mark.slow  # (two tensor-parallel rank processes, ~7 s)
def test_two_ranks_mixed_adapters_equal_peft(family):  # noqa: F811  # the imported fixture
    """Qwen3 (4 query heads over 2 KV heads: one KV head a rank) on two ranks: every row of a batch of
    three adapters and the base equals PEFT's; the adapters' loads and the slot vector reach both ranks
    with the broadcast batches, and fewer slots than adapters make slots reload on both."""
    base, loras, prompts, refs = family("qwen3")
    before = descendants(os.getpid())
    options = dict(device="cpu", dtype="float32", enable_lora=True, kv_cache_tokens=4096, max_loras=2)
    with LLM(str(base), tensor_parallel_size=2, chunked_prefill_size=16, **options) as llm:
        assert len(descendants(os.getpid()) - before) == 2  # one process per rank
        names = _names(len(prompts))
        _check(_generate(llm, prompts, loras, names), refs, names)
        names = names[::-1]
        _check(_generate(llm, prompts, loras, names), refs, names)
        llm.check_integrity()


def test_each_ranks_expert_slices_are_the_adapter_cut_like_the_experts(ckpt_factory, tmp_path):
    """A mixture's experts on two ranks: every expert's gate/up B_rank A_rank equals the whole adapter's
    delta cut by the experts' own weight loader (gate and up rows by width), and the down deltas' partial
    sums over the ranks give the whole."""
    base = ckpt_factory("qwen3_moe")
    path = make_adapter(
        base, tmp_path / "a", ["q_proj"], r=4, seed=3, parameters=["gate_up_proj", "down_proj"]
    )
    cfg = load_model_config(str(base))
    whole = {
        (x.layer, x.name): torch.einsum("eor,eri->eoi", x.b, x.a)
        for x in load_adapter("a", path, cfg, 8).experts
    }
    assert {name for _, name in whole} == {"gate_up_proj", "down_proj"}
    size, sums = 2, {}
    for rank in range(size):
        tp, table = parallel.TPGroup(rank, size), _rank_table(cfg, rank, size, path)
        for i, lora in table.experts.items():
            experts = table.expert_modules[i]
            a, b = (t[1] for t in lora.weights["gate_up_proj"])
            got = torch.einsum("eor,eri->eoi", b, a)
            want = torch.nn.Parameter(torch.zeros_like(got))
            delta, inter = whole[(i, "gate_up_proj")], cfg.moe_intermediate_size
            for e in range(cfg.num_experts):
                experts.load_shard(want, delta[e, :inter], (e, "gate"))
                experts.load_shard(want, delta[e, inter:], (e, "up"))
            torch.testing.assert_close(got, want.data, rtol=1e-5, atol=1e-6, msg=f"rank {rank} layer {i}")
            a, b = (t[1] for t in lora.weights["down_proj"])
            x = torch.randn(cfg.num_experts, inter, generator=torch.Generator().manual_seed(i))
            part = torch.einsum("eor,eri,ei->eo", b, a, tp.part(x, size, dim=1))
            sums[i] = sums.get(i, 0) + part
            if rank == size - 1:
                want_down = torch.einsum("eoi,ei->eo", whole[(i, "down_proj")], x)
                torch.testing.assert_close(sums[i], want_down, rtol=1e-4, atol=1e-5)
    assert sums, "the experts were meant to be adapted"
