"""LLaVA-OneVision (`LlavaOnevisionForConditionalGeneration`): LLaVA-NeXT's any-resolution tiles
(`llava_next.py`) over a SigLIP tower (the chosen layer's states, before the post-norm; no class token,
so every patch is kept), with two changes transformers' `pack_image_features` makes: a grid holding more
than `anyres_max_N` crops' worth of patches (by over 10%) is scaled down bilinearly to about that, and in
a prompt with several images each image is its base crop alone (the processor pads it to a square) and
one newline row.

The processor is transformers' image processor (`AutoImageProcessor`: every resize, pad and crop is its)
with the checkpoint's tokenizer and chat template (`OnevisionProcessor`): transformers' own
`LlavaOnevisionProcessor` also builds a video processor, which needs torchvision.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gapless.model.vision.base import VisionSpec
from gapless.model.vision.llava_next import LlavaNextEncoder, anyres_inputs, anyres_layout
from gapless.model.vision.qwen2_5_vl import ProcessedImages, QwenVLProcessor
from gapless.model.vision.siglip import SiglipVisionTower

# transformers' `LlavaOnevisionConfig` default: every grid of 1 to 6 x 1 to 6 tiles of 384 px
_PINPOINTS = [[384 * i, 384 * j] for i in range(1, 7) for j in range(1, 7)]


def _max_patches(cfg: dict[str, Any]) -> int:
    """N of the config's `vision_aspect_ratio` "anyres_max_N", refused by name otherwise."""
    aspect = str(cfg.get("vision_aspect_ratio", "anyres_max_9"))
    n = aspect.removeprefix("anyres_max_")
    if not aspect.startswith("anyres_max_") or not n.isdigit() or int(n) < 1:
        raise ValueError(f"vision_aspect_ratio={aspect!r} is not supported ('anyres_max_N' is)")
    return int(n)


def llava_onevision_spec(cfg: dict[str, Any]) -> VisionSpec:
    """The vision side of a LLaVA-OneVision config (its `vision_config` filled with SigLIP's defaults, its
    pinpoints with transformers' default); `tokens_per_image` is the largest grid's rows."""
    from transformers import SiglipVisionConfig

    vision = cfg.get("vision_config") or {}
    if vision.get("model_type", "siglip_vision_model") != "siglip_vision_model":
        raise ValueError(
            f"LLaVA-OneVision with a {vision.get('model_type')!r} vision tower is not supported (SigLIP is)"
        )
    vision = SiglipVisionConfig(**vision).to_dict()
    strategy = cfg.get("vision_feature_select_strategy", "full")
    if strategy != "full":
        raise ValueError(
            f"LLaVA-OneVision with vision_feature_select_strategy={strategy!r} is not supported "
            "('full': SigLIP has no class token to drop)"
        )
    layer = cfg.get("vision_feature_layer", -1)
    if not isinstance(layer, int):
        raise ValueError(f"vision_feature_layer={layer!r} (several layers) is not supported")
    pinpoints = [[int(h), int(w)] for h, w in (cfg.get("image_grid_pinpoints") or _PINPOINTS)]
    tile, side = int(vision["image_size"]), int(vision["image_size"]) // int(vision["patch_size"])
    if any(h % tile or w % tile for h, w in pinpoints):
        raise ValueError(f"image_grid_pinpoints={pinpoints!r} are not multiples of the tower's {tile} px")
    most = max(
        anyres_layout((h, w), pinpoints, tile, side, _max_patches(cfg)).rows(side) for h, w in pinpoints
    )
    token_id = int(cfg.get("image_token_index", cfg.get("image_token_id", 151646)))
    cfg = {
        **cfg,
        "vision_config": vision,
        "image_grid_pinpoints": pinpoints,
        "vision_feature_select_strategy": "full",
        "vision_feature_layer": layer,
    }
    return VisionSpec("llava_onevision", token_id, tile, most, cfg)


class LlavaOnevisionEncoder(LlavaNextEncoder):
    base_only = True

    def __init__(self, spec: VisionSpec, text_hidden: int) -> None:
        super().__init__(spec, text_hidden)
        self.max_patches = _max_patches(spec.config)

    def new_tower(self, vision: dict[str, Any], layers: int) -> Any:
        return SiglipVisionTower(vision, layers)


class OnevisionProcessor(QwenVLProcessor):
    """LLaVA-OneVision's processor from its parts (the image processor, the tokenizer and chat template,
    loaded as Qwen2.5-VL's are): a prompt's images processed together (several: each its base crop), each
    `<image>` expanded to the image's rows, as `LlavaOnevisionProcessor` does."""

    image_token = "<image>"

    def __init__(self, model_path: str | Path) -> None:
        super().__init__(model_path)
        spec = llava_onevision_spec(json.loads((Path(model_path) / "config.json").read_text()))
        vision = spec.config["vision_config"]
        self.patch_size = int(vision["patch_size"])
        self.max_patches = _max_patches(spec.config)  # read by `anyres_inputs`

    def process_images(self, images: list[Any], return_tensors: str) -> ProcessedImages:
        """One prompt's `images` processed together, each image's rows as `anyres_inputs` counts them."""
        # nested as one prompt's, so the image processor counts them (`batch_num_images`)
        out = dict(self.image_processor(images=[list(images)], return_tensors=return_tensors))
        return ProcessedImages(out, anyres_inputs(out, len(images), self)[1])
