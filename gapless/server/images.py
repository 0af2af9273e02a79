"""Images between the server's processes: the API server's check of a chat's image parts (before anything
is queued) and a processed image's crossing from the tokenizer to the scheduler as msgspec structs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gapless.engine.image_io import ImageError, ImageLimits, check_count, image_bytes, open_image
from gapless.server import protocol as P
from gapless.server.errors import BadRequest

if TYPE_CHECKING:
    from gapless.engine.images import PromptImage


def check_image_url(url: object, param: str, limits: ImageLimits | None) -> bytes:
    """An `image_url` part's image bytes, decoded once to check it (broken, format, pixels); a 400 naming
    `param` otherwise, and for a model that takes no images."""
    if limits is None:
        raise BadRequest(f"{param}: this model takes no images (a text model)", param)
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str):
        raise BadRequest(f"{param}.image_url.url is missing: an image part needs a data: URL", param)
    try:
        data = image_bytes(url, param)
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
