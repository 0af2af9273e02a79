"""Checkpoints the quantizers themselves write, read by gapless: a tiny llama (hidden 256, so groups of
128 fit; random weights) quantized by llm-compressor's presets (`QuantizationModifier`, no calibration
data: round to nearest) and by NVIDIA ModelOpt's configs (`mtq.quantize` over one batch of random tokens,
`export_hf_checkpoint`), each saved as its tool saves it. Beside each, a float checkpoint holding the
weights the tool itself says the file holds: compressed-tensors' `fake_quantize` of llm-compressor's
quantized model; ModelOpt's own `NVFP4QTensor.dequantize` (`MXFP8QTensor.dequantize`) of its exported
tensors (FP8: e4m3 times its per-tensor scale); AMD Quark's `LLMTemplate` schemes
(`export_safetensors`), beside Quark's own fake quantization of each layer's weight.

Both tools pin their own transformers (5.17 for llm-compressor 0.14), so the writing runs in a venv of
its own, the reading in the project's:

    python -m venv /tmp/lcv && /tmp/lcv/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1 \
        nvidia-modelopt==0.47.0
    PYTHONPATH=. .venv/bin/python bench/experiments/quant_writers.py source /tmp/qw/src [qwen3_moe]
    /tmp/lcv/bin/python bench/experiments/quant_writers.py llmcompressor /tmp/qw/src /tmp/qw/out \
        W4A16 W4A16_ASYM W8A16 W8A8 W4A8 W4AFP8 FP8_DYNAMIC FP8_BLOCK NVFP4A16 MXFP4A16 MXFP8 MXFP8A16
    /tmp/lcv/bin/python bench/experiments/quant_writers.py modelopt /tmp/qw/src /tmp/qw/out \
        NVFP4_DEFAULT_CFG FP8_DEFAULT_CFG MXFP8_DEFAULT_CFG
    PYTHONPATH=. .venv/bin/python bench/experiments/quant_writers.py read /tmp/qw/out W4A16 W4A16_ASYM \
        W8A16 W8A8 W4A8 W4AFP8 FP8_DYNAMIC FP8_BLOCK NVFP4A16 MXFP4A16 NVFP4_DEFAULT_CFG FP8_DEFAULT_CFG

Quark (amd-quark 0.13, in a venv of its own: `pip install torch==2.13.0 amd-quark==0.13 transformers
safetensors`; `+kv` with its FP8 KV cache, whose scales `read` checks with `--kv-cache-dtype fp8`):

    /tmp/qv/bin/python bench/experiments/quant_writers.py quark /tmp/qw/src /tmp/qw/quark fp8 fp8+kv \
        ptpc_fp8 int8 uint4_wo_128 uint4_wo_128@order int4_wo_128 int4_wo_128@order \
        uint4_wo_per_channel int4_wo_per_channel mxfp4
    PYTHONPATH=. .venv/bin/python bench/experiments/quant_writers.py read /tmp/qw/quark fp8 fp8+kv ...

`read` loads each on the CPU's reference path (float32, `GAPLESS_INT4_KERNEL=triton`) and prints the
largest difference between each quantized projection's weight as gapless holds it and the reference's
(0: bit for bit), then gapless's greedy tokens against transformers' on the reference (the FP8 rows round
their activations, as the format does, so they may part at a near-tie).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def source(dst: Path, arch: str = "llama") -> None:
    """The float checkpoint the tools quantize: `arch`'s tiny model at hidden 256 (qwen3_moe: its experts
    too, and its second layer a dense MLP)."""
    from gapless.testing.checkpoints import make_checkpoint

    wide = dict(hidden_size=256, intermediate_size=256, head_dim=64)
    extra = dict(moe_intermediate_size=256) if arch == "qwen3_moe" else dict(rope_scaling=None)
    print(make_checkpoint(dst, arch, **wide, **extra))


def _reference(src: Path, rdir: Path, held: dict[str, torch.Tensor]) -> None:
    """The float checkpoint `src` copied to `rdir`, its projections `held` (by weight name) replaced."""
    shutil.copytree(src, rdir, dirs_exist_ok=True)
    tensors = load_file(str(src / "model.safetensors")) | held
    save_file(tensors, str(rdir / "model.safetensors"), metadata={"format": "pt"})


def modelopt(src: Path, out: Path, configs: list[str]) -> None:
    import modelopt
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from modelopt.torch.quantization.qtensor import MXFP8QTensor, NVFP4QTensor
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"modelopt {modelopt.__version__}")
    for config in configs:
        model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
        ids = torch.randint(0, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
        mtq.quantize(model, getattr(mtq, config), lambda m, ids=ids: m(ids))  # (the calibration pass)
        qdir = out / config
        with torch.inference_mode():
            export_hf_checkpoint(model, export_dir=str(qdir))
        AutoTokenizer.from_pretrained(str(src)).save_pretrained(str(qdir))
        tensors, held = load_file(str(qdir / "model.safetensors")), {}
        for k, w in tensors.items():
            if not k.endswith(".weight") or f"{k}_scale" not in tensors:
                continue
            if f"{k}_scale_2" in tensors:  # NVFP4: ModelOpt's own dequantization of its packed codes
                packed = NVFP4QTensor(torch.Size([w.shape[0], 2 * w.shape[1]]), torch.float32, w)
                scales = dict(scale=tensors[f"{k}_scale"], double_scale=tensors[f"{k}_scale_2"])
                held[k] = packed.dequantize(torch.float32, block_sizes={-1: 16}, **scales).float()
            elif tensors[f"{k}_scale"].dtype == torch.uint8:  # MXFP8: ModelOpt's own, its e8m0 scales
                held[k] = MXFP8QTensor(w.shape, torch.float32, w).dequantize(scale=tensors[f"{k}_scale"])
            else:
                held[k] = w.float() * tensors[f"{k}_scale"].float()
        _reference(src, out / f"{config}-reference", held)
        algo = json.loads((qdir / "hf_quant_config.json").read_text())["quantization"]["quant_algo"]
        print(f"{config}: quant_algo {algo}, {len(held)} projections")


def llmcompressor(src: Path, out: Path, schemes: list[str]) -> None:
    import compressed_tensors
    import llmcompressor
    import transformers
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(
        f"llmcompressor {llmcompressor.__version__}, compressed-tensors {compressed_tensors.__version__}, "
        f"transformers {transformers.__version__}"
    )
    for scheme in schemes:
        model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
        oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"]))
        held = {}
        for name, m in model.named_modules():
            weights = getattr(getattr(m, "quantization_scheme", None), "weights", None)
            if weights is None:
                continue
            kw = dict(scale=m.weight_scale, zero_point=getattr(m, "weight_zero_point", None), args=weights)
            if hasattr(m, "weight_global_scale"):
                kw["global_scale"] = m.weight_global_scale
            held[f"{name}.weight"] = fake_quantize(m.weight.detach(), **kw).float()
        qdir, rdir = out / scheme, out / f"{scheme}-reference"
        model.save_pretrained(str(qdir), save_compressed=True)
        AutoTokenizer.from_pretrained(str(src)).save_pretrained(str(qdir))
        _reference(src, rdir, held)
        fmt = json.loads((qdir / "config.json").read_text())["quantization_config"].get("format")
        print(f"{scheme}: {fmt}, {len(held)} projections")


def quark(src: Path, out: Path, schemes: list[str]) -> None:
    """AMD Quark's `LLMTemplate` schemes (a scheme name, `+kv`: with its FP8 KV cache), calibrated on one
    batch of random tokens (a mixture's experts unfused first, as Quark prepares them), exported by
    `export_safetensors` (real_quantized, its default `reorder` packing; a name ending `@order`:
    `pack_method="order"`); the reference holds Quark's own fake quantization of each layer's weight (its
    `weight_quantizer`)."""
    import quark as amd_quark
    import transformers
    from quark.torch import LLMTemplate, ModelQuantizer, export_safetensors
    from quark.torch.utils.llm.model_preparation import preprocess_for_quantization
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"quark {amd_quark.__version__}, transformers {transformers.__version__}")
    for name in schemes:
        scheme, _, kv = name.removesuffix("@order").partition("+")
        model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
        config = LLMTemplate.get(model.config.model_type).get_config(
            scheme=scheme, kv_cache_scheme="fp8" if kv else None
        )
        ids = torch.randint(0, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
        preprocess_for_quantization(model)  # (transformers 5's fused experts as one linear layer each)
        model = ModelQuantizer(config).quantize_model(model, [ids])
        held = {}
        with torch.no_grad():
            for module_name, m in model.named_modules():
                quantizer = getattr(m, "weight_quantizer", None)
                if quantizer is not None and hasattr(m, "weight"):
                    held[f"{module_name}.weight"] = quantizer(m.weight).float().clone()
            pack = "order" if name.endswith("@order") else "reorder"
            export_safetensors(model, str(out / name), pack_method=pack)
        AutoTokenizer.from_pretrained(str(src)).save_pretrained(str(out / name))
        _reference(src, out / f"{name}-reference", held)
        qcfg = json.loads((out / name / "config.json").read_text())["quantization_config"]
        weight = qcfg["global_quant_config"]["weight"]
        print(
            f"{name}: {weight['dtype']} {weight['qscheme']}, kv {qcfg['export']['kv_cache_group']}, "
            f"{len(held)} projections"
        )


def _held(m: torch.nn.Module) -> torch.Tensor | None:
    """A loaded layer's weight as gapless holds it, float32 (int4/int8/NVFP4: dequantized; FP8: e4m3 times
    its scale, per tensor, row or block)."""
    method = getattr(m, "linear_method", None)
    if callable(getattr(method, "dequantized", None)):
        return method.dequantized(torch.float32)
    if not hasattr(m, "weight_scale"):
        return None
    w, s = m.weight.float(), m.weight_scale.float()
    if s.numel() > 1:
        s = s.reshape(s.shape[0], -1)
        s = s.repeat_interleave(w.shape[0] // s.shape[0], 0)
        s = s.repeat_interleave(-(-w.shape[1] // s.shape[1]), 1)[:, : w.shape[1]]
    return w * s


def _experts_held(name: str, m: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A mixture's experts as the CPU's reference path holds them (`Experts.cpu_weights`, dequantized),
    by each expert's weight name; {} for any other module."""
    from gapless.model.moe import Experts

    if not isinstance(m, Experts) or m.cpu_weights is None:
        return {}
    (gate_up, down), inter = m.cpu_weights, m.inter
    held = {}
    for e in range(m.num_experts):
        held[f"{name}.{e}.gate_proj.weight"] = gate_up[e, :inter].float()
        held[f"{name}.{e}.up_proj.weight"] = gate_up[e, inter:].float()
        held[f"{name}.{e}.down_proj.weight"] = down[e].float()
    return held


def read(out: Path, schemes: list[str]) -> None:
    os.environ["GAPLESS_INT4_KERNEL"] = "triton"  # (the reference path: float32, exact)
    from transformers import AutoModelForCausalLM

    from gapless import LLM, SamplingParams
    from gapless.model import loader
    from gapless.model.quant import weights_held
    from gapless.testing.hf_reference import check_greedy, hf_greedy, make_prompts

    prompts = make_prompts(1000, n=4, max_len=30, shared_prefix=8)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for scheme in schemes:
        qdir, rdir = out / scheme, out / f"{scheme}-reference"
        model = loader.load_model(qdir, torch.float32, torch.device("cpu"))
        reference = load_file(str(rdir / "model.safetensors"))
        worst, count = 0.0, 0
        for name, m in model.named_modules():
            for key, w in _experts_held(name, m).items():  # (a mixture's: each expert's projections)
                worst, count = max(worst, (w - reference[key].float()).abs().max().item()), count + 1
            w = _held(m)
            if w is None:
                continue
            offsets = getattr(m, "checkpoint_offsets", None) or {None: (0, w.shape[0])}
            for shard, (at, rows) in offsets.items():
                fused = name.rsplit(".", 1)[1]
                key = f"{name if shard is None else name.replace(fused, f'{shard}_proj')}.weight"
                worst = max(worst, (w[at : at + rows] - reference[key].float()).abs().max().item())
                count += 1
        print(
            f"{scheme}: {weights_held(model)[0]}; {count} projections, max |gapless - reference| {worst:.3g}"
        )
        kv = "+kv" in scheme  # (Quark's FP8 KV cache: its k/v projections' output scales)
        options = dict(device="cpu", dtype="float32", kv_cache_tokens=2048, overlap=False)
        with LLM(str(qdir), kv_cache_dtype="fp8" if kv else "auto", **options) as llm:
            ours = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
            if kv:
                stored = load_file(str(qdir / "model.safetensors"))
                want = [
                    [stored[f"model.layers.{i}.self_attn.{p}_proj.output_scale"].item() for i in range(2)]
                    for p in "kv"
                ]
                held = llm.engine.runner.kv_pool.scales.flatten(1).tolist()
                print(f"{scheme}: fp8 KV cache scales {held}, the checkpoint's {want}: equal {held == want}")
        hf = AutoModelForCausalLM.from_pretrained(str(rdir), dtype=torch.float32).eval()
        notes = [check_greedy(o, hf_greedy(hf, p, 8), tol=1.0) for o, p in zip(ours, prompts)]
        print(f"{scheme}: greedy against transformers on the reference:", [n or "same" for n in notes])


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "source":
        source(Path(args[0]), *args[1:])
    elif command in ("llmcompressor", "modelopt", "quark"):
        {"llmcompressor": llmcompressor, "modelopt": modelopt, "quark": quark}[command](
            Path(args[0]), Path(args[1]), args[2:]
        )
    else:
        read(Path(args[0]), args[1:])
