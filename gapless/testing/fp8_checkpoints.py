"""Tiny FP8 checkpoints for tests: a float checkpoint's decoder projections quantized to e4m3 in one of the
layouts gapless reads (`LAYOUTS`), written beside a float32 copy holding the same weights dequantized
(the reference the fp8 model is compared with)."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from gapless.model.quant.fp8 import FP8_MAX, activation_group, quantize_blocks, quantize_rows, rounded_inputs

# block sizes come from `block` but for ModelOpt's, always [128, 128]; "fp8-tensor": `quant_method: fp8`
# without blocks (vLLM's and AutoFP8's); "modelopt": its per-tensor FP8 said by `hf_quant_config.json`
# alone (older exports), the others in config.json; "fbgemm": `fbgemm_fp8`, per row, with transformers'
# `input_scale_ub` beside each weight; "ct-group": float scales per `block`'s [1, G] group; the MXFP8 ones
# (compressed-tensors' `mxfp8-quantized`, ModelOpt's `MXFP8`): groups of 32, e8m0 scales
LAYOUTS = (
    "fp8",
    "ct-tensor",
    "ct-channel",
    "ct-block",
    "fp8-tensor",
    "modelopt",
    "modelopt-channel",
    "modelopt-block",
    "fbgemm",
    "ct-group",
    "ct-mxfp8",
    "modelopt-mxfp8",
)
# MXFP8's: e4m3 in groups of 32 inputs, each scale a power of two stored as its biased exponent (uint8)
_MX = ("ct-mxfp8", "modelopt-mxfp8")
MX_GROUP = 32
_MODELOPT_ALGOS = {
    "modelopt": "FP8",
    "modelopt-channel": "FP8_PER_CHANNEL_PER_TOKEN",
    "modelopt-block": "FP8_PB_WO",
    "modelopt-mxfp8": "MXFP8",
}
_STATIC = ("fp8-tensor", "modelopt")  # layouts whose checkpoints carry a static `input_scale`
KV_SCALE = 0.05  # ModelOpt's layouts' KV-cache scale, each k_proj's `k_scale` and v_proj's `v_scale`
# the projections quantized: every decoder layer's, each expert's too (Mixtral's `experts.N.w1/2/3`)
_PROJ = re.compile(
    r"model\.layers\.\d+\..*(\.(q|k|v|o|gate|up|down|qkv|gate_up)_proj|\.experts\.\d+\.w[123])\.weight$"
)


def _ct_config(strategy: str, block: tuple[int, int] | None, mx: bool = False) -> dict:
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy}
    group = block[1] if strategy == "group" and block else None
    weights |= {"group_size": group, "block_structure": list(block) if block and not group else None}
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}
    if mx:  # (llm-compressor's MXFP8 preset: e8m0 scales, activations per group of 32)
        weights["scale_dtype"] = "torch.uint8"
        acts = {**acts, "strategy": "group", "group_size": MX_GROUP, "scale_dtype": "torch.uint8"}
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp8-quantized" if mx else "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


def quant_config(layout: str, block: tuple[int, int]) -> dict:
    """The config.json `quantization_config` of `layout` (ModelOpt's older export: its
    `hf_quant_config.json`)."""
    if layout in ("fp8", "fp8-tensor"):
        blocks = {"weight_block_size": list(block)} if layout == "fp8" else {}
        scheme = "static" if layout in _STATIC else "dynamic"
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": scheme, **blocks}
    if layout == "modelopt":
        algos = {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}
        return {"producer": {"name": "modelopt", "version": "0.29.0"}, "quantization": algos}
    if layout == "fbgemm":
        return {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": []}
    if layout in _MODELOPT_ALGOS:
        kv = {"type": "float", "num_bits": 8, "dynamic": False, "strategy": "tensor"}
        algo = _MODELOPT_ALGOS[layout]
        return {"quant_method": "modelopt", "quant_algo": algo, "ignore": ["lm_head"], "kv_cache_scheme": kv}
    if layout == "ct-mxfp8":
        return _ct_config("group", (1, MX_GROUP), mx=True)
    strategy = layout.removeprefix("ct-")
    return _ct_config(strategy, block if strategy in ("block", "group") else None)


def _blocks(layout: str, block: tuple[int, int]) -> tuple[int, int] | None:
    """The weight block `layout` scales by (None: per tensor or per row)."""
    mx = (1, MX_GROUP)
    blocks = {"fp8": block, "ct-block": block, "ct-group": block, "modelopt-block": (128, 128)}
    return (blocks | {"ct-mxfp8": mx, "modelopt-mxfp8": mx}).get(layout)


def _quantize(w: torch.Tensor, layout: str, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, its scale as the layout stores it)."""
    blocks = _blocks(layout, block)
    if layout in _MX:  # each group's scale 2^(floor(log2 amax) - 8), e4m3's largest exponent being 8
        n, k = w.shape
        groups = w.float().view(n, k // MX_GROUP, MX_GROUP)
        scale = torch.exp2(torch.floor(torch.log2(groups.abs().amax(-1).clamp_min(2**-100))) - 8)
        scale = scale.clamp(2.0**-127, 2.0**127)
        q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(n, k)
        return q, scale
    if blocks is not None:
        q, scale = quantize_blocks(w, blocks)
        return q, scale[:, None, :, None] if layout == "modelopt-block" else scale  # ModelOpt's: 4-D
    if layout in ("ct-channel", "modelopt-channel", "fbgemm"):
        q, scale = quantize_rows(w)
        return q, scale.view(-1) if layout == "modelopt-channel" else scale  # ModelOpt's: [N]
    scale = w.float().abs().max().clamp_min(1e-12) / FP8_MAX  # one scale
    if layout == "ct-tensor":  # shape [1] in bfloat16, as llm-compressor writes it for bf16 models
        scale = scale.bfloat16().float().reshape(1)
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def _dequantized(q: torch.Tensor, scale: torch.Tensor, layout: str, block: tuple[int, int]) -> torch.Tensor:
    n, k = q.shape
    blocks = _blocks(layout, block)
    if blocks is not None:
        s = scale.reshape(-(-n // blocks[0]), -(-k // blocks[1]))
        s = s.repeat_interleave(blocks[0], 0)[:n].repeat_interleave(blocks[1], 1)[:, :k]
    else:
        s = scale.reshape(-1, 1).expand(n, k)
    return q.float() * s.float()


def write_fp8_checkpoint(
    src: Path, dst: Path, layout: str, block: tuple[int, int] = (128, 128)
) -> tuple[Path, Path]:
    """`src`'s projections quantized in `layout` at `dst`, and (the second path) a float32 checkpoint of
    the same weights dequantized, at `dst` with a `-dequantized` suffix. Other tensors are copied as float."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown fp8 layout {layout!r}; layouts: {', '.join(LAYOUTS)}")
    ref = dst.with_name(dst.name + "-dequantized")
    for out in (dst, ref):
        shutil.copytree(src, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors*"))
    quantized: dict[str, torch.Tensor] = {}
    floats: dict[str, torch.Tensor] = {}
    scale_name = "weight_scale_inv" if layout == "fp8" else "weight_scale"
    for file in sorted(src.glob("*.safetensors")):
        for name, w in load_file(str(file)).items():
            if not _PROJ.search(name):
                quantized[name] = w.contiguous()
                floats[name] = w.float().contiguous()
                continue
            q, scale = _quantize(w, layout, block)
            quantized[name] = q.contiguous()
            stored = scale.bfloat16() if layout == "ct-tensor" else scale.float()
            if layout in _MX:  # (the biased exponent; the reference is made of the powers of two)
                quantized[name[: -len("weight")] + scale_name] = (torch.log2(scale) + 127).to(torch.uint8)
            module = name[: -len("weight")]
            if layout not in _MX:
                quantized[module + scale_name] = stored.contiguous()
            if layout in _STATIC:  # a calibrated activation scale, which gapless does not read
                quantized[module + "input_scale"] = torch.tensor(0.02)
            if layout == "fbgemm":  # a bound on a token's activation scale, which gapless does not read
                quantized[module + "input_scale_ub"] = torch.tensor([1200.0])
            if layout.startswith("modelopt") and module.endswith(("k_proj.", "v_proj.")):
                kv = module.rsplit(".", 2)[-2][0]  # "k" or "v"
                quantized[f"{module}{kv}_scale"] = torch.tensor(KV_SCALE)  # the KV cache's
            floats[name] = _dequantized(q, stored, layout, block).contiguous()
    save_file(quantized, str(dst / "model.safetensors"), metadata={"format": "pt"})
    save_file(floats, str(ref / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    (ref / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "float32"}, indent=2))
    if layout == "modelopt":
        (dst / "hf_quant_config.json").write_text(json.dumps(quant_config(layout, block), indent=2))
    else:
        cfg["quantization_config"] = quant_config(layout, block)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst, ref


def _rounded(x: torch.Tensor, k: int, k_group: int) -> torch.Tensor:
    """x [..., k] through e4m3 and back per token and `fp8.activation_group(k, k_group)` columns."""
    return rounded_inputs(x, activation_group(k, k_group))


def _stacked_experts(m: torch.nn.Module) -> bool:
    """Whether `m` is a transformers mixture's experts: gate/up and down weights stacked [E, rows, K]."""
    return all(
        isinstance(w, torch.Tensor) and w.dim() == 3
        for w in (getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None))
    )


@contextlib.contextmanager
def inputs_rounded(
    model: torch.nn.Module, k_group: int, unrounded: Callable[[str], bool] = lambda name: "lm_head" in name
) -> Iterator[None]:
    """A transformers `model` (or peft's) with its linear layers' inputs rounded to e4m3 as gapless's fp8
    kernels round them (per token and `k_group` columns: `fp8.activation_group`), the reference W8A8's
    tokens are compared with; a layer whose name `unrounded` says (the head, by default) left as it is.
    A mixture's experts (a module holding stacked `gate_up_proj` and `down_proj` weights) run their own
    loop (transformers' eager one: the forward its `use_experts_implementation` wraps), each projection's
    input rounded the same way (its `F.linear` calls)."""
    plain, plain_linear = torch.nn.Linear.forward, torch.nn.functional.linear
    names = {id(m): name for name, m in model.named_modules()}

    def forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if unrounded(names.get(id(self), "")):
            return plain(self, x)
        return plain(self, _rounded(x, self.in_features, k_group))

    def rounded_linear(
        input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return plain_linear(_rounded(input, weight.shape[-1], k_group), weight, bias)

    def experts_forward(module: torch.nn.Module) -> Callable[..., torch.Tensor]:
        eager = getattr(type(module).forward, "__wrapped__", type(module).forward)

        def run(*args: object, **kwargs: object) -> torch.Tensor:
            torch.nn.functional.linear = rounded_linear
            try:
                return eager(module, *args, **kwargs)
            finally:
                torch.nn.functional.linear = plain_linear

        return run

    experts = [m for name, m in model.named_modules() if _stacked_experts(m) and not unrounded(name)]
    own = {m: m.__dict__.get("forward") for m in experts}  # (a forward set on the instance, as hooks do)
    torch.nn.Linear.forward = forward  # type: ignore[method-assign,assignment]  # (patched for the reference)
    for m in experts:
        m.forward = experts_forward(m)  # (patched for the reference)
    try:
        yield
    finally:
        torch.nn.Linear.forward = plain  # type: ignore[method-assign]  # (restored)
        for m, before in own.items():
            if before is None:
                del m.forward  # (the class's again)
            else:
                m.forward = before
