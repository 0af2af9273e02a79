"""Qwen2.5-VL end to end, offline: greedy tokens equal transformers' `Qwen2_5_VLForConditionalGeneration` on
a tiny random checkpoint (one and two images of different sizes, text before, between and after, two
messages), with overlap on and off, chunks that cut through an image, page sizes 1 and 16, and requests
retracted mid-decode; the prefix cache keyed by image content; the encoder's rows and the prompt's M-RoPE
positions equal transformers' own."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from gapless import LLM, SamplingParams
from gapless.testing.qwen_vl_checkpoints import make_qwen_vl_checkpoint

MAX_TOKENS = 10


def _image(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


# A: 8 x 10 patches (20 rows: windows of 2 x 2 rows cut it unevenly); B: 10 x 4 (10 rows); C: A's size
IM_A, IM_B, IM_C = _image(100, 140, 0), _image(150, 60, 1), _image(100, 140, 2)


def _chat(*parts: object) -> list[dict]:
    content = [
        {"type": "text", "text": p} if isinstance(p, str) else {"type": "image", "image": p} for p in parts
    ]
    return [{"role": "user", "content": content}]


CONVS = [
    _chat("Describe", IM_A, "briefly please"),  # text before and after one image
    _chat("First", IM_A, "then", IM_B, "compare them"),  # two images of different sizes, text between
    _chat(IM_B, "what now"),  # an image first
    [*_chat("See", IM_B), {"role": "assistant", "content": "A picture."}, *_chat(IM_A, "and this one?")],
]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_qwen_vl_checkpoint(tmp_path_factory.mktemp("qwen_vl"))


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(ckpt).eval()


def _inputs(ckpt, conv: list[dict]) -> dict:
    """The processor's inputs for `conv` (images as `{"type": "image"}` parts), with the image-token
    types transformers' `get_rope_index` reads (`Qwen2_5_VLProcessor` returns them too)."""
    from gapless.engine.image_io import ImageLimits, split_chat
    from gapless.model.vision.qwen2_5_vl import QwenVLProcessor

    chat, images = split_chat(conv, ImageLimits())
    processor = QwenVLProcessor(ckpt)
    out = processor(processor.apply_chat_template(chat, add_generation_prompt=True), images)
    ids = out["input_ids"]
    image_token = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    return dict(out, attention_mask=torch.ones_like(ids), mm_token_type_ids=(ids == image_token).int())


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


def test_encoder_and_positions_equal_transformers(ckpt, hf):
    """The encoder's rows (two images of different sizes in one call) and the prompt's M-RoPE positions
    and delta are transformers' (`get_image_features`, `get_rope_index`)."""
    from gapless.model.config import load_model_config
    from gapless.model.vision import new_encoder
    from gapless.model.vision.mrope import prompt_rope, rope_rows

    inputs = _inputs(ckpt, CONVS[1])
    grids = inputs["image_grid_thw"]
    spec = load_model_config(ckpt).vision
    encoder = new_encoder(spec, 64, torch.float32, torch.device("cpu"))
    for name, tensor in hf.state_dict().items():
        encoder.load_weight(name, tensor)
    assert encoder.missing_weights() == []
    patches = inputs["pixel_values"].split(grids.prod(-1).tolist())
    with torch.no_grad():
        ours = encoder.encode(list(zip(patches, grids)))
        theirs = hf.get_image_features(inputs["pixel_values"], grids).pooler_output
    assert [o.shape[0] for o in ours] == [20, 10]
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)

    ids = inputs["input_ids"]
    want, delta = hf.model.get_rope_index(ids, inputs["mm_token_type_ids"], grids)
    token = spec.image_token_id
    starts = [i for i in range(ids.shape[1]) if ids[0, i] == token and ids[0, i - 1] != token]
    rope = prompt_rope(ids.shape[1], [(s, int(g.prod()) // 4, g) for s, g in zip(starts, grids)], 2)
    assert torch.equal(rope.positions, want[:, 0]) and rope.delta == int(delta) < 0
    n = ids.shape[1]  # past the prompt: its index plus the delta, in every section
    assert rope_rows(rope, n - 2, n + 2).tolist() == [[n - 2 + rope.delta + i for i in range(4)]] * 3


@pytest.mark.parametrize(
    "options",
    [
        dict(page_size=1, chunked_prefill_size=9),  # overlap on; chunks of 9 cut through every image
        dict(page_size=16, overlap=False),  # whole prompts in one batch, the plain loop
        dict(page_size=16, chunked_prefill_size=13, cpu_worker="process"),  # in the device process
        pytest.param(
            dict(device="cuda", dtype="float32", page_size=16, chunked_prefill_size=9),
            marks=pytest.mark.skipif(
                not torch.cuda.is_available(), reason="needs CUDA (the CPU cases cover it)"
            ),
        ),
    ],
    ids=["page1-chunk9", "page16-plain", "page16-chunk13-process", "cuda-page16-chunk9"],
)
def test_greedy_equals_transformers(ckpt, reference, options):
    with LLM(str(ckpt), **{"device": "cpu", **options}) as llm:
        outs = llm.chat(CONVS, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == reference[:4]
        runner = llm.engine._runner
        if runner is not None:  # (in this process) each image encoded once per request, chunked or not
            assert runner.encoder_cache.encoded == 6
        llm.check_integrity()


def test_prefix_cache_keys_images_by_content(ckpt, reference):
    with LLM(str(ckpt), device="cpu", page_size=1) as llm:
        first = llm.chat(CONVS[0], GREEDY, use_tqdm=False)[0]
        ids = first.prompt_token_ids
        token = llm.engine.vision.image_token_id
        start, end = ids.index(token), len(ids) - ids[::-1].index(token)
        again = llm.chat(CONVS[0], GREEDY, use_tqdm=False)[0]
        assert again.token_ids == reference[0]
        assert again.cached_tokens >= end  # the image's KV (at its M-RoPE positions) reused: a hit
        other = llm.chat(_chat("Describe", IM_C, "briefly please"), GREEDY, use_tqdm=False)[0]
        assert other.token_ids == reference[4]
        assert other.prompt_token_ids == ids  # the same ids: only the pixels differ
        assert other.cached_tokens <= start  # a miss from the image on
        llm.check_integrity()


def test_retraction_keeps_the_positions(ckpt, reference):
    """A KV pool too small for every conversation at once: requests are retracted mid-decode and resume,
    their prompt and generated tokens recomputed at their M-RoPE positions (the delta past the prompt)."""
    eager = {"init_new_token_ratio": 0.02, "min_new_token_ratio": 0.02}
    options = dict(kv_cache_tokens=120, cpu_worker="thread", chaos_seed=3, chunked_prefill_size=16, **eager)
    with LLM(str(ckpt), device="cpu", **options) as llm:
        outs = llm.chat(CONVS, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == reference[:4]
        assert llm.engine.stats.retractions > 0
        llm.check_integrity()


def test_mrope_of_one_position_is_plain_rope():
    """M-RoPE with every section at one position (a decode's 1-D positions) is RoPE at that position."""
    from gapless.model.layers import MRotaryEmbedding, RotaryEmbedding

    plain, multi = RotaryEmbedding(16, 64, 1e4, None), MRotaryEmbedding(16, 64, 1e4, None, (2, 3, 3))
    q, k, pos = torch.randn(5, 4, 16), torch.randn(5, 2, 16), torch.tensor([0, 3, 7, 20, 63])
    for a, b in zip(plain(pos, q, k), multi(pos.expand(3, -1), q, k)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="mrope_section"):
        MRotaryEmbedding(16, 64, 1e4, None, (2, 3, 2))


def test_v4_flat_config_reads_the_same(ckpt):
    """transformers v4 wrote Qwen2.5-VL's text fields at the top, with `rope_scaling` {"type": "mrope"}:
    it reads as 5's `text_config` does."""
    import dataclasses
    import json

    from gapless.model.config import load_model_config, model_config_from_dict

    cfg = json.loads((ckpt / "config.json").read_text())
    text = cfg.pop("text_config")
    rope = text.pop("rope_parameters")
    flat = {**text, **cfg, "model_type": "qwen2_5_vl", "rope_theta": rope["rope_theta"]}
    flat["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    old, new = model_config_from_dict(flat, "v4"), load_model_config(ckpt)
    assert old.mrope_section == (2, 3, 3) and old.rope_scaling is None
    assert dataclasses.replace(old, vision=None) == dataclasses.replace(new, vision=None)
    assert dataclasses.replace(old.vision, config={}) == dataclasses.replace(new.vision, config={})
