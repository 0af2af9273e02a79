"""SigLIP's vision transformer (Gemma 3's tower), as transformers' `SiglipVisionModel` computes it without
its pooling head: a patch convolution (with bias) plus learned positions, no class token, pre-norm encoder
layers with full attention (CLIP's layer), then a post-norm. `forward` returns `last_hidden_state` (or a
chosen layer's states, before the post-norm)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gapless.model.vision.clip import EncoderLayer


class SiglipVisionTower(nn.Module):
    """`layers`: run only that many encoder layers and skip the post-norm, returning transformers'
    `hidden_states[layers]` (LLaVA-OneVision's chosen layer); None: every layer and the post-norm."""

    def __init__(self, cfg: dict[str, Any], layers: int | None = None) -> None:
        super().__init__()
        hidden, patch, size = int(cfg["hidden_size"]), int(cfg["patch_size"]), int(cfg["image_size"])
        self.num_patches = (size // patch) ** 2
        self.patch_embedding = nn.Conv2d(int(cfg.get("num_channels", 3)), hidden, patch, stride=patch)
        self.position_embedding = nn.Embedding(self.num_patches, hidden)
        eps = float(cfg.get("layer_norm_eps", 1e-6))
        act = str(cfg.get("hidden_act", "gelu_pytorch_tanh"))
        inter, heads = int(cfg["intermediate_size"]), int(cfg["num_attention_heads"])
        self.hidden, self.inter, self.heads = hidden, inter, heads
        n = int(cfg["num_hidden_layers"]) if layers is None else layers
        self.layers = nn.ModuleList(EncoderLayer(hidden, inter, heads, eps, act) for _ in range(n))
        self.post_layernorm = nn.LayerNorm(hidden, eps=eps) if layers is None else None

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] pixels to [N, patches, hidden] states."""
        w = self.patch_embedding.weight
        x = self.patch_embedding(pixel_values.to(w.dtype)).flatten(2).transpose(1, 2)
        if x.shape[1] != self.num_patches:
            raise ValueError(f"an image of {x.shape[1]} patches; the tower takes {self.num_patches}")
        x = x + self.position_embedding.weight
        for layer in self.layers:
            x = layer(x)
        return x if self.post_layernorm is None else self.post_layernorm(x)

    def activation_bytes(self, images: int, dtype: torch.dtype) -> int:
        """About the peak of `forward` over `images` images (as `ClipVisionTower.activation_bytes`)."""
        t, d, inter, heads = self.num_patches, self.hidden, self.inter, self.heads
        return images * (t * (6 * d + 2 * inter) + heads * t * t) * torch.finfo(dtype).bits // 8
