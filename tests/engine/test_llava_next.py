"""LLaVA-NeXT end to end, offline: the encoder's rows (base crop, unpadded tile grid, newlines) equal
transformers' `get_image_features`, and greedy tokens equal transformers' `LlavaNextForConditionalGeneration`
on a tiny random checkpoint: one and two images of different sizes and aspect ratios (different tile
grids, unpadding above and below or left and right, different run lengths), text before, between and
after, chunks that cut through an image, page sizes 1 and 16; the radix cache keyed by image content."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from gapless import LLM, SamplingParams
from gapless.testing.vision_checkpoints import make_llava_next_checkpoint

MAX_TOKENS = 10


def _image(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


# A: a 2 x 2 grid cut above and below (52 rows); B: 3 x 1 tiles, nothing cut (76 rows); D: 2 x 2 cut
# left and right (72 rows); C: A's size, other pixels
IM_A, IM_B, IM_C, IM_D = _image(40, 70, 0), _image(90, 30, 1), _image(40, 70, 2), _image(60, 40, 3)
ROWS = {"A": 52, "B": 76, "D": 72}


def _chat(*parts: object) -> list[dict]:
    content = [
        {"type": "text", "text": p} if isinstance(p, str) else {"type": "image", "image": p} for p in parts
    ]
    return [{"role": "user", "content": content}]


CONVS = [
    _chat("Describe", IM_A, "briefly please"),  # text before and after one image
    _chat("First", IM_A, "then", IM_B, "compare them"),  # two images, different grids, text between
    _chat(IM_D, "what now"),  # an image first
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
    out = []
    for conv in [*CONVS, _chat("Describe", IM_C, "briefly please")]:
        inputs = processor.apply_chat_template(
            conv, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
        )
        with torch.no_grad():
            ids = hf.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
        out.append(ids[0, inputs["input_ids"].shape[1] :].tolist())
    return out


def test_encoder_equals_transformers(ckpt, hf, processor):
    """Three images of three layouts in one call (the processor pads their crops to the most; each
    image's own are cut): each image's rows are transformers', and its run is as long as the processor
    expanded its placeholder."""
    from gapless.model.config import load_model_config
    from gapless.model.vision import new_encoder
    from gapless.model.vision.llava_next import anyres_inputs

    out = processor(text="a<image>b<image>c<image>", images=[IM_A, IM_B, IM_D], return_tensors="pt")
    spec = load_model_config(ckpt).vision
    assert spec.family == "llava_next" and spec.tokens_per_image == 88  # a whole 2 x 2 grid's rows
    encoder = new_encoder(spec, 64, torch.float32, torch.device("cpu"))
    for name, tensor in hf.state_dict().items():
        encoder.load_weight(name, tensor)
    assert encoder.missing_weights() == []
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


@pytest.mark.parametrize(
    "options",
    [
        dict(page_size=1, chunked_prefill_size=23),  # overlap on; chunks of 23 cut through every image
        dict(page_size=16, overlap=False),  # whole prompts in one batch, the plain loop
        dict(page_size=16, chunked_prefill_size=40, cpu_worker="process"),  # in the device process
        pytest.param(
            dict(device="cuda", dtype="float32", page_size=16, chunked_prefill_size=23),
            marks=pytest.mark.skipif(
                not torch.cuda.is_available(), reason="needs CUDA (the CPU cases cover it)"
            ),
        ),
    ],
    ids=["page1-chunk23", "page16-plain", "page16-chunk40-process", "cuda-page16-chunk23"],
)
def test_greedy_equals_transformers(ckpt, reference, options):
    with LLM(str(ckpt), **{"device": "cpu", **options}) as llm:
        outs = llm.chat(CONVS, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == reference[:3]
        token = llm.engine.vision.image_token_id
        assert [o.prompt_token_ids.count(token) for o in outs] == [52, 52 + 76, 72]
        runner = llm.engine._runner
        if runner is not None:  # (in this process) each image encoded once per request, chunked or not
            assert runner.encoder_cache.encoded == 4
            assert runner.encoder_cache.kept == {}
        llm.check_integrity()


def test_prefix_cache_keys_images_by_content(ckpt, reference):
    with LLM(str(ckpt), device="cpu", page_size=1) as llm:
        first = llm.chat(CONVS[0], GREEDY, use_tqdm=False)[0]
        ids = first.prompt_token_ids
        token = llm.engine.vision.image_token_id
        start, end = ids.index(token), len(ids) - ids[::-1].index(token)
        assert end - start == ROWS["A"]
        again = llm.chat(CONVS[0], GREEDY, use_tqdm=False)[0]
        assert again.token_ids == reference[0]
        assert again.cached_tokens >= end  # the image's KV reused: a hit past its run
        other = llm.chat(_chat("Describe", IM_C, "briefly please"), GREEDY, use_tqdm=False)[0]
        assert other.token_ids == reference[3]
        assert other.prompt_token_ids == ids  # the same ids: only the pixels differ
        assert other.cached_tokens <= start  # a miss from the image on
        llm.check_integrity()


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
