"""LLaVA-NeXT (`LlavaNextForConditionalGeneration`): LLaVA-1.5's CLIP tower and projector (`llava.py`) over
any-resolution tiles. The image processor picks the grid of tiles that best fits the image
(`image_grid_pinpoints`), resizes and pads the image onto it and cuts it into tower-sized crops, after a
base crop of the whole image; every crop goes through the tower and projector. An image's rows are the
base crop's patches, then the grid's patches as one picture, row by row, with the padding's rows or
columns cut off ("unpadding") and an `image_newline` row closing each row, as transformers'
`pack_image_features` lays them out. Images of different sizes or aspect ratios give different grids and
different numbers of rows.

One image's inputs are its crops [1 + tiles, 3, S, S] (the processor pads the batch's crops to the most
tiles; `anyres_inputs` cuts each image's own) and its size [2] = (height, width) before processing.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from gapless.model.vision.base import VisionSpec
from gapless.model.vision.llava import LlavaEncoder, llava_spec

# transformers' `LlavaNextConfig` default, for configs that name no pinpoints
_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]


class AnyresLayout(NamedTuple):
    """Where one image's rows come from: its grid of tiles (down, across; (0, 0): its base crop alone, as
    LLaVA-OneVision takes each image of a prompt with several), the patch rows and columns of the grid's
    picture that survive unpadding ([top, bottom) x [left, right)), and the size that part is
    interpolated down to where it holds too many patches (OneVision's `anyres_max`; None: kept)."""

    tiles: tuple[int, int]
    top: int
    bottom: int
    left: int
    right: int
    fit: tuple[int, int] | None = None

    @property
    def crops(self) -> int:
        """The tower's inputs for the image: the base crop and each tile."""
        return 1 + self.tiles[0] * self.tiles[1]

    def rows(self, side: int) -> int:
        """The image's rows: the base crop's `side` x `side` patches, then each row of the grid's patches
        with its newline (the base crop's alone: one newline)."""
        if not self.tiles[0]:
            return side * side + 1
        h, w = self.fit or (self.bottom - self.top, self.right - self.left)
        return side * side + h * (w + 1)


BASE_ONLY = AnyresLayout((0, 0), 0, 0, 0, 0)


def anyres_layout(
    size: tuple[int, int], pinpoints: list[list[int]], tile: int, side: int, max_patches: int | None = None
) -> AnyresLayout:
    """The layout of an image of `size` (height, width) pixels, tiled by `tile`-pixel crops of `side` x
    `side` patches each: the grid the image processor picks (transformers' `select_best_resolution`, the
    processor's own choice), the unpadded part of its patches (`unpad_image`'s arithmetic) and, past
    `max_patches` crops' worth of patches by more than 10% (`anyres_max_N`), the size it is scaled to."""
    from transformers.image_processing_utils import select_best_resolution

    height, width = int(size[0]), int(size[1])
    best_h, best_w = select_best_resolution((height, width), pinpoints)
    tiles = (best_h // tile, best_w // tile)
    cur_h, cur_w = tiles[0] * side, tiles[1] * side
    if width / height > cur_w / cur_h:  # wider than the grid: padded above and below
        pad = (cur_h - int(round(height * (cur_w / width), 7))) // 2
        top, bottom, left, right = pad, cur_h - pad, 0, cur_w
    else:
        pad = (cur_w - int(round(width * (cur_h / height), 7))) // 2
        top, bottom, left, right = 0, cur_h, pad, cur_w - pad
    fit = None
    if max_patches is not None:
        h, w = bottom - top, right - left
        ratio = math.sqrt(h * w / (max_patches * side**2))
        fit = (int(h // ratio), int(w // ratio)) if ratio > 1.1 else None
    return AnyresLayout(tiles, top, bottom, left, right, fit)


def llava_next_spec(cfg: dict[str, Any]) -> VisionSpec:
    """The vision side of a LLaVA-NeXT config (LLaVA-1.5's checks, `llava_spec`), its pinpoints filled with
    transformers' default; `tokens_per_image` is the largest grid's rows (the memory plan's bound)."""
    if cfg.get("vision_feature_select_strategy", "default") != "default":
        raise ValueError(
            "LLaVA-NeXT with vision_feature_select_strategy="
            f"{cfg.get('vision_feature_select_strategy')!r} is not supported ('default' is)"
        )
    pinpoints = cfg.get("image_grid_pinpoints") or _PINPOINTS
    if not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pinpoints):
        raise ValueError(f"image_grid_pinpoints={pinpoints!r}: expected [height, width] pairs")
    spec = llava_spec(cfg)
    vision = cfg["vision_config"]
    tile, side = spec.image_size, spec.image_size // int(vision.get("patch_size", 32))
    if any(int(h) % tile or int(w) % tile for h, w in pinpoints):
        raise ValueError(f"image_grid_pinpoints={pinpoints!r} are not multiples of the tower's {tile} px")
    most = max(anyres_layout((h, w), pinpoints, tile, side).rows(side) for h, w in pinpoints)
    cfg = {**cfg, "image_grid_pinpoints": [[int(h), int(w)] for h, w in pinpoints]}
    return dataclasses.replace(spec, family="llava_next", tokens_per_image=most, config=cfg)


def anyres_inputs(out: Any, n: int, processor: Any) -> tuple[list[tuple[torch.Tensor, ...]], list[int]]:
    """Each of `n` images' inputs from a LLaVA-NeXT or -OneVision processor's outputs (its own crops, the
    batch's padding crops dropped, and its size) and its run's length, as the processor expands its
    placeholder. OneVision's processor sets `max_patches` (`anyres_max_N`) and, for a prompt with several
    images (`batch_num_images`), gives each image its base crop alone."""
    pinpoints = processor.image_processor.image_grid_pinpoints
    tile = int(out["pixel_values"].shape[-1])
    if getattr(processor, "patch_size", None) is None:
        raise ValueError("the checkpoint's processor names no patch_size (processor_config.json)")
    side = tile // int(processor.patch_size)
    max_patches = getattr(processor, "max_patches", None)
    several = "batch_num_images" in out and int(out["batch_num_images"][0]) != 1
    inputs: list[tuple[torch.Tensor, ...]] = []
    lengths: list[int] = []
    for i in range(n):
        size = out["image_sizes"][i]
        layout = (
            BASE_ONLY
            if several
            else anyres_layout((int(size[0]), int(size[1])), pinpoints, tile, side, max_patches)
        )
        inputs.append((out["pixel_values"][i][: layout.crops].clone(), size.clone()))
        lengths.append(layout.rows(side))
    return inputs, lengths


class LlavaNextEncoder(LlavaEncoder):
    input_names = ("pixel_values", "image_sizes")
    # an image of one crop is its base crop alone (OneVision's, in a prompt of several images)
    base_only = False

    def __init__(self, spec: VisionSpec, text_hidden: int) -> None:
        super().__init__(spec, text_hidden)
        self.tile = spec.image_size
        self.side = self.tile // int(spec.config["vision_config"].get("patch_size", 32))
        self.pinpoints = spec.config["image_grid_pinpoints"]
        self.max_patches: int | None = None  # OneVision's `anyres_max_N`
        self.image_newline = nn.Parameter(torch.empty(text_hidden))

    def layout(self, crops: int, size: tuple[int, int]) -> AnyresLayout:
        """An image's layout from its size (height, width), its number of crops checked against it."""
        if self.base_only and crops == 1:
            return BASE_ONLY
        lay = anyres_layout(size, self.pinpoints, self.tile, self.side, self.max_patches)
        if crops != lay.crops:
            raise ValueError(f"an image of {crops} crops; its size takes {lay.crops}")
        return lay

    def encode(self, images: list[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
        """Every image's crops through the tower and projector at once, then each image's rows packed. The
        images' sizes are read on the host, all at once (on a GPU the call's one sync)."""
        sizes = torch.stack([im[1] for im in images]).tolist()
        layouts = [self.layout(im[0].shape[0], (h, w)) for im, (h, w) in zip(images, sizes)]
        feats = self.project(torch.cat([im[0] for im in images]))  # [crops, side * side, hidden]
        return [self._pack(f, lay) for f, lay in zip(feats.split([lay.crops for lay in layouts]), layouts)]

    def _pack(self, feats: torch.Tensor, lay: AnyresLayout) -> torch.Tensor:
        """One image's rows from its crops' features: the base crop's, then the tiles' as one grid of
        patches, unpadded (and scaled down, `AnyresLayout.fit`), each row closed by the newline."""
        s, (down, across), d = self.side, lay.tiles, feats.shape[-1]
        newline = self.image_newline.to(feats.dtype)
        if not down:
            return torch.cat([feats[0], newline[None]])
        grid = feats[1:].view(down, across, s, s, d).permute(0, 2, 1, 3, 4).reshape(down * s, across * s, d)
        grid = grid[lay.top : lay.bottom, lay.left : lay.right]
        if lay.fit is not None:  # as transformers: bilinear over a [1, hidden, h, w] picture
            picture = grid.permute(2, 0, 1).contiguous()[None]
            grid = F.interpolate(picture, list(lay.fit), mode="bilinear")[0].permute(1, 2, 0)
        rows = torch.cat([grid, newline.expand(grid.shape[0], 1, d)], dim=1).flatten(0, 1)
        return torch.cat([feats[0], rows])

    def activation_bytes(self, images: int, dtype: torch.dtype) -> int:
        """The tower's over every crop of the largest grid, and a few projected rows per crop."""
        most = images * max(
            anyres_layout((h, w), self.pinpoints, self.tile, self.side).crops for h, w in self.pinpoints
        )
        rows = most * self.side * self.side * self.text_hidden * 3 * torch.finfo(dtype).bits // 8
        return self.tower.activation_bytes(most, dtype) + rows

    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        if name.removeprefix("model.") == "image_newline":
            self.place("image_newline", name, tensor)
            return True
        return super().load_weight(name, tensor)
