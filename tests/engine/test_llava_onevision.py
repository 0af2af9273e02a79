"""LLaVA-OneVision end to end, offline: the encoder's rows equal transformers' `get_image_features` (grids
scaled down past `anyres_max_N`, grids kept, and a prompt's several images each its base crop), and greedy
tokens equal transformers' `LlavaOnevisionForConditionalGeneration` on a tiny random checkpoint: one and
two images, text before, between and after, chunks that cut through an image, page sizes 1 and 16; the
radix cache keyed by image content. (transformers' `LlavaOnevisionProcessor` needs torchvision, so both
sides take `OnevisionProcessor`'s inputs; transformers checks each image's run has its rows.)"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from gapless import SamplingParams
from gapless.testing.vision_checkpoints import make_llava_onevision_checkpoint
from gapless.testing.vision_reference import (
    chat,
    check_greedy_chats,
    check_prefix_cache_keys_images,
    greedy_cases,
    hf_chat_greedy,
    hf_encoder,
    image,
    processor_inputs,
)

MAX_TOKENS = 10


# alone: A a 2 x 3 grid, unpadded and scaled to 4 x 8 patches (52 rows); E a 1 x 2 grid kept (52 rows,
# none scaled); D a 3 x 2 grid scaled to 6 x 4 (46 rows). Together, each image is its base crop (17 rows)
IM_A, IM_B, IM_C, IM_D, IM_E = (
    image(40, 70, 0),
    image(90, 30, 1),
    image(40, 70, 2),
    image(60, 40, 3),
    image(20, 40, 5),
)


CONVS = [
    chat("Describe", IM_A, "briefly please"),  # text before and after one image
    chat("First", IM_A, "then", IM_B, "compare them"),  # two images (base crops), text between
    chat(IM_E, "what now"),  # an image first
    chat("And", IM_D),  # an image last
]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_llava_onevision_checkpoint(tmp_path_factory.mktemp("llava_onevision"))


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import LlavaOnevisionForConditionalGeneration

    return LlavaOnevisionForConditionalGeneration.from_pretrained(ckpt).eval()


@pytest.fixture(scope="module")
def reference(ckpt, hf):
    """transformers' greedy tokens for each conversation of CONVS (and the first with image C)."""
    from gapless.model.vision.llava_onevision import OnevisionProcessor

    convs = [*CONVS, chat("Describe", IM_C, "briefly please")]
    return hf_chat_greedy(hf, partial(processor_inputs, OnevisionProcessor(ckpt)), convs, MAX_TOKENS)


@pytest.mark.parametrize(
    "images, rows",
    [([IM_A], [52]), ([IM_E], [52]), ([IM_D], [46]), ([IM_A, IM_B], [17, 17])],
    ids=["scaled", "kept", "scaled-tall", "several"],
)
def test_encoder_equals_transformers(ckpt, hf, images, rows):
    from gapless.model.vision.llava_next import anyres_inputs
    from gapless.model.vision.llava_onevision import OnevisionProcessor

    processor = OnevisionProcessor(ckpt)
    out = processor("x<image>" * len(images), images)
    encoder = hf_encoder(ckpt, hf)
    spec = encoder.spec
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


@pytest.mark.parametrize("options", greedy_cases(13, 30))
def test_greedy_equals_transformers(ckpt, reference, options):
    """Overlap on with chunks of 13 cutting through every image, the plain loop, the device process."""
    check_greedy_chats(
        ckpt, options, CONVS, GREEDY, reference[:4], encoded=5, image_rows=[52, 17 + 17, 52, 46]
    )


def test_prefix_cache_keys_images_by_content(ckpt, reference):
    other = chat("Describe", IM_C, "briefly please")
    check_prefix_cache_keys_images(ckpt, CONVS[0], other, GREEDY, reference[0], reference[4], rows=52)


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
