"""Reading a prompt's images on the host, without torch (the API server checks them before anything is
queued): PIL images, paths, base64 `data:` URLs or bytes, under the limits (`--limit-mm-per-prompt`,
`--max-image-pixels`); a bad one is an `ImageError` naming where it is (`messages[0].content[1]`)."""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from typing import Any, NamedTuple

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
    """The bytes of an `image_url`: a base64 `data:` URL. Remote URLs are refused here, offline: only the
    server fetches them, when told to (`gapless.server.media`)."""
    if url.startswith(("http://", "https://")):
        raise ImageError(
            "remote image URLs are not fetched offline; pass a path, a PIL image or a data: URL", param
        )
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
        raise ImageError(
            f"an image must be a PIL image, a path, a data: URL or bytes, not {type(src).__name__}", param
        )
    try:
        image = Image.open(io.BytesIO(src))
        if image.format not in FORMATS:
            raise ImageError(
                f"image format {image.format} is not supported (supported: {', '.join(FORMATS)})", param
            )
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
        raise ImageError(
            f"the image has {w}x{h} = {w * h} pixels, more than the limit {limits.max_pixels}", param
        )


def check_count(n: int, limits: ImageLimits, param: str = "messages") -> None:
    if n > limits.max_images:
        raise ImageError(
            f"{n} images in one prompt, more than the limit {limits.max_images} (--limit-mm-per-prompt)",
            param,
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
