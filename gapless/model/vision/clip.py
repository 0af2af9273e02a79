"""CLIP's vision transformer (LLaVA's tower), as transformers' `CLIPVisionModel` computes it: a patch
convolution, a class token and learned positions, a pre-norm, then pre-norm encoder layers with
full (bidirectional) attention. Only the layers up to the one whose output the model reads are built."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_ACTS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,  # (Qwen2.5-VL's vision MLP)
}


def activation(name: str) -> Any:
    if name not in _ACTS:
        raise ValueError(f"vision activation {name!r} is not supported (supported: {sorted(_ACTS)})")
    return _ACTS[name]


class EncoderLayer(nn.Module):
    """A pre-norm transformer encoder layer with full attention (CLIP's and SigLIP's, the same names)."""

    def __init__(self, hidden: int, inter: int, heads: int, eps: float, act: str) -> None:
        super().__init__()
        self.heads = heads
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps)
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps)
        self.self_attn = nn.ModuleDict(
            {n: nn.Linear(hidden, hidden) for n in ("q_proj", "k_proj", "v_proj", "out_proj")}
        )
        self.mlp = nn.ModuleDict({"fc1": nn.Linear(hidden, inter), "fc2": nn.Linear(inter, hidden)})
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        h = self.layer_norm1(x)
        a = self.self_attn
        q, k, v = (a[p](h).view(n, t, self.heads, -1).transpose(1, 2) for p in ("q_proj", "k_proj", "v_proj"))
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, t, d)
        x = x + a["out_proj"](o)
        return x + self.mlp["fc2"](self.act(self.mlp["fc1"](self.layer_norm2(x))))


class ClipVisionTower(nn.Module):
    """CLIP's vision transformer; `forward` returns the hidden states after `layers` encoder layers
    (transformers' `hidden_states[layers]`), class token first."""

    def __init__(self, cfg: dict[str, Any], layers: int) -> None:
        super().__init__()
        hidden, patch, size = int(cfg["hidden_size"]), int(cfg["patch_size"]), int(cfg["image_size"])
        self.num_patches = (size // patch) ** 2
        channels = int(cfg.get("num_channels", 3))
        self.patch_embedding = nn.Conv2d(channels, hidden, patch, stride=patch, bias=False)
        self.class_embedding = nn.Parameter(torch.empty(hidden))
        self.position_embedding = nn.Embedding(self.num_patches + 1, hidden)
        eps = float(cfg.get("layer_norm_eps", 1e-5))
        self.pre_layrnorm = nn.LayerNorm(hidden, eps=eps)
        act = str(cfg.get("hidden_act", "quick_gelu"))
        inter, heads = int(cfg["intermediate_size"]), int(cfg["num_attention_heads"])
        self.hidden, self.inter, self.heads = hidden, inter, heads
        self.layers = nn.ModuleList(EncoderLayer(hidden, inter, heads, eps, act) for _ in range(layers))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = (
            self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
            .flatten(2)
            .transpose(1, 2)
        )
        if x.shape[1] != self.num_patches:
            raise ValueError(f"an image of {x.shape[1]} patches; the tower takes {self.num_patches}")
        cls = self.class_embedding.expand(x.shape[0], 1, -1)
        x = torch.cat([cls, x], dim=1) + self.position_embedding.weight
        x = self.pre_layrnorm(x)
        for layer in self.layers:
            x = layer(x)
        return x

    def activation_bytes(self, images: int, dtype: torch.dtype) -> int:
        """About the peak of `forward` over `images` images: a few [tokens, hidden] and [tokens, inter]
        buffers alive at once, and one attention score matrix per head."""
        t, d, inter, heads = self.num_patches + 1, self.hidden, self.inter, self.heads
        per_image = t * (6 * d + 2 * inter) + heads * t * t
        return images * per_image * torch.finfo(dtype).bits // 8
