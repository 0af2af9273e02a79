"""A quantized checkpoint's layers never hold their float weights (`layers.deferred_weights`): the model
is built with placeholder weights, a float tensor gives its layer memory as it loads (`layers.materialize`),
and a quantized layer's form replaces its placeholder, so a quantized model loads in about its own size,
not the float model's. Counted here as the bytes the load gives deferred weights; on a GPU, the load's
peak against the float model's weights."""

from __future__ import annotations

import weakref

import pytest
import torch
from safetensors import safe_open

from gapless.model import loader
from gapless.model.config import load_model_config
from gapless.model.decoder import CausalLM
from gapless.model.layers import ReplicatedLinear, _Linear, is_placeholder
from gapless.model.moe import Experts
from gapless.testing.fp8_checkpoints import write_fp8_checkpoint
from gapless.testing.quant_checkpoints import write_quantized

CPU = torch.device("cpu")


def _weights(model: torch.nn.Module, routers_only: bool = False) -> int:
    """Bytes of the float model's deferred weights (every linear layer's and the experts'), or of its
    routers' alone, which no quantized checkpoint quantizes."""
    total = 0
    for module in model.modules():
        if isinstance(module, Experts) and not routers_only:
            total += sum(p.numel() * 4 for p in (module.gate_up_proj, module.down_proj))
        elif isinstance(module, _Linear) and (isinstance(module, ReplicatedLinear) or not routers_only):
            total += module.weight.numel() * 4  # (float32)
    return total


@pytest.fixture
def materialized(monkeypatch):
    """The bytes the loader gives deferred weights, counted as it gives them."""
    given: list[int] = []
    real = loader.materialize

    def counting(param):
        if is_placeholder(param):
            given.append(param.numel() * param.element_size())
        real(param)

    monkeypatch.setattr(loader, "materialize", counting)
    return given


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("layout", ["awq", "gptq-int8", "fp8", "dummy-awq"])
def test_a_quantized_checkpoint_never_makes_its_float_weights(
    ckpt_factory, tmp_path, materialized, arch, layout
):
    """Loaded from a float checkpoint, every linear layer's and expert's weight is given its memory as it
    loads; from a quantized one (int4, int8, FP8 blocks; random weights in its form alike) only the
    layers it leaves in float are (a mixture's routers)."""
    src = ckpt_factory(arch)
    if layout == "fp8":
        path = write_fp8_checkpoint(src, tmp_path / "q", layout)[0]
    else:
        int8 = layout == "gptq-int8"
        fmt = "gptq" if int8 else "awq"
        path = write_quantized(src, tmp_path, fmt, bits=8 if int8 else 4, group=32, sym=int8)[0]
    with torch.device("meta"):  # (the shapes: a loaded model's CPU GEMMs repack its float weights)
        shapes = CausalLM(load_model_config(src))
    loader.load_model(src, torch.float32, CPU)
    assert sum(materialized) == _weights(shapes) > 0  # a float checkpoint: every deferred weight
    materialized.clear()
    model = loader.load_model(path, torch.float32, CPU, dummy=layout.startswith("dummy"))
    assert sum(materialized) == _weights(shapes, routers_only=True)  # (a mixture's routers)
    assert not any(is_placeholder(p) for p in model.parameters())


def test_a_weight_no_tensor_fills_is_refused(ckpt_factory, tmp_path):
    """A layer whose placeholder nothing replaced (neither a float tensor nor a quantized form) is named."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = ckpt_factory("qwen3")
    dst = tmp_path / "partial"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    del tensors["model.layers.0.self_attn.o_proj.weight"]
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="o_proj.weight"):
        loader.load_model(dst, torch.float32, CPU)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU's peak memory (the CPU test counts bytes)")
def test_an_int4_load_peaks_below_its_float_weights_on_a_gpu(ckpt_factory, tmp_path, int4_reference_path):
    """Beside what every load holds (embeddings, head, norms, RoPE's table), the load's peak on the GPU
    holds the int4 layers and a layer's unpacking, well under the float weights it never makes (it held
    all of them before deferred weights). One copy of each layer, the Triton GEMM's (`auto` adds
    tinygemm's for decode)."""
    src = ckpt_factory("qwen3", hidden_size=512, intermediate_size=2048, num_hidden_layers=8)
    path = write_quantized(src, tmp_path, "awq", bits=4, group=32)[0]
    dev = torch.device("cuda")
    with torch.device("meta"):
        shapes = CausalLM(load_model_config(src))
    float_bytes = _weights(shapes) // 2  # (bfloat16)
    # what the load holds in any case: the embeddings, head, norms (bfloat16) and RoPE's table (float32)
    rest = sum(p.numel() * 2 for p in shapes.parameters()) - float_bytes
    rest += sum(b.numel() * b.element_size() for b in shapes.buffers())
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    model = loader.load_model(path, torch.bfloat16, dev)
    assert torch.cuda.max_memory_allocated(dev) - base < rest + 0.6 * float_bytes
    del model


@pytest.mark.parametrize("dummy", [False, True])
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_online_fp8_rounds_each_layer_as_it_loads(ckpt_factory, materialized, monkeypatch, arch, dummy):
    """`--quantization fp8` of a float checkpoint (stored layer by layer, as checkpoints are) rounds each
    layer to e4m3 as its last float tensor loads: the float weights held at once never pass one decoder
    layer's (and the routers', which stay float), where rounding at the end held the whole float model.
    Random weights (`--load-format dummy`) are made and rounded the same way."""
    from gapless.model.quant import fp8

    src = ckpt_factory(arch)
    with torch.device("meta"):
        shapes = CausalLM(load_model_config(src))
    routers = _weights(shapes, routers_only=True)
    layer = max(_weights(m) for m in shapes.model.layers)
    live, peak = [0], [0]
    real_finish = fp8.finish_module

    rounded: list[weakref.ref] = []  # the float weights rounding replaced: freed at once, none kept

    def finishing(module, spec):
        held = (module.gate_up_proj, module.down_proj) if isinstance(module, Experts) else (module.weight,)
        live[0] -= sum(p.numel() * p.element_size() for p in held)
        rounded.extend(weakref.ref(p) for p in held)
        real_finish(module, spec)

    monkeypatch.setattr(fp8, "finish_module", finishing)
    real_materialize = loader.materialize

    def counting(param):
        if is_placeholder(param):
            live[0] += param.numel() * param.element_size()
            peak[0] = max(peak[0], live[0])
            assert all(r() is None for r in rounded), "a rounded layer's float weight is still held"
        real_materialize(param)

    monkeypatch.setattr(loader, "materialize", counting)
    model = loader.load_model(src, torch.float32, CPU, quantization="fp8", dummy=dummy)
    assert rounded
    assert live[0] == routers and 0 < peak[0] <= layer + routers < _weights(shapes)
    assert all(
        p.dtype == torch.float8_e4m3fn
        for m in model.modules()
        if isinstance(m, Experts)
        for p in (m.gate_up_proj, m.down_proj)
    )


@pytest.mark.parametrize(
    ("arch", "layout", "bits", "sym", "act_order"),
    [
        ("qwen3", "awq", 4, False, False),
        ("phi3", "gptq", 4, True, True),  # (Phi-3 stores q/k/v and gate/up fused)
        ("qwen3_moe", "compressed-tensors", 4, True, False),
        ("llama", "int-quantized", 8, False, False),
    ],
)
def test_an_int4_checkpoint_installs_each_layer_as_it_loads(
    ckpt_factory, tmp_path, monkeypatch, arch, layout, bits, sym, act_order
):
    """Each layer is installed as the last tensor of its modules is read, so the host holds at most a
    decoder layer's packed tensors (it held the whole checkpoint's until the end before), and none is
    left to install after the last tensor."""
    from gapless.model.int4_loading import Int4Layers

    path = write_quantized(
        ckpt_factory(arch), tmp_path, layout, bits=bits, group=32, sym=sym, act_order=act_order
    )[0]
    held, left = [0], []
    real_install, real_finish = Int4Layers._install, Int4Layers.finish

    def installing(self, layer):
        held[0] = max(held[0], len(self.parts))
        real_install(self, layer)

    def finishing(self):
        left.append(len(self.layers))
        return real_finish(self)

    monkeypatch.setattr(Int4Layers, "_install", installing)
    monkeypatch.setattr(Int4Layers, "finish", finishing)
    loader.load_model(path, torch.float32, CPU)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:  # (a decoder layer's modules)
        first = {n.rsplit(".", 1)[0] for n in f.keys() if n.startswith("model.layers.0.")}
    assert left == [0] and 0 < held[0] <= len(first)
