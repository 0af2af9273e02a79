"""LLaVA-OneVision end to end, offline: the encoder's rows equal transformers' `get_image_features` (grids
scaled down past `anyres_max_N`, grids kept, and a prompt's several images each its base crop), and greedy
tokens equal transformers' `LlavaOnevisionForConditionalGeneration` on a tiny random checkpoint: one and
two images, text before, between and after, chunks that cut through an image, page sizes 1 and 16; the
radix cache keyed by image content. (transformers' `LlavaOnevisionProcessor` needs torchvision, so both
sides take `OnevisionProcessor`'s inputs; transformers checks each image's run has its rows.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from gapless import LLM, SamplingParams
from gapless.testing.vision_checkpoints import make_llava_onevision_checkpoint

MAX_TOKENS = 10


def _image(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


# alone: A a 2 x 3 grid, unpadded and scaled to 4 x 8 patches (52 rows); E a 1 x 2 grid kept (52 rows,
# none scaled); D a 3 x 2 grid scaled to 6 x 4 (46 rows). Together, each image is its base crop (17 rows)
IM_A, IM_B, IM_C, IM_D, IM_E = (
    _image(40, 70, 0),
    _image(90, 30, 1),
    _image(40, 70, 2),
    _image(60, 40, 3),
    _image(20, 40, 5),
)


def _chat(*parts: object) -> list[dict]:
    content = [
        {"type": "text", "text": p} if isinstance(p, str) else {"type": "image", "image": p} for p in parts
    ]
    return [{"role": "user", "content": content}]


CONVS = [
    _chat("Describe", IM_A, "briefly please"),  # text before and after one image
    _chat("First", IM_A, "then", IM_B, "compare them"),  # two images (base crops), text between
    _chat(IM_E, "what now"),  # an image first
    _chat("And", IM_D),  # an image last
]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_llava_onevision_checkpoint(tmp_path_factory.mktemp("llava_onevision"))


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import LlavaOnevisionForConditionalGeneration

    return LlavaOnevisionForConditionalGeneration.from_pretrained(ckpt).eval()


def _inputs(ckpt, conv: list[dict]) -> dict:
    from gapless.engine.image_io import ImageLimits, split_chat
    from gapless.model.vision.llava_onevision import OnevisionProcessor

    chat, images = split_chat(conv, ImageLimits())
    processor = OnevisionProcessor(ckpt)
    out = processor(processor.apply_chat_template(chat, add_generation_prompt=True), images)
    return dict(out, attention_mask=torch.ones_like(out["input_ids"]))


@pytest.fixture(scope="module")
def reference(ckpt, hf):
    """transformers' greedy tokens for each conversation of CONVS (and the first with image C)."""
    out = []
    for conv in [*CONVS, _chat("Describe", IM_C, "briefly please")]:
        inputs = _inputs(ckpt, conv)
        with torch.no_grad():
            ids = hf.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
        out.append(ids[0, inputs["input_ids"].shape[1] :].tolist())
    return out


@pytest.mark.parametrize(
    "images, rows",
    [([IM_A], [52]), ([IM_E], [52]), ([IM_D], [46]), ([IM_A, IM_B], [17, 17])],
    ids=["scaled", "kept", "scaled-tall", "several"],
)
def test_encoder_equals_transformers(ckpt, hf, images, rows):
    from gapless.model.config import load_model_config
    from gapless.model.vision import new_encoder
    from gapless.model.vision.llava_next import anyres_inputs
    from gapless.model.vision.llava_onevision import OnevisionProcessor

    processor = OnevisionProcessor(ckpt)
    out = processor("x<image>" * len(images), images)
    spec = load_model_config(ckpt).vision
    encoder = new_encoder(spec, 64, torch.float32, torch.device("cpu"))
    for name, tensor in hf.state_dict().items():
        encoder.load_weight(name, tensor)
    assert encoder.missing_weights() == []
    inputs, lengths = anyres_inputs(out, len(images), processor)
    assert lengths == rows and int((out["input_ids"] == spec.image_token_id).sum()) == sum(rows)
    with torch.no_grad():
        ours = encoder.encode(inputs)
        theirs = hf.model.get_image_features(
            out["pixel_values"], out["image_sizes"], batch_num_images=out["batch_num_images"]
        ).pooler_output
    assert [o.shape[0] for o in ours] == rows
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "options",
    [
        dict(page_size=1, chunked_prefill_size=13),  # overlap on; chunks of 13 cut through every image
        dict(page_size=16, overlap=False),  # whole prompts in one batch, the plain loop
        dict(page_size=16, chunked_prefill_size=30, cpu_worker="process"),  # in the device process
        pytest.param(
            dict(device="cuda", dtype="float32", page_size=16, chunked_prefill_size=13),
            marks=pytest.mark.skipif(
                not torch.cuda.is_available(), reason="needs CUDA (the CPU cases cover it)"
            ),
        ),
    ],
    ids=["page1-chunk13", "page16-plain", "page16-chunk30-process", "cuda-page16-chunk13"],
)
def test_greedy_equals_transformers(ckpt, reference, options):
    with LLM(str(ckpt), **{"device": "cpu", **options}) as llm:
        outs = llm.chat(CONVS, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == reference[:4]
        token = llm.engine.vision.image_token_id
        assert [o.prompt_token_ids.count(token) for o in outs] == [52, 17 + 17, 52, 46]
        runner = llm.engine._runner
        if runner is not None:  # (in this process) each image encoded once per request, chunked or not
            assert runner.encoder_cache.encoded == 5
            assert runner.encoder_cache.kept == {}
        llm.check_integrity()


def test_prefix_cache_keys_images_by_content(ckpt, reference):
    with LLM(str(ckpt), device="cpu", page_size=1) as llm:
        first = llm.chat(CONVS[0], GREEDY, use_tqdm=False)[0]
        ids = first.prompt_token_ids
        token = llm.engine.vision.image_token_id
        start, end = ids.index(token), len(ids) - ids[::-1].index(token)
        again = llm.chat(CONVS[0], GREEDY, use_tqdm=False)[0]
        assert again.token_ids == reference[0]
        assert again.cached_tokens >= end  # the image's KV reused: a hit past its run
        other = llm.chat(_chat("Describe", IM_C, "briefly please"), GREEDY, use_tqdm=False)[0]
        assert other.token_ids == reference[4]
        assert other.prompt_token_ids == ids  # the same ids: only the pixels differ
        assert other.cached_tokens <= start  # a miss from the image on
        llm.check_integrity()


def test_configs_refused_by_name(ckpt):
    import json

    from gapless.model.vision.llava_onevision import llava_onevision_spec

    cfg = json.loads((ckpt / "config.json").read_text())
    assert llava_onevision_spec(cfg).tokens_per_image == 56  # the largest grid's rows, scaled
    for key, value, message in [
        ("vision_feature_select_strategy", "default", "'full': SigLIP has no class token"),
        ("vision_aspect_ratio", "anyres", "vision_aspect_ratio='anyres' is not supported"),
        ("vision_feature_layer", [-1, -2], "several layers"),
        ("image_grid_pinpoints", [[28, 50]], "not multiples of the tower's 28 px"),
    ]:
        with pytest.raises(ValueError, match=message):
            llava_onevision_spec({**cfg, key: value})
    clip = {**cfg, "vision_config": {"model_type": "clip_vision_model"}}
    with pytest.raises(ValueError, match="'clip_vision_model' vision tower is not supported"):
        llava_onevision_spec(clip)
