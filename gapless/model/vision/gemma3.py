"""Gemma 3 (`Gemma3ForConditionalGeneration`): a SigLIP tower whose patch states are average-pooled to
`mm_tokens_per_image` tokens (a square grid), RMS-normed (Gemma's `1 + weight`) and projected by one
matrix into the decoder's embedding width. One image is one `pixel_values` [3, H, W] (the processor
resizes every image to the tower's size; pan-and-scan crops, off by default, are not supported), so every
image gives the same number of rows. In the decoder an image's tokens attend to each other both ways
(`VisionSpec.bidirectional`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gapless.model.vision.base import TowerEncoder, VisionSpec
from gapless.model.vision.siglip import SiglipVisionTower


def gemma3_text_config(text: dict[str, Any]) -> dict[str, Any]:
    """A Gemma 3 `text_config` filled and normalised as transformers loads it: the Hub's configs keep only
    what differs from `Gemma3TextConfig`'s defaults (the 4B's names no heads), and v4's `rope_scaling` /
    `rope_local_base_freq` become `rope_parameters`."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**text).to_dict()


def gemma3_spec(cfg: dict[str, Any]) -> VisionSpec:
    """The vision side of a Gemma 3 config (its `vision_config` filled with SigLIP's defaults, as
    transformers fills it), refused by name where its shapes do not pool evenly."""
    from transformers import SiglipVisionConfig

    vision = cfg.get("vision_config") or {}
    if vision.get("model_type", "siglip_vision_model") != "siglip_vision_model":
        raise ValueError(
            f"Gemma 3 with a {vision.get('model_type')!r} vision tower is not supported (SigLIP is)"
        )
    vision = SiglipVisionConfig(**vision).to_dict()
    cfg = {**cfg, "vision_config": vision}
    size, patch = int(vision["image_size"]), int(vision["patch_size"])
    tokens = int(cfg.get("mm_tokens_per_image", 256))
    side, per_side = size // patch, round(tokens**0.5)
    if per_side * per_side != tokens or side % per_side:
        raise ValueError(
            f"mm_tokens_per_image={tokens} does not pool a {side} x {side} patch grid evenly "
            "(a square number whose side divides the grid's)"
        )
    token_id = int(cfg.get("image_token_index", cfg.get("image_token_id", 262144)))
    vocab = gemma3_text_config(dict(cfg.get("text_config") or {}))["vocab_size"]
    if token_id >= int(vocab):
        raise ValueError(f"image_token_index {token_id} is outside the text vocabulary ({vocab})")
    return VisionSpec("gemma3", token_id, size, tokens, cfg, bidirectional=True)


def _vision_name(name: str) -> str | None:
    """The tower's or projector's own name of a checkpoint tensor (`vision_tower.vision_model.x`, 5.x's
    `model.vision_tower.x`, or without `vision_model.`), else None."""
    name = name.removeprefix("model.")
    if name.startswith("vision_tower."):
        own = name.removeprefix("vision_tower.").removeprefix("vision_model.")
        return "tower." + own.replace("embeddings.", "", 1).replace("encoder.", "", 1)
    if name.startswith("multi_modal_projector."):
        return "projector_" + name.removeprefix("multi_modal_projector.").replace(".", "_")
    return None


class Gemma3Encoder(TowerEncoder):
    def __init__(self, spec: VisionSpec, text_hidden: int) -> None:
        super().__init__()
        cfg = spec.config
        vision = cfg["vision_config"]
        self.spec = spec
        self.text_hidden = text_hidden
        self.tower = SiglipVisionTower(vision)
        hidden = int(vision["hidden_size"])
        side = int(vision["image_size"]) // int(vision["patch_size"])
        self.side, self.kernel = side, side // round(spec.tokens_per_image**0.5)
        self.eps = float(vision.get("layer_norm_eps", 1e-6))
        # named as the checkpoint's `multi_modal_projector.` tensors, dots made underscores
        self.projector_mm_soft_emb_norm_weight = nn.Parameter(torch.zeros(hidden))
        self.projector_mm_input_projection_weight = nn.Parameter(torch.zeros(hidden, text_hidden))

    def encode(self, images: list[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
        h = self.tower(torch.stack([im[0] for im in images]))  # [N, side * side, hidden]
        n, _, d = h.shape
        grid = h.transpose(1, 2).reshape(n, d, self.side, self.side)
        pooled = nn.functional.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        # Gemma's RMSNorm, in fp32 with `1 + weight`, then cast back (as transformers computes it)
        x = pooled.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = (x * (1.0 + self.projector_mm_soft_emb_norm_weight.float())).type_as(pooled)
        out = torch.matmul(x, self.projector_mm_input_projection_weight).type_as(h)
        return list(out.unbind(0))

    def vision_name(self, name: str) -> str | None:
        return _vision_name(name)
