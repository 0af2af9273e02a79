"""Images in prompts, on the host: reading them (PIL images, paths, `data:` URLs, bytes) under the
server's limits, and turning a chat with images into prompt ids and `PromptImage`s with the model's own
processor (transformers' `AutoProcessor`: gapless resizes and normalises nothing itself).

Each `PromptImage` is a run of image tokens in the prompt, the processor's inputs for it, and a key drawn
from a hash of those inputs. The radix cache sees the key in place of the run's token ids
(`Req.cache_ids`), so a repeated image reuses its KV and a different one never does.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from gapless.config import DEFAULT_MAX_IMAGES, DEFAULT_MAX_PIXELS, EngineConfig, parse_limit_mm

FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")  # what an image may be encoded as


class ImageError(ValueError):
    """A bad image in a request; `param` names where it is (`messages[0].content[1]`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class ImageLimits(NamedTuple):
    """What one prompt may bring: images (`--limit-mm-per-prompt image=N`) and pixels per image."""

    max_images: int = DEFAULT_MAX_IMAGES
    max_pixels: int = DEFAULT_MAX_PIXELS

    @classmethod
    def of(cls, cfg: EngineConfig) -> ImageLimits:
        return cls(parse_limit_mm(cfg.limit_mm_per_prompt), cfg.max_image_pixels)


def image_bytes(url: str, param: str) -> bytes:
    """The bytes of an `image_url`: a base64 `data:` URL. Remote URLs are refused: gapless fetches
    nothing on a client's behalf."""
    if url.startswith(("http://", "https://")):
        raise ImageError("remote image URLs are not fetched; send the image as a data: URL (base64)", param)
    if not url.startswith("data:"):
        raise ImageError("an image URL must be a data: URL (data:image/png;base64,...)", param)
    head, sep, data = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise ImageError("a data: URL's image must be base64 (data:image/png;base64,...)", param)
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the data: URL is not valid base64", param) from None


def open_image(src: Any, param: str, limits: ImageLimits) -> Any:
    """A decoded PIL image from a PIL image, a path, a `data:` URL or encoded bytes; an `ImageError`
    naming `param` when it is broken, of an unsupported format or past the pixel limit (checked before
    the pixels are decoded)."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(src, Image.Image):
        _check_pixels(src.size, param, limits)
        return src
    if isinstance(src, str) and src.startswith(("data:", "http://", "https://")):
        src = image_bytes(src, param)
    if isinstance(src, (str, Path)):
        try:
            src = Path(src).read_bytes()
        except OSError as e:
            raise ImageError(f"cannot read the image file: {e.strerror or e}", param) from None
    if not isinstance(src, (bytes, bytearray)):
        raise ImageError(f"an image must be a PIL image, a path, a data: URL or bytes, not {type(src).__name__}", param)
    try:
        image = Image.open(io.BytesIO(src))
        if image.format not in FORMATS:
            raise ImageError(f"image format {image.format} is not supported (supported: {', '.join(FORMATS)})", param)
        _check_pixels(image.size, param, limits)
        image.load()
    except ImageError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise ImageError(f"the image cannot be decoded ({e})", param) from None
    return image


def _check_pixels(size: tuple[int, int], param: str, limits: ImageLimits) -> None:
    w, h = size
    if w < 1 or h < 1:
        raise ImageError(f"the image is empty ({w}x{h})", param)
    if w * h > limits.max_pixels:
        raise ImageError(f"the image has {w}x{h} = {w * h} pixels, more than the limit {limits.max_pixels}", param)


def check_count(n: int, limits: ImageLimits, param: str = "messages") -> None:
    if n > limits.max_images:
        raise ImageError(
            f"{n} images in one prompt, more than the limit {limits.max_images} (--limit-mm-per-prompt)", param
        )


def split_chat(messages: list[dict[str, Any]], limits: ImageLimits) -> tuple[list[dict[str, Any]], list[Any]]:
    """A chat whose messages may hold image parts (`{"type": "image_url", "image_url": {"url": ...}}`,
    `{"type": "image", "image": PIL image or path}`), as the processor's template takes it (each image an
    `{"type": "image"}` part) and its images, opened and checked, in order."""
    chat, images = [], []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            chat.append(m)
            continue
        parts = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type")
            if kind == "text":
                parts.append({"type": "text", "text": part.get("text") or ""})
                continue
            if kind == "image_url":
                url = part.get("image_url")
                src = url.get("url") if isinstance(url, dict) else url
            elif kind == "image":
                src = part.get("image", part.get("path"))
            else:
                raise ImageError(f"content of type {kind!r} is not supported", where)
            if src is None:
                raise ImageError("the image part names no image", where)
            images.append(open_image(src, where, limits))
            parts.append({"type": "image"})
        chat.append({**m, "content": parts})
    check_count(len(images), limits)
    return chat, images


@dataclass(frozen=True)
class PromptImage:
    """One image of a prompt: its run of tokens [start, start + length), the processor's inputs for it (in
    the encoder's `input_names` order) and its key, a negative id drawn from a hash of those inputs."""

    start: int
    length: int
    inputs: tuple[torch.Tensor, ...]
    key: int


def image_key(inputs: tuple[torch.Tensor, ...]) -> int:
    """A negative id from a hash of an image's processed inputs: never a token id, equal for equal images."""
    h = hashlib.sha256()
    for t in inputs:
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.contiguous().numpy().tobytes())
    return -1 - int.from_bytes(h.digest()[:7], "little")


class ImagePrompter:
    """A vision-language model's chats to prompt ids and images, through its processor."""

    def __init__(self, model_path: str, image_token_id: int, limits: ImageLimits) -> None:
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(model_path)
        self.image_token_id = image_token_id
        self.limits = limits

    def render(
        self, chat: list[dict[str, Any]], images: list[Any], template_kwargs: dict[str, Any] | None = None
    ) -> tuple[list[int], tuple[PromptImage, ...]]:
        """The prompt ids of `chat` (image parts as `{"type": "image"}`) with each image's placeholder
        expanded as the processor expands it, and its images."""
        text = self.processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False, **(template_kwargs or {}))
        # special tokens as the processor's own apply_chat_template adds them: unless the text has the BOS
        bos = self.processor.tokenizer.bos_token
        special = not (bos is not None and text.startswith(bos))
        out = self.processor(text=text, images=images or None, return_tensors="pt", add_special_tokens=special)
        ids: list[int] = out["input_ids"][0].tolist()
        pixels = out["pixel_values"] if images else None
        runs = _runs(ids, self.image_token_id, len(images))
        made = []
        for i, (start, length) in enumerate(runs):
            assert pixels is not None
            inputs = (pixels[i].contiguous(),)
            made.append(PromptImage(start, length, inputs, image_key(inputs)))
        return ids, tuple(made)


def _runs(ids: list[int], token: int, images: int) -> list[tuple[int, int]]:
    """(start, length) of each image's run of `token` in `ids`: the runs split evenly (adjacent images'
    runs touch), as many as there are images."""
    pos = [i for i, t in enumerate(ids) if t == token]
    if not images:
        if pos:
            raise ValueError("the prompt holds image tokens but no image was given")
        return []
    if len(pos) % images:
        raise ValueError(f"{len(pos)} image tokens for {images} images")
    n = len(pos) // images
    runs = [(pos[k * n], n) for k in range(images)]
    for start, length in runs:
        if pos[pos.index(start) + length - 1] != start + length - 1:
            raise ValueError("an image's tokens are not one run")
    return runs
