"""Images through the forward: which image tokens an extend batch computes (`image_batch`, on the
host), their M-RoPE positions where the model has them (`rope_batch`), and, on the device, the encoder's
rows for them (`EncoderCache.rows`).

An extend batch carries, per image run it cuts (`ImageSpan`), where the run's tokens sit in the batch,
which of the image's rows they are, and the image's inputs. The device encodes the images it has not
encoded for that request-table row yet, all of the batch's at once, and writes their rows over the
token embeddings (`gapless.model.decoder.ImageRows`). A chunked prefill that stops inside an image keeps
that image's rows for the row's next chunk: each image is encoded once per request, and the cache holds
at most one image per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gapless.engine.request import Extend
from gapless.model.decoder import ImageRows
from gapless.model.vision.base import VisionEncoder
from gapless.model.vision.mrope import rope_rows


@dataclass
class ImageSpan:
    """Tokens [offset, offset + length) of one image's run, at flat tokens [flat, flat + length) of the
    batch, for request-table `row`; `last`: they end the run."""

    row: int
    key: int  # the image's key (`PromptImage.key`)
    flat: int
    offset: int
    length: int
    last: bool
    inputs: tuple[torch.Tensor, ...]


@dataclass
class ImageBatch:
    """The image runs an extend batch computes, in flat-token order."""

    spans: tuple[ImageSpan, ...]


def image_batch(entries: list[Extend], q_start: list[int]) -> ImageBatch | None:
    """The image spans of an extend batch (`entries`, each request's tokens starting at flat `q_start`;
    `kv_len` already advanced past them); None when it computes no image token."""
    spans = []
    for e, q in zip(entries, q_start):
        req = e.req
        lo, hi = req.kv_len - e.tokens, req.kv_len
        for im in req.images:
            a, b = max(lo, im.start), min(hi, im.start + im.length)
            if a < b:
                assert req.row is not None
                last = b == im.start + im.length
                spans.append(ImageSpan(req.row, im.key, q + a - lo, a - im.start, b - a, last, im.inputs))
    return ImageBatch(tuple(spans)) if spans else None


def image_limits(entries: list[Extend], q_start: list[int], positions: torch.Tensor) -> torch.Tensor | None:
    """Each flat token's last visible position (`AttentionMetadata.q_limits`) where the batch computes an
    image whose tokens attend both ways (`PromptImage.bidirectional`): its tokens see the run's last, the
    others themselves; None when there is none. Such a run is never cut (`images.chunk_tokens`)."""
    limits = None
    for e, q in zip(entries, q_start):
        req = e.req
        lo, hi = req.kv_len - e.tokens, req.kv_len
        for im in req.images:
            end = im.start + im.length
            if im.bidirectional and max(lo, im.start) < min(hi, end):
                assert hi >= end, "a prefill chunk ends inside an image that attends both ways"
                limits = positions.clone() if limits is None else limits
                limits[q + max(lo, im.start) - lo : q + end - lo] = end - 1
    return limits


@dataclass
class RopeBatch:
    """An M-RoPE model's extend whose requests' prompts hold images: each token's positions over time,
    height and width, and each request's delta (the rest of its positions: `gapless.model.vision.mrope`),
    which its row keeps for its decodes."""

    positions: torch.Tensor  # [3, T] int64
    deltas: torch.Tensor  # [B] int64, in the batch's rows order


def rope_batch(entries: list[Extend]) -> RopeBatch | None:
    """The M-RoPE positions of an extend batch (`kv_len` already advanced past its tokens); None when no
    request of it has images (every position its index, every delta 0)."""
    if all(e.req.rope is None for e in entries):
        return None
    rows = [rope_rows(e.req.rope, e.req.kv_len - e.tokens, e.req.kv_len) for e in entries]
    deltas = [e.req.rope.delta if e.req.rope is not None else 0 for e in entries]
    return RopeBatch(torch.cat(rows, dim=1).contiguous(), torch.tensor(deltas, dtype=torch.int64))


class EncoderCache:
    """The device's encoded images: per request-table row, the image whose run a chunk left unfinished."""

    def __init__(self, encoder: VisionEncoder, max_batch: int) -> None:
        """`max_batch`: the most images one encoder call takes (the memory plan's `encoder_images`)."""
        self.encoder, self.max_batch = encoder, max_batch
        self.kept: dict[int, tuple[int, torch.Tensor]] = {}  # row -> (image key, its rows)
        self.encoded = 0  # images encoded so far (the tests' and stats' count)

    def rows(self, batch: ImageBatch, device: torch.device) -> ImageRows:
        """The encoder's rows for `batch`'s image tokens, encoding the images not kept, `max_batch` a call."""
        todo = {}
        for s in batch.spans:
            kept = self.kept.get(s.row)
            if (kept is None or kept[0] != s.key) and (s.row, s.key) not in todo:
                todo[(s.row, s.key)] = s.inputs
        fresh = {}
        if todo:
            images = [tuple(t.to(device, non_blocking=True) for t in inputs) for inputs in todo.values()]
            step = self.max_batch
            out = [r for i in range(0, len(images), step) for r in self.encoder.encode(images[i : i + step])]
            fresh = dict(zip(todo, out))
            self.encoded += len(out)
        parts, index = [], []
        for s in batch.spans:
            rows = fresh.get((s.row, s.key))
            if rows is None:
                rows = self.kept[s.row][1]
            parts.append(rows[s.offset : s.offset + s.length])
            index.append(torch.arange(s.flat, s.flat + s.length, device=device))
            if s.last:
                self.kept.pop(s.row, None)
            else:
                self.kept[s.row] = (s.key, rows)
        return ImageRows(torch.cat(index), torch.cat(parts))
