"""The yardstick for the vision-language tests: transformers' greedy tokens for chats with images, and the
checks each family's end-to-end test makes of gapless against them (greedy tokens under a set of engine
options, the radix cache keyed by image content, requests retracted mid-decode)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image

from gapless import LLM, SamplingParams

if TYPE_CHECKING:
    from gapless.model.vision.base import VisionEncoder

Chat = list[dict[str, Any]]


def image(h: int, w: int, seed: int) -> Image.Image:
    """An `h` x `w` RGB image of random pixels from `seed`."""
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


def chat(*parts: object) -> Chat:
    """One user message of `parts`: a string is a text part, anything else an image part."""
    content = [
        {"type": "text", "text": p} if isinstance(p, str) else {"type": "image", "image": p} for p in parts
    ]
    return [{"role": "user", "content": content}]


def image_count(convs: Sequence[Chat]) -> int:
    """The image parts of `convs` (each encoded once per request)."""
    return sum(
        part.get("type") == "image"
        for conv in convs
        for message in conv
        if isinstance(message["content"], list)
        for part in message["content"]
    )


def chat_inputs(processor: Any, conv: Chat) -> dict[str, Any]:
    """A transformers processor's model inputs for `conv`, as its chat template lays it out."""
    return processor.apply_chat_template(
        conv, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )


def processor_inputs(processor: Any, conv: Chat) -> dict[str, Any]:
    """The model inputs of one of gapless's own processors (`QwenVLProcessor` and its kind) for `conv`,
    with the attention mask transformers' `generate` takes."""
    from gapless.engine.image_io import ImageLimits, split_chat

    text, images = split_chat(conv, ImageLimits())
    out = processor(processor.apply_chat_template(text, add_generation_prompt=True), images)
    return dict(out, attention_mask=torch.ones_like(out["input_ids"]))


@torch.no_grad()
def hf_chat_greedy(
    model: torch.nn.Module, inputs: Callable[[Chat], dict[str, Any]], convs: Sequence[Chat], max_tokens: int
) -> list[list[int]]:
    """transformers' greedy tokens (`generate`, `max_tokens` each) for each of `convs`, whose model inputs
    `inputs` makes."""
    out = []
    for conv in convs:
        x = inputs(conv)
        ids = model.generate(**x, max_new_tokens=max_tokens, do_sample=False)  # type: ignore[operator]  # why: nn.Module hides generate
        out.append(ids[0, x["input_ids"].shape[1] :].tolist())
    return out


def hf_encoder(ckpt: str | Path, hf: torch.nn.Module) -> VisionEncoder:
    """gapless's encoder for `ckpt` (fp32, CPU) with every vision weight of transformers' model `hf`."""
    from gapless.model.config import load_model_config
    from gapless.model.vision import new_encoder

    spec = load_model_config(ckpt).vision
    assert spec is not None, f"{ckpt} is not a vision-language checkpoint"
    encoder = new_encoder(spec, 64, torch.float32, torch.device("cpu"))
    for name, tensor in hf.state_dict().items():
        encoder.load_weight(name, tensor)
    assert encoder.missing_weights() == []
    return encoder


# the Triton extend kernel runs under the interpreter on a CPU-only machine; where a GPU is, on the GPU
# (without TRITON_INTERPRET the engine refuses the Triton backend on a CPU)
_TRITON_DEVICE = {"device": "cuda", "dtype": "float32"} if torch.cuda.is_available() else {}
_THIRD = {"process": {"cpu_worker": "process"}, "triton": {"attention_backend": "triton", **_TRITON_DEVICE}}


def greedy_cases(chunk: int, third_chunk: int, third: str = "process") -> list[Any]:
    """The engine options each family's greedy test runs under, with their test ids: pages of 1 with
    overlap and prefill chunks of `chunk` (they cut through, or must stop before, the images); pages of 16
    with whole prompts in one batch on the plain loop; pages of 16 in chunks of `third_chunk` in the
    device process (`third="process"`, in the slow tier) or on the Triton extend kernel (`"triton"`); on
    CUDA, fp32 pages of 16 in chunks of `chunk`."""
    import pytest

    cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the CPU cases cover it)")
    return [
        pytest.param(dict(page_size=1, chunked_prefill_size=chunk), id=f"page1-chunk{chunk}"),
        pytest.param(dict(page_size=16, overlap=False), id="page16-plain"),
        pytest.param(
            dict(page_size=16, chunked_prefill_size=third_chunk, **_THIRD[third]),
            marks=pytest.mark.slow if third == "process" else (),  # (a device process: ~7-9 s)
            id=f"page16-chunk{third_chunk}-{third}",
        ),
        pytest.param(
            dict(device="cuda", dtype="float32", page_size=16, chunked_prefill_size=chunk),
            marks=cuda,
            id=f"cuda-page16-chunk{chunk}",
        ),
    ]


def check_greedy_chats(
    ckpt: str | Path,
    options: dict[str, Any],
    convs: Sequence[Chat],
    params: SamplingParams,
    reference: list[list[int]],
    encoded: int,
    image_rows: list[int] | None = None,
) -> None:
    """`convs` chatted on an engine of `options` (on the CPU unless they say): the tokens are `reference`;
    each prompt holds `image_rows` image tokens (where given); in this process (not `cpu_worker="process"`)
    the encoder ran `encoded` images, each once per request, chunked or not, and kept no cut one."""
    # in this process unless `options` say otherwise (cpu_worker "auto" picks the device process on a
    # machine of 4 cores or more)
    with LLM(str(ckpt), **{"device": "cpu", "cpu_worker": "inline", **options}) as llm:
        outs = llm.chat(list(convs), params, use_tqdm=False)
        assert [o.token_ids for o in outs] == reference
        if image_rows is not None:
            token = llm.engine.vision.image_token_id
            assert [o.prompt_token_ids.count(token) for o in outs] == image_rows
        runner = llm.engine._runner
        if options.get("cpu_worker") != "process":
            assert runner is not None and runner.encoder_cache is not None
        if runner is not None:
            assert runner.encoder_cache.encoded == encoded
            assert runner.encoder_cache.kept == {}
        llm.check_integrity()


def check_prefix_cache_keys_images(
    ckpt: str | Path,
    conv: Chat,
    other: Chat,
    params: SamplingParams,
    tokens: list[int],
    other_tokens: list[int],
    rows: int,
) -> None:
    """Pages of 1: `conv` (one image of `rows` tokens) again hits the cache past its image; `other` (the
    same chat with a different image of the same size: the same ids) misses from the image on; the
    tokens are transformers' (`tokens`, `other_tokens`)."""
    with LLM(str(ckpt), device="cpu", page_size=1) as llm:
        first = llm.chat(conv, params, use_tqdm=False)[0]
        ids = first.prompt_token_ids
        token = llm.engine.vision.image_token_id
        start, end = ids.index(token), len(ids) - ids[::-1].index(token)
        assert end - start == rows  # the image's one run
        again = llm.chat(conv, params, use_tqdm=False)[0]
        assert again.token_ids == tokens
        assert again.cached_tokens >= end  # the image's KV reused: a hit past its run
        miss = llm.chat(other, params, use_tqdm=False)[0]
        assert miss.token_ids == other_tokens
        assert miss.prompt_token_ids == ids  # the same ids: only the pixels differ
        assert miss.cached_tokens <= start  # a miss from the image on
        llm.check_integrity()


def check_retraction(
    ckpt: str | Path,
    convs: Sequence[Chat],
    params: SamplingParams,
    reference: list[list[int]],
    **options: Any,
) -> None:
    """A KV pool too small for every conversation at once (`options` name its `kv_cache_tokens`): requests
    are retracted mid-decode and resume, under overlap with chaos delays and chunks of 16; the tokens stay
    `reference`."""
    eager = {"init_new_token_ratio": 0.02, "min_new_token_ratio": 0.02}
    engine = dict(cpu_worker="thread", chaos_seed=3, chunked_prefill_size=16, **eager, **options)
    with LLM(str(ckpt), device="cpu", **engine) as llm:
        outs = llm.chat(list(convs), params, use_tqdm=False)
        assert [o.token_ids for o in outs] == reference
        assert llm.engine.stats.retractions > 0
        llm.check_integrity()
