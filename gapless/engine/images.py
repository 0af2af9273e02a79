"""Images in prompts, on the host: a chat with images turned into prompt ids and `PromptImage`s by the
model's own processor (transformers' `AutoProcessor`: gapless resizes and normalises nothing itself).
Reading and checking the images is `gapless.engine.image_io`'s.

Each `PromptImage` is a run of image tokens in the prompt, the processor's inputs for it, and a key drawn
from a hash of those inputs. The radix cache sees the key in place of the run's token ids
(`Req.cache_ids`), so a repeated image reuses its KV and a different one never does.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from gapless.config import EngineConfig
from gapless.engine.image_io import ImageLimits


@dataclass(frozen=True)
class PromptImage:
    """One image of a prompt: its run of tokens [start, start + length), the processor's inputs for it (in
    the encoder's `input_names` order) and its key, a negative id drawn from a hash of those inputs."""

    start: int
    length: int
    inputs: tuple[torch.Tensor, ...]
    key: int
    # its tokens attend to each other both ways (`VisionSpec.bidirectional`, set by `Engine.add_request`):
    # its run is prefilled in one chunk (`chunk_tokens`), each token seeing the run's last
    bidirectional: bool = False


def chunk_tokens(images: tuple[PromptImage, ...], start: int, n: int) -> int:
    """How many of the `n` tokens from position `start` a prefill chunk computes so that it never ends
    inside an image prefilled whole (`PromptImage.bidirectional`): `n`, or fewer to end before such an
    image, or - where the chunk starts at or inside it - more, to end at its end (a budget overrun of at
    most one image's tokens)."""
    end = start + n
    for im in images:
        if im.bidirectional and im.start < end < im.start + im.length:
            return im.start - start if im.start > start else im.start + im.length - start
    return n


def image_key(inputs: tuple[torch.Tensor, ...]) -> int:
    """A negative id from a hash of an image's processed inputs: never a token id, equal for equal images."""
    h = hashlib.sha256()
    for t in inputs:
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.contiguous().numpy().tobytes())
    return -1 - int.from_bytes(h.digest()[:7], "little")


def image_prompter(cfg: EngineConfig) -> ImagePrompter | None:
    """The processor of `cfg`'s model (its model made local) when it is a vision-language model, else None."""
    from gapless.model.config import load_model_config

    spec = load_model_config(cfg.model).vision
    return ImagePrompter(cfg, spec.image_token_id) if spec is not None else None


def _processor(cfg: EngineConfig) -> Any:
    """The processor of `cfg`'s (local) model: a checkpoint's own, or a GGUF file's built from its vision
    projector and its tokenizer (`gguf_vision.new_processor`)."""
    from gapless.model import gguf, gguf_vision
    from gapless.model.source import load_tokenizer
    from gapless.model.vision import new_processor

    if gguf.is_gguf_file(cfg.model):
        return gguf_vision.new_processor(cfg.model, load_tokenizer(cfg))
    return new_processor(cfg.model)


class ImagePrompter:
    """A vision-language model's chats to prompt ids and images, through its processor."""

    def __init__(self, cfg: EngineConfig, image_token_id: int) -> None:
        self.processor = _processor(cfg)
        self.image_token_id = image_token_id
        self.limits = ImageLimits.of(cfg)

    def render(
        self, chat: list[dict[str, Any]], images: list[Any], template_kwargs: dict[str, Any] | None = None
    ) -> tuple[list[int], tuple[PromptImage, ...]]:
        """The prompt ids of `chat` (image parts as `{"type": "image"}`) with each image's placeholder
        expanded as the processor expands it, and its images. `template_kwargs`: the template's variables
        (and `chat_template`, `add_generation_prompt`: an assistant turn opened unless it is False)."""
        kwargs = {"add_generation_prompt": True, **(template_kwargs or {})}
        text = self.processor.apply_chat_template(chat, tokenize=False, **kwargs)
        # special tokens as the processor's own apply_chat_template adds them: unless the text has the BOS
        bos = self.processor.tokenizer.bos_token
        special = not (bos is not None and text.startswith(bos))
        out = self.processor(
            text=text, images=images or None, return_tensors="pt", add_special_tokens=special
        )
        ids: list[int] = out["input_ids"][0].tolist()
        per_image, lengths = _per_image(out, len(images), self.processor)
        runs = _runs(ids, self.image_token_id, len(images), lengths)
        made = [
            PromptImage(start, length, inputs, image_key(inputs))
            for (start, length), inputs in zip(runs, per_image)
        ]
        return ids, tuple(made)


def _per_image(out: Any, n: int, processor: Any) -> tuple[list[tuple[torch.Tensor, ...]], list[int] | None]:
    """Each image's inputs from the processor's outputs for `n` images (each its own memory, not a view of
    the batch's) and, where images differ in size, each one's run length (else None: runs of one length).
    Qwen2.5-VL's patches of every image come as one tensor, cut by each image's grid; LLaVA-NeXT's crops
    are padded to the batch's most, cut by each image's tiles."""
    if not n:
        return [], None
    if "image_sizes" in out:  # LLaVA-NeXT's tiles: each image's own crops and size
        from gapless.model.vision.llava_next import anyres_inputs

        return anyres_inputs(out, n, processor)
    if "image_grid_thw" in out:
        grids = out["image_grid_thw"]
        sizes = [int(g.prod()) for g in grids]
        merge = int(processor.image_processor.merge_size) ** 2
        patches = out["pixel_values"].split(sizes)
        return [(p.clone(), g.clone()) for p, g in zip(patches, grids)], [s // merge for s in sizes]
    return [(out["pixel_values"][i].clone(),) for i in range(n)], None


def _runs(ids: list[int], token: int, images: int, lengths: list[int] | None) -> list[tuple[int, int]]:
    """(start, length) of each image's run of `token` in `ids`, in order: of `lengths`, else split evenly
    (adjacent images' runs touch), as many as there are images."""
    pos = [i for i, t in enumerate(ids) if t == token]
    if not images:
        if pos:
            raise ValueError("the prompt holds image tokens but no image was given")
        return []
    if lengths is None:
        if len(pos) % images:
            raise ValueError(f"{len(pos)} image tokens for {images} images")
        lengths = [len(pos) // images] * images
    if len(pos) != sum(lengths):
        raise ValueError(f"{len(pos)} image tokens for images of {sum(lengths)} rows")
    runs, k = [], 0
    for length in lengths:
        start = pos[k]
        if pos[k + length - 1] != start + length - 1:
            raise ValueError("an image's tokens are not one run")
        runs.append((start, length))
        k += length
    return runs
