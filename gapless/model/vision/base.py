"""What every vision family gives the engine: a `VisionEncoder` (pixels to rows of the decoder's
embedding width, on the device) and, on the host, where its image tokens sit in a processed prompt.

A family's processor (transformers' own `AutoProcessor`) turns a chat's images into `pixel_values` and
expands each image's placeholder into its run of image tokens; the engine writes the encoder's rows for
an image over the embeddings of that run. Families differ in what one image's inputs are (LLaVA-1.5: one
[3, H, W] tensor; Qwen2.5-VL: patches and a grid; Gemma 3: crops), so the inputs travel as a
tuple of tensors per image (`VisionEncoder.input_names`: which of the processor's outputs, in order) and
only the family's encoder reads them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class VisionSpec:
    """A checkpoint's vision side, as its config says: the family, the token id each image's run is made
    of, its encoder's input size (for the memory plan's estimate), and how the decoder attends over an
    image's run."""

    family: str  # "llava", "llava_next", "gemma3", "qwen2_5_vl"
    image_token_id: int
    image_size: int  # pixels a side of the encoder's input
    tokens_per_image: int  # rows the encoder gives one image (the run's length)
    config: dict  # the checkpoint's config.json, for the family's encoder
    # an image's tokens attend to each other both ways in the decoder's prefill (Gemma 3), not causally:
    # each image's run is prefilled in one chunk (`gapless.engine.images.PromptImage.bidirectional`)
    bidirectional: bool = False
    # M-RoPE families (Qwen2.5-VL): the patches a side merged into one row; an image's rows take
    # positions over time, height and width (`gapless.model.vision.mrope`). None: 1-D positions
    mrope_merge: int | None = None


class VisionEncoder(nn.Module, ABC):
    """Images to embedding rows: each image's inputs (the processor's outputs for one image, named by
    `input_names`) to its [tokens, text hidden] rows, batched over the images given."""

    spec: VisionSpec
    input_names: tuple[str, ...] = ("pixel_values",)

    def __init__(self) -> None:
        super().__init__()
        self.loaded: set[str] = set()  # the parameters `place` filled

    @abstractmethod
    def encode(self, images: list[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
        """One [tokens_i, hidden] tensor per image, in order, on the encoder's device and dtype."""

    @abstractmethod
    def activation_bytes(self, images: int, dtype: torch.dtype) -> int:
        """An upper estimate of the activations encoding `images` images at once takes (the memory plan)."""

    @abstractmethod
    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        """Place one checkpoint tensor (named as the checkpoint names it) if it is the encoder's; False when
        it is not (the decoder's, or a layer the encoder never runs)."""

    def place(self, own: str, name: str, tensor: torch.Tensor) -> None:
        """Copy checkpoint tensor `name` into the encoder's parameter `own`, its shape checked."""
        param = self.get_parameter(own)
        if not tensor.is_floating_point():  # (a quantized tower's int8 weight, e.g. bitsandbytes 8-bit)
            raise ValueError(
                f"checkpoint weight {name!r} is {str(tensor.dtype).removeprefix('torch.')}: the vision "
                "encoder's weights load as floats (a quantized vision tower is not run)"
            )
        if param.shape != tensor.shape:
            raise ValueError(
                f"checkpoint weight {name!r} is {tuple(tensor.shape)}; expected {tuple(param.shape)}"
            )
        param.data.copy_(tensor)
        self.loaded.add(own)

    def missing_weights(self) -> list[str]:
        """The encoder's parameters no `load_weight` filled."""
        return sorted(n for n, _ in self.named_parameters() if n not in self.loaded)


class TowerEncoder(VisionEncoder):
    """An encoder of a vision `tower` and a projector into the decoder's `text_hidden` width (LLaVA's,
    Gemma 3's), its checkpoint tensors named by `vision_name` (None: not the encoder's)."""

    tower: Any
    text_hidden: int

    @abstractmethod
    def vision_name(self, name: str) -> str | None:
        """The encoder's own name of checkpoint tensor `name`, else None."""

    def activation_bytes(self, images: int, dtype: torch.dtype) -> int:
        """The tower's, and a few projected rows of every image's tokens."""
        t, hidden = self.spec.tokens_per_image, self.text_hidden
        return (
            self.tower.activation_bytes(images, dtype)
            + images * t * hidden * 3 * torch.finfo(dtype).bits // 8
        )

    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        own = self.vision_name(name)
        if own is None:
            return False
        params = dict(self.named_parameters())
        if own not in params:  # the tower's, never run: a layer past the one read, a post-norm, a head
            return True
        self.place(own, name, tensor)
        return True
