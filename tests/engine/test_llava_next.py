"""LLaVA-NeXT end to end, offline: the encoder's rows (base crop, unpadded tile grid, newlines) equal
transformers' `get_image_features`, and greedy tokens equal transformers' `LlavaNextForConditionalGeneration`
on a tiny random checkpoint: one and two images of different sizes and aspect ratios (different tile
grids, unpadding above and below or left and right, different run lengths), text before, between and
after, chunks that cut through an image, page sizes 1 and 16; the radix cache keyed by image content."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from gapless import SamplingParams
from gapless.testing.vision_checkpoints import make_llava_next_checkpoint
from gapless.testing.vision_reference import (
    chat,
    chat_inputs,
    check_greedy_chats,
    check_prefix_cache_keys_images,
    greedy_cases,
    hf_chat_greedy,
    hf_encoder,
    image,
)

MAX_TOKENS = 10


# A: a 2 x 2 grid cut above and below (52 rows); B: 3 x 1 tiles, nothing cut (76 rows); D: 2 x 2 cut
# left and right (72 rows); C: A's size, other pixels
IM_A, IM_B, IM_C, IM_D = image(40, 70, 0), image(90, 30, 1), image(40, 70, 2), image(60, 40, 3)
ROWS = {"A": 52, "B": 76, "D": 72}


CONVS = [
    chat("Describe", IM_A, "briefly please"),  # text before and after one image
    chat("First", IM_A, "then", IM_B, "compare them"),  # two images, different grids, text between
    chat(IM_D, "what now"),  # an image first
]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_llava_next_checkpoint(tmp_path_factory.mktemp("llava_next"))


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import LlavaNextForConditionalGeneration

    return LlavaNextForConditionalGeneration.from_pretrained(ckpt).eval()


@pytest.fixture(scope="module")
def processor(ckpt):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(ckpt)


@pytest.fixture(scope="module")
def reference(hf, processor):
    """transformers' greedy tokens for each conversation of CONVS (and the first with image C)."""
    convs = [*CONVS, chat("Describe", IM_C, "briefly please")]
    return hf_chat_greedy(hf, partial(chat_inputs, processor), convs, MAX_TOKENS)


def test_encoder_equals_transformers(ckpt, hf, processor):
    """Three images of three layouts in one call (the processor pads their crops to the most; each
    image's own are cut): each image's rows are transformers', and its run is as long as the processor
    expanded its placeholder."""
    from gapless.model.vision.llava_next import anyres_inputs

    out = processor(text="a<image>b<image>c<image>", images=[IM_A, IM_B, IM_D], return_tensors="pt")
    encoder = hf_encoder(ckpt, hf)
    spec = encoder.spec
    assert spec.family == "llava_next" and spec.tokens_per_image == 88  # a whole 2 x 2 grid's rows
    one, two = (encoder.activation_bytes(n, torch.float32) for n in (1, 2))
    assert 0 < one < two  # the memory plan's estimate grows with the images of a call
    inputs, lengths = anyres_inputs(out, 3, processor)
    assert lengths == [ROWS["A"], ROWS["B"], ROWS["D"]]
    assert int((out["input_ids"] == spec.image_token_id).sum()) == sum(lengths)
    assert [i[0].shape[0] for i in inputs] == [5, 4, 5]  # the base crop and the grid's tiles
    with torch.no_grad():
        ours = encoder.encode(inputs)
        theirs = hf.model.get_image_features(out["pixel_values"], out["image_sizes"]).pooler_output
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="an image of 4 crops; its size takes 5"):
        encoder.encode([(inputs[0][0][:4], inputs[0][1])])


@pytest.mark.parametrize("options", greedy_cases(23, 40))
def test_greedy_equals_transformers(ckpt, reference, options):
    """Overlap on with chunks of 23 cutting through every image, the plain loop, the device process."""
    check_greedy_chats(ckpt, options, CONVS, GREEDY, reference[:3], encoded=4, image_rows=[52, 52 + 76, 72])


def test_prefix_cache_keys_images_by_content(ckpt, reference):
    other = chat("Describe", IM_C, "briefly please")
    check_prefix_cache_keys_images(ckpt, CONVS[0], other, GREEDY, reference[0], reference[3], rows=ROWS["A"])


def test_configs_refused_by_name(ckpt):
    import json

    from gapless.model.vision.llava_next import llava_next_spec

    cfg = json.loads((ckpt / "config.json").read_text())
    with pytest.raises(ValueError, match="vision_feature_select_strategy='full'"):
        llava_next_spec({**cfg, "vision_feature_select_strategy": "full"})
    with pytest.raises(ValueError, match="not multiples of the tower's 28 px"):
        llava_next_spec({**cfg, "image_grid_pinpoints": [[28, 50]]})
    with pytest.raises(ValueError, match="expected \\[height, width\\] pairs"):
        llava_next_spec({**cfg, "image_grid_pinpoints": [28, 56]})
    from types import SimpleNamespace

    from gapless.model.vision.llava_next import anyres_inputs

    unnamed = SimpleNamespace(patch_size=None, image_processor=SimpleNamespace(image_grid_pinpoints=[]))
    out = {"pixel_values": torch.zeros(1, 5, 3, 28, 28), "image_sizes": torch.tensor([[40, 70]])}
    with pytest.raises(ValueError, match="names no patch_size"):
        anyres_inputs(out, 1, unnamed)
