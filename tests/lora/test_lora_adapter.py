"""Adapters are read onto gapless's fused layers, and bad ones are refused by name: a rank above the
limit, target modules the model lacks, another base model's shapes, a missing file, LoRA off, a dense
MLP name on a mixture layer (the experts: tests/lora/test_lora_moe.py). The host's slot bookkeeping keeps
a batch's adapters resident and reuses the least recently used slot."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from gapless import LLM, LoRARequest, SamplingParams
from gapless.lora.adapter import LoRAError, load_adapter
from gapless.lora.slots import SlotAssigner
from gapless.model.config import load_model_config
from gapless.testing import make_checkpoint
from gapless.testing.lora import ATTENTION, MLP, make_adapter

pytest.importorskip("peft", reason="the adapters are made with peft")


@pytest.fixture(scope="module")
def llama(ckpt_factory, tmp_path_factory):
    base = ckpt_factory("llama")
    out = tmp_path_factory.mktemp("llama-adapters")
    return base, make_adapter(base, out / "all", ATTENTION + MLP, r=8, alpha=16, seed=1)


def test_layout_on_fused_layers(llama):
    """q/k/v land in their rank blocks and output rows of qkv_proj, B scaled by alpha / r."""
    base, path = llama
    cfg = load_model_config(base)
    w = load_adapter("all", path, cfg, 64)
    from safetensors.torch import load_file

    raw = load_file(str(path / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.1.self_attn.k_proj.lora_{}.weight"
    k = next(d for d in w.deltas if (d.layer, d.name, d.block) == (1, "qkv_proj", 1))
    assert k.row == cfg.q_size and k.b.shape == (cfg.kv_size, 8)
    torch.testing.assert_close(k.a, raw[key.format("A")])
    torch.testing.assert_close(k.b, raw[key.format("B")] * 2.0)  # alpha 16 / r 8
    assert {(d.name, d.block) for d in w.deltas if d.layer == 0} == {
        ("qkv_proj", 0), ("qkv_proj", 1), ("qkv_proj", 2), ("o_proj", 0),
        ("gate_up_proj", 0), ("gate_up_proj", 1), ("down_proj", 0),
    }  # fmt: skip


def _copy(path, tmp_path, name="bad"):
    return shutil.copytree(path, tmp_path / name)


def _edit_config(path, **changes):
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(cfg))


def test_refusals_name_what_is_wrong(llama, tmp_path, ckpt_factory):
    base, path = llama
    cfg = load_model_config(base)
    with pytest.raises(LoRAError, match=r"rank 8 is above max_lora_rank=4 \(--max-lora-rank\)"):
        load_adapter("all", path, cfg, 4)
    lacks = _copy(path, tmp_path, "lacks")
    _edit_config(lacks, target_modules=["q_proj", "c_attn"])
    with pytest.raises(LoRAError, match=r"target modules \['c_attn'\] are not in the model"):
        load_adapter("lacks", lacks, cfg, 64)
    missing = _copy(path, tmp_path, "missing")
    (missing / "adapter_model.safetensors").unlink()
    with pytest.raises(LoRAError, match="adapter_model.safetensors is missing"):
        load_adapter("missing", missing, cfg, 64)
    with pytest.raises(LoRAError, match="is not a directory"):
        load_adapter("nowhere", tmp_path / "nowhere", cfg, 64)
    short = _copy(path, tmp_path, "short")
    weights = short / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    with pytest.raises(LoRAError, match=r"'short': .*adapter_model.safetensors is cut short: [\d,]+ bytes"):
        load_adapter("short", short, cfg, 64)
    dora = _copy(path, tmp_path, "dora")
    _edit_config(dora, use_dora=True)
    with pytest.raises(LoRAError, match="DoRA"):
        load_adapter("dora", dora, cfg, 64)
    # an adapter of another base: a wider MLP
    other = make_checkpoint(tmp_path / "wide", "llama", intermediate_size=96)
    wide = make_adapter(other, tmp_path / "wide-adapter", ["down_proj"], r=4)
    with pytest.raises(LoRAError, match=r"layers\.0\.down_proj has A \(4, 96\).*another base model"):
        load_adapter("wide", wide, cfg, 64)


def test_moe_attention_served_dense_mlp_names_refused(ckpt_factory, tmp_path):
    """A MoE model's attention adapts; a dense-MLP module name on a mixture layer is refused by name (its
    experts are adapted as experts: tests/lora/test_lora_moe.py)."""
    from safetensors.torch import load_file, save_file

    base = ckpt_factory("qwen3_moe")
    cfg = load_model_config(base)
    attn = make_adapter(base, tmp_path / "attn", ["q_proj", "v_proj"], r=4)
    assert {d.name for d in load_adapter("attn", attn, cfg, 64).deltas} == {"qkv_proj"}
    weights = load_file(str(attn / "adapter_model.safetensors"))
    bad = _copy(attn, tmp_path, "mlp")
    a, b = torch.zeros(4, cfg.hidden_size), torch.zeros(8, 4)
    prefix = "base_model.model.model.layers.0.mlp.gate_proj"
    more = {f"{prefix}.lora_A.weight": a, f"{prefix}.lora_B.weight": b}
    save_file({**weights, **more}, str(bad / "adapter_model.safetensors"))
    with pytest.raises(LoRAError, match="adapts the MLP of layer 0, a mixture of experts"):
        load_adapter("bad", bad, cfg, 64)


def test_engine_refuses_before_queueing(llama, tmp_path):
    base, path = llama
    lora = LoRARequest("all", 1, str(path))
    params = SamplingParams(max_tokens=2)
    with LLM(str(base), device="cpu", kv_cache_tokens=512) as llm:
        with pytest.raises(ValueError, match=r"LoRA is off; start with enable_lora=True \(--enable-lora\)"):
            llm.generate([[1, 2, 3]], params, use_tqdm=False, lora_request=lora)
    with LLM(str(base), device="cpu", kv_cache_tokens=512, enable_lora=True, max_lora_rank=4) as llm:
        with pytest.raises(LoRAError, match="above max_lora_rank=4"):
            llm.generate([[1, 2, 3]], params, use_tqdm=False, lora_request=lora)
        assert not llm.engine.has_unfinished()
    with pytest.raises(ValueError, match="lora_int_id=0"):
        LoRARequest("x", 0, str(path))


def test_slot_assigner_lru():
    a, b, c = (LoRARequest(n, i, f"/{n}") for i, n in enumerate("abc", start=1))
    s = SlotAssigner(2)
    assert s.assign([None, None], [1, 1]) is None
    first = s.assign([a, None, b], [2, 1, 1])
    assert first is not None
    assert first.token_slots.tolist() == [0, 0, -1, 1] and [ld.slot for ld in first.loads] == [0, 1]
    assert s.assign([b], [1]).loads == []  # resident: nothing to load; a is now least recently used
    third = s.assign([c, b], [1, 1])
    assert [(ld.lora_id, ld.slot) for ld in third.loads] == [(3, 0)]  # a's slot, not b's (in this batch)
    assert s.admits(b, [b, c]) and not s.admits(a, [b, c]) and s.admits(None, [b, c])
    with pytest.raises(RuntimeError, match="above max_loras=2"):
        s.assign([a, b, c], [1, 1, 1])
