"""Images between the server's processes: the API server's check of a chat's image parts (before anything
is queued; a remote URL's bytes fetched by `gapless.server.media` before) and a processed image's crossing
from the tokenizer to the scheduler as msgspec structs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from gapless.engine.image_io import ImageError, ImageLimits, check_count, image_bytes, open_image
from gapless.server import protocol as P
from gapless.server.errors import BadRequest
from gapless.server.media import REMOTE_OFF, RemoteImage, is_remote

if TYPE_CHECKING:
    from gapless.engine.images import PromptImage
    from gapless.server.openai_protocol import Message


DETAILS = ("auto", "low", "high")  # OpenAI's `detail` values: accepted, and the image is used as it is


def part_url(image_url: object, param: str) -> str:
    """An `image_url` part's URL (`{"url": ..., "detail": ...}` or the URL alone); a 400 naming `param`
    when it is missing or its `detail` is not one of OpenAI's."""
    detail = image_url.get("detail") if isinstance(image_url, dict) else None
    if detail is not None and detail not in DETAILS:
        why = f"must be one of {', '.join(DETAILS)}, not {detail!r}"
        raise BadRequest(f"{param}.image_url.detail {why}", param)
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str):
        why = "is missing: an image part needs a data: or http(s) URL"
        raise BadRequest(f"{param}.image_url.url {why}", param)
    return url


def check_image_url(
    image_url: object, param: str, limits: ImageLimits | None, fetched: Mapping[str, bytes] | None = None
) -> bytes:
    """An `image_url` part's image bytes (a remote URL's from `fetched`), decoded once to check it
    (broken, format, pixels); a 400 naming `param` otherwise, and for a model that takes no images."""
    if limits is None:
        raise BadRequest(f"{param}: this model takes no images (a text model)", param)
    url = part_url(image_url, param)
    if is_remote(url) and url not in (fetched or {}):
        raise BadRequest(f"{param}: {REMOTE_OFF}", param)
    try:
        data = (fetched or {})[url] if is_remote(url) else image_bytes(url, param)
        open_image(data, param, limits)
    except ImageError as e:
        raise BadRequest(str(e), e.param) from None
    return data


def check_image_count(n: int, limits: ImageLimits | None) -> None:
    if limits is not None:
        try:
            check_count(n, limits)
        except ImageError as e:
            raise BadRequest(str(e), e.param) from None


def to_wire(images: tuple[PromptImage, ...]) -> list[P.ImageIn]:
    return [
        P.ImageIn(
            im.start,
            im.length,
            im.key,
            [
                P.TensorBytes(str(t.dtype).removeprefix("torch."), list(t.shape), t.numpy().tobytes())
                for t in im.inputs
            ],
        )
        for im in images
    ]


def from_wire(images: list[P.ImageIn]) -> tuple[PromptImage, ...]:
    import torch

    from gapless.engine.images import PromptImage

    def tensor(t: P.TensorBytes) -> torch.Tensor:
        dtype = getattr(torch, t.dtype)
        return torch.frombuffer(bytearray(t.data), dtype=dtype).reshape(t.shape)

    return tuple(
        PromptImage(im.start, im.length, tuple(tensor(t) for t in im.inputs), im.key) for im in images
    )


def remote_images(messages: Sequence[Message], limits: ImageLimits | None) -> list[RemoteImage]:
    """The `http(s)` image URLs of a chat, each with its part, for `gapless.server.media` to fetch: none
    for a model that takes no images (its submission refuses them); a 400 for more images than the limit
    or a bad part, before anything is fetched."""
    if limits is None:
        return []
    found, count = [], 0
    for i, m in enumerate(messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
            if part.type == "image_url":
                count += 1
                param = f"messages[{i}].content[{j}]"
                url = part_url(part.image_url, param)
                if is_remote(url):
                    found.append(RemoteImage(url, param))
    check_image_count(count, limits)
    return found
