"""LLaVA-1.5 (`LlavaForConditionalGeneration`): a CLIP vision tower whose chosen layer's patch states
(class token dropped, by default) go through a two-layer MLP projector into the decoder's embedding
width. One image is one `pixel_values` [3, H, W] (the processor resizes and crops every image to the
tower's size), so every image gives the same number of rows."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gapless.model.vision.base import TowerEncoder, VisionSpec
from gapless.model.vision.clip import ClipVisionTower, activation


def llava_spec(cfg: dict[str, Any]) -> VisionSpec:
    """The vision side of a LLaVA config, refused by name where it is not LLaVA-1.5's."""
    vision = cfg.get("vision_config") or {}
    if vision.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise ValueError(f"LLaVA with a {vision.get('model_type')!r} vision tower is not supported (CLIP is)")
    layer = cfg.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        raise ValueError(f"vision_feature_layer={layer!r} (several layers) is not supported")
    strategy = cfg.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ValueError(f"vision_feature_select_strategy={strategy!r} is not supported")
    size, patch = int(vision.get("image_size", 224)), int(vision.get("patch_size", 32))
    tokens = (size // patch) ** 2 + (strategy == "full")
    token_id = cfg.get("image_token_index", cfg.get("image_token_id"))
    if token_id is None:
        raise ValueError("the LLaVA config names no image_token_index")
    return VisionSpec("llava", int(token_id), size, tokens, cfg)


def _vision_name(name: str) -> str | None:
    """The tower's or projector's own name of a checkpoint tensor (both spellings transformers wrote:
    `vision_tower.vision_model.x` and 5.x's `model.vision_tower.x`), else None."""
    name = name.removeprefix("model.")
    if name.startswith("vision_tower."):
        own = name.removeprefix("vision_tower.").removeprefix("vision_model.")
        return "tower." + own.replace("embeddings.", "", 1).replace("encoder.", "", 1)
    if name.startswith("multi_modal_projector."):
        return "projector." + name.removeprefix("multi_modal_projector.")
    return None


class LlavaEncoder(TowerEncoder):
    def __init__(self, spec: VisionSpec, text_hidden: int) -> None:
        super().__init__()
        cfg = spec.config
        vision = cfg["vision_config"]
        n = int(vision["num_hidden_layers"])
        layer = int(cfg.get("vision_feature_layer", -2))
        self.spec = spec
        self.text_hidden = text_hidden
        self.tower = self.new_tower(vision, layer if layer >= 0 else n + 1 + layer)
        self.drop_cls = cfg.get("vision_feature_select_strategy", "default") == "default"
        bias = bool(cfg.get("multimodal_projector_bias", True))
        self.projector = nn.ModuleDict(
            {
                "linear_1": nn.Linear(int(vision["hidden_size"]), text_hidden, bias=bias),
                "linear_2": nn.Linear(text_hidden, text_hidden, bias=bias),
            }
        )
        self.act = activation(str(cfg.get("projector_hidden_act", "gelu")))

    def new_tower(self, vision: dict[str, Any], layers: int) -> Any:
        """The tower up to the chosen layer (CLIP's; LLaVA-OneVision's is SigLIP)."""
        return ClipVisionTower(vision, layers)

    def encode(self, images: list[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
        return list(self.project(torch.stack([im[0] for im in images])).unbind(0))  # one size: the crop

    def project(self, pixels: torch.Tensor) -> torch.Tensor:
        """[N, 3, S, S] crops to their [N, tokens, text hidden] rows: the tower's chosen layer, projected."""
        h = self.tower(pixels)
        if self.drop_cls:
            h = h[:, 1:]
        p = self.projector
        return p["linear_2"](self.act(p["linear_1"](h)))

    def vision_name(self, name: str) -> str | None:
        return _vision_name(name)
