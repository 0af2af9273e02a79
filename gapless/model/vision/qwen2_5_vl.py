"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`), as transformers computes it: a vision transformer
over 14-px patches (a 3-D patch convolution over two repeated frames), 2-D rotary positions (height,
width), window attention in every layer but `fullatt_block_indexes` (which attend over the whole image),
and a merger that takes each 2x2 block of patches to one row of the decoder's width. Its decoder is
Qwen2's with M-RoPE (`gapless.model.layers.MRotaryEmbedding`; the prompt's positions:
`gapless.model.vision.mrope`).

One image's inputs are its patches [h * w, 3 * 2 * 14 * 14] and its grid [3] = (1, h, w) in patches, as
the image processor gives them; images of different sizes give different numbers of rows. The processor
is transformers' image processor and the checkpoint's tokenizer (`QwenVLProcessor`): transformers' own
`Qwen2_5_VLProcessor` also builds a video processor, which needs torchvision.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from gapless.model.vision.base import VisionEncoder, VisionSpec
from gapless.model.vision.clip import activation

# the image processor's default pixel ceiling (`max_pixels`): the largest image's rows, for the memory plan
_MAX_PIXELS = 12845056


def qwen2_5_vl_spec(cfg: dict[str, Any]) -> VisionSpec:
    vision = cfg.get("vision_config") or {}
    token_id = cfg.get("image_token_id", cfg.get("image_token_index"))
    if token_id is None:
        raise ValueError("the Qwen2.5-VL config names no image_token_id")
    patch, merge = int(vision.get("patch_size", 14)), int(vision.get("spatial_merge_size", 2))
    side = int(_MAX_PIXELS**0.5) // (patch * merge) * (patch * merge)
    tokens = (side // (patch * merge)) ** 2
    return VisionSpec("qwen2_5_vl", int(token_id), side, tokens, cfg, mrope_merge=merge)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Qwen2.5-VL's RMSNorm: in fp32, cast back, then times the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Norm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.weight)


class _PatchEmbed(nn.Module):
    """The 3-D patch convolution (two frames of 14 x 14 pixels, a still image's frame repeated)."""

    def __init__(self, channels: int, hidden: int, frames: int, patch: int) -> None:
        super().__init__()
        self.shape = (channels, frames, patch, patch)
        self.proj = nn.Conv3d(channels, hidden, self.shape[1:], self.shape[1:], bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        x = self.proj(patches.view(-1, *self.shape).to(self.proj.weight.dtype))
        return x.view(x.shape[0], -1)


class _Merger(nn.Module):
    """Each 2x2 block of patches (their normed rows side by side) through a two-layer GELU MLP."""

    def __init__(self, hidden: int, unit: int, out: int) -> None:
        super().__init__()
        self.wide = hidden * unit
        self.ln_q = _Norm(hidden)
        self.mlp = nn.Sequential(nn.Linear(self.wide, self.wide), nn.GELU(), nn.Linear(self.wide, out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.wide))


class _Runs(NamedTuple):
    """Runs of rows that attend only among themselves, all of one length: their rows (run after run; None:
    every row, in order) and how many."""

    rows: torch.Tensor | None
    number: int
    length: int


def _runs(lengths: list[int], device: torch.device) -> list[_Runs]:
    """Consecutive runs of `lengths` rows grouped by length, so that attention takes each group in one
    call (a large image's windows are mostly of one size) rather than one call a run."""
    starts: dict[int, list[int]] = {}
    at = 0
    for length in lengths:
        starts.setdefault(length, []).append(at)
        at += length
    if len(starts) == 1:
        ((length, first),) = starts.items()
        return [_Runs(None, len(first), length)]
    return [
        _Runs((torch.tensor(s)[:, None] + torch.arange(length)).flatten().to(device), len(s), length)
        for length, s in starts.items()
    ]


class _Block(nn.Module):
    def __init__(self, hidden: int, inter: int, heads: int, act: str) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = _Norm(hidden), _Norm(hidden)
        self.attn = nn.ModuleDict({"qkv": nn.Linear(hidden, 3 * hidden), "proj": nn.Linear(hidden, hidden)})
        self.mlp = nn.ModuleDict(
            {
                "gate_proj": nn.Linear(hidden, inter),
                "up_proj": nn.Linear(hidden, inter),
                "down_proj": nn.Linear(inter, hidden),
            }
        )
        self.act = activation(act)

    def forward(
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], runs: list[_Runs]
    ) -> torch.Tensor:
        """`x` [N, hidden]: attention within each run of rows (a window, or a whole image; `_runs`)."""
        n = x.shape[0]
        q, k, v = self.attn["qkv"](self.norm1(x)).view(n, 3, self.heads, -1).unbind(1)
        cos, sin = cos_sin
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        out = q if len(runs) == 1 and runs[0].rows is None else torch.empty_like(q)
        for group in runs:  # the runs of one length at once: [runs, heads, length, d]
            a, b, c = (t if group.rows is None else t[group.rows] for t in (q, k, v))
            a, b, c = (
                t.reshape(group.number, group.length, self.heads, -1).transpose(1, 2) for t in (a, b, c)
            )
            o = F.scaled_dot_product_attention(a, b, c).transpose(1, 2).reshape(-1, self.heads, q.shape[-1])
            if group.rows is None:
                out = o
            else:
                out[group.rows] = o
        x = x + self.attn["proj"](out.reshape(n, -1))
        m = self.mlp
        h = self.norm2(x)
        return x + m["down_proj"](self.act(m["gate_proj"](h)) * m["up_proj"](h))


def _image_layout(
    grid: tuple[int, int, int], merge: int, window: int
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """One image's (t, h, w) grid in patches: each patch's (h, w) position [h * w * t, 2] in the
    processor's order (2x2 merge blocks, row-major), the order of its merge blocks window by window
    (`window` blocks a side), and each window's patch count."""
    t, h, w = grid
    hs, ws = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    shape = (h // merge, merge, w // merge, merge)
    pos = torch.stack([p.reshape(shape).transpose(1, 2).flatten() for p in (hs, ws)], dim=-1).repeat(t, 1)
    gh, gw = h // merge, w // merge
    index = torch.arange(t * gh * gw).view(t, gh, gw)
    order, lengths = [], []
    for frame in index:
        for r in range(0, gh, window):
            for c in range(0, gw, window):
                cell = frame[r : r + window, c : c + window].flatten()
                order.append(cell)
                lengths.append(cell.numel() * merge * merge)
    return pos, torch.cat(order), lengths


class Qwen25VLEncoder(VisionEncoder):
    input_names = ("pixel_values", "image_grid_thw")

    def __init__(self, spec: VisionSpec, text_hidden: int) -> None:
        super().__init__()
        self.spec = spec
        v = spec.config["vision_config"]
        hidden, heads = int(v["hidden_size"]), int(v["num_heads"])
        self.hidden, self.heads, self.inter = hidden, heads, int(v["intermediate_size"])
        self.patch, self.merge = int(v.get("patch_size", 14)), int(v.get("spatial_merge_size", 2))
        self.frames, channels = int(v.get("temporal_patch_size", 2)), int(v.get("in_channels", 3))
        self.window = int(v.get("window_size", 112)) // self.merge // self.patch
        self.full = set(int(i) for i in v.get("fullatt_block_indexes", ()))
        theta = float((v.get("rope_parameters") or {}).get("rope_theta", v.get("rope_theta", 10000.0)))
        spatial = hidden // heads // 2
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
        self.patch_embed = _PatchEmbed(channels, hidden, self.frames, self.patch)
        act = str(v.get("hidden_act", "silu"))
        self.blocks = nn.ModuleList(_Block(hidden, self.inter, heads, act) for _ in range(int(v["depth"])))
        out = int(v.get("out_hidden_size", text_hidden))
        if out != text_hidden:
            raise ValueError(f"the vision merger's out_hidden_size {out} is not the decoder's {text_hidden}")
        self.merger = _Merger(hidden, self.merge**2, out)

    def encode(self, images: list[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
        dev = self.merger.ln_q.weight.device
        unit = self.merge**2
        positions, orders, windows, wholes, rows = [], [], [], [], []
        start = 0  # merge blocks before this image
        # the grids on the host, in one read (on a GPU: the call's one sync, before its kernels are queued)
        grids: list[list[int]] = torch.stack([grid for _, grid in images]).tolist()
        for t, h, w in grids:
            pos, order, lengths = _image_layout((t, h, w), self.merge, self.window)
            positions.append(pos)
            orders.append(order + start)
            windows += lengths
            wholes.append(t * h * w)
            rows.append(t * h * w // unit)
            start += t * h * w // unit
        order = torch.cat(orders).to(dev)
        x = torch.cat([p for p, _ in images]).to(dev)
        x = self.patch_embed(x)
        x = x.view(-1, unit, self.hidden)[order].view(-1, self.hidden)  # window by window
        freqs = torch.cat(positions).to(dev)[..., None].float() * self.inv_freq.to(dev)  # [N, 2, d / 4]
        emb = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        emb = torch.cat([emb, emb], dim=-1).view(-1, unit, emb.shape[-1] * 2)[order].flatten(0, 1)
        cos_sin = (emb.cos()[:, None], emb.sin()[:, None])
        by_window, by_image = _runs(windows, dev), _runs(wholes, dev)
        for i, block in enumerate(self.blocks):
            x = block(x, cos_sin, by_image if i in self.full else by_window)
        merged = self.merger(x)[torch.argsort(order)]  # back in the processor's order
        return list(merged.split(rows))

    def activation_bytes(self, images: int, dtype: torch.dtype) -> int:
        """About the peak of `encode` over `images` of the largest size: a few [patches, hidden] and
        [patches, inter] buffers and the fp32 rotary tables; attention runs one window or image at a time
        (its scores never all at once on a fused kernel)."""
        patches = self.spec.tokens_per_image * self.merge**2
        per_image = patches * (8 * self.hidden + 3 * self.inter) * torch.finfo(dtype).bits // 8
        return images * (per_image + patches * self.hidden * 2 * 4)

    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        name = name.removeprefix("model.")
        if not name.startswith("visual."):
            return False
        own = name.removeprefix("visual.")
        params = dict(self.named_parameters())
        if own not in params:
            raise ValueError(f"checkpoint weight {name!r} is not one of Qwen2.5-VL's vision encoder")
        self.place(own, name, tensor)
        return True


class ProcessedImages(NamedTuple):
    """One prompt's images through a processor's image processor."""

    inputs: dict[str, Any]  # the image processor's output (pixel values, grids or sizes)
    rows: list[int]  # each image's run of image tokens


class QwenVLProcessor:
    """Qwen2.5-VL's processor from its parts: transformers' image processor (`AutoImageProcessor`: every
    resize and normalisation is its) and the checkpoint's tokenizer and chat template; each image's
    `<|image_pad|>` expanded to its rows, one per merged 2x2 block, as `Qwen2_5_VLProcessor` does."""

    image_token = "<|image_pad|>"

    def __init__(self, model_path: str | Path) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer

        self.image_processor = AutoImageProcessor.from_pretrained(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.chat_template = self.tokenizer.chat_template
        path = Path(model_path) / "chat_template.json"
        if self.chat_template is None and path.is_file():
            self.chat_template = json.loads(path.read_text())["chat_template"]
        if self.chat_template is None and (Path(model_path) / "chat_template.jinja").is_file():
            self.chat_template = (Path(model_path) / "chat_template.jinja").read_text()

    def apply_chat_template(self, chat: list[dict[str, Any]], tokenize: bool = False, **kwargs: Any) -> str:
        assert not tokenize, "the prompter tokenizes the expanded text itself"
        kwargs.setdefault("chat_template", self.chat_template)
        return str(self.tokenizer.apply_chat_template(chat, tokenize=False, **kwargs))

    def process_images(self, images: list[Any], return_tensors: str) -> ProcessedImages:
        """One prompt's `images` processed, each image's rows one per merged block of its grid."""
        out = dict(self.image_processor(images=images, return_tensors=return_tensors))
        merge = int(self.image_processor.merge_size) ** 2
        return ProcessedImages(out, [int(g.prod()) // merge for g in out["image_grid_thw"]])

    def __call__(
        self, text: str, images: list[Any] | None, return_tensors: str = "pt", add_special_tokens: bool = True
    ) -> dict[str, Any]:
        """The prompt's ids with each image's `image_token` expanded to its rows (`process_images`), and the
        images' processed inputs."""
        out: dict[str, Any] = {}
        if images:
            out, counts = self.process_images(images, return_tensors)
            parts = text.split(self.image_token)
            if len(parts) != len(counts) + 1:
                raise ValueError(f"{len(parts) - 1} image placeholders for {len(counts)} images")
            text = parts[0] + "".join(self.image_token * n + p for n, p in zip(counts, parts[1:]))
        ids = self.tokenizer(text, add_special_tokens=add_special_tokens, return_tensors=return_tensors)
        out["input_ids"] = ids["input_ids"]
        return out
