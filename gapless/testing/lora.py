"""PEFT adapters made in the tests, and `transformers` + `peft` as their reference.

`make_adapter` wraps a tiny checkpoint's `transformers` model in a PEFT LoRA of the given targets and rank
and saves it, with B drawn at random (PEFT starts B at zero, which would make every adapter the base
model). `peft_model` loads one adapter on the base, unmerged or merged into its weights.
"""

from __future__ import annotations

from pathlib import Path

import torch

from gapless.testing.hf_reference import load_hf_model

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# Phi-3's checkpoint (and so PEFT) names its fused layers
FUSED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}


def make_adapter(
    base: str | Path,
    out: str | Path,
    targets: list[str],
    r: int = 8,
    alpha: int = 16,
    seed: int = 0,
    rslora: bool = False,
    scale: float = 0.3,
    parameters: list[str] | None = None,
) -> Path:
    """A PEFT LoRA adapter of `base` on `targets` (PEFT module names) and `parameters` (PEFT's
    `target_parameters`: a mixture's stacked experts, `mlp.experts.gate_up_proj`), its A and B random (B
    nonzero), saved to `out` (`adapter_config.json`, `adapter_model.safetensors`)."""
    from peft import LoraConfig, get_peft_model

    model = load_hf_model(base)
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    targets = sorted({t if t in names else FUSED.get(t, t) for t in targets})
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=targets,
        target_parameters=parameters,
        use_rslora=rslora,
        lora_dropout=0.0,
    )
    peft = get_peft_model(model, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale / p.shape[-1] ** 0.5)
    peft.save_pretrained(str(out), safe_serialization=True)
    return Path(out)


def peft_model(base: str | Path, adapter: str | Path | None, merged: bool = False) -> torch.nn.Module:
    """The `transformers` model of `base` with `adapter` (None: none): PEFT's unmerged forward, or the
    adapter merged into the weights (`merge_and_unload`)."""
    model = load_hf_model(base)
    if adapter is None:
        return model
    from peft import PeftModel

    peft = PeftModel.from_pretrained(model, str(adapter)).eval()
    return peft.merge_and_unload().eval() if merged else peft
