"""Qwen2.5-VL end to end, offline: greedy tokens equal transformers' `Qwen2_5_VLForConditionalGeneration` on
a tiny random checkpoint (one and two images of different sizes, text before, between and after, two
messages), with overlap on and off, chunks that cut through an image, page sizes 1 and 16, and requests
retracted mid-decode; the prefix cache keyed by image content; the encoder's rows and the prompt's M-RoPE
positions equal transformers' own."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch

from gapless import SamplingParams
from gapless.testing.qwen_vl_checkpoints import make_qwen_vl_checkpoint
from gapless.testing.vision_reference import (
    chat,
    check_greedy_chats,
    check_prefix_cache_keys_images,
    check_retraction,
    greedy_cases,
    hf_chat_greedy,
    hf_encoder,
    image,
    image_count,
    processor_inputs,
)

MAX_TOKENS = 10


# A: 8 x 10 patches (20 rows: windows of 2 x 2 rows cut it unevenly); B: 10 x 4 (10 rows); C: A's size
IM_A, IM_B, IM_C = image(100, 140, 0), image(150, 60, 1), image(100, 140, 2)


CONVS = [
    chat("Describe", IM_A, "briefly please"),  # text before and after one image
    chat("First", IM_A, "then", IM_B, "compare them"),  # two images of different sizes, text between
    chat(IM_B, "what now"),  # an image first
    chat("Three", IM_B, "one", IM_A, "two", image(60, 90, 3), "three"),  # three images of three sizes
    [*chat("See", IM_B), {"role": "assistant", "content": "A picture."}, *chat(IM_A, "and this one?")],
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
    from gapless.model.vision.qwen2_5_vl import QwenVLProcessor

    processor = QwenVLProcessor(ckpt)
    out = processor_inputs(processor, conv)
    image_token = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    return dict(out, mm_token_type_ids=(out["input_ids"] == image_token).int())


@pytest.fixture(scope="module")
def reference(ckpt, hf):
    """transformers' greedy tokens for each conversation of CONVS (and the first with image C)."""
    convs = [*CONVS, chat("Describe", IM_C, "briefly please")]
    return hf_chat_greedy(hf, partial(_inputs, ckpt), convs, MAX_TOKENS)


def test_encoder_and_positions_equal_transformers(ckpt, hf):
    """The encoder's rows (two images of different sizes in one call) and the prompt's M-RoPE positions
    and delta are transformers' (`get_image_features`, `get_rope_index`)."""
    from gapless.model.vision.mrope import prompt_rope, rope_rows

    inputs = _inputs(ckpt, CONVS[1])
    grids = inputs["image_grid_thw"]
    encoder = hf_encoder(ckpt, hf)
    spec = encoder.spec
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


@pytest.mark.parametrize("options", greedy_cases(9, 13))
def test_greedy_equals_transformers(ckpt, reference, options):
    """Overlap on with chunks of 9 cutting through every image, the plain loop, the device process."""
    check_greedy_chats(ckpt, options, CONVS, GREEDY, reference[: len(CONVS)], encoded=image_count(CONVS))


def test_prefix_cache_keys_images_by_content(ckpt, reference):
    other = chat("Describe", IM_C, "briefly please")
    ref_other = reference[len(CONVS)]
    check_prefix_cache_keys_images(ckpt, CONVS[0], other, GREEDY, reference[0], ref_other, rows=20)


def test_retraction_keeps_the_positions(ckpt, reference):
    """Requests retracted mid-decode resume, their prompt and generated tokens recomputed at their M-RoPE
    positions (the delta past the prompt)."""
    check_retraction(ckpt, CONVS, GREEDY, reference[: len(CONVS)], kv_cache_tokens=120)


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


@pytest.mark.parametrize("layout", ["awq", "gptq"])
def test_a_quantized_language_model_beside_a_float_vision_tower(ckpt, tmp_path, monkeypatch, layout):
    """As Qwen's own `*-VL-*-AWQ` checkpoints hold it: the language model's projections int4, the vision
    tower float (its `visual.*` tensors as they are). Image chats give the greedy tokens of the same
    checkpoint with those projections dequantized (the int4 layers on their exact float32 path)."""
    from gapless import LLM
    from gapless.testing.quant_checkpoints import write_quantized

    monkeypatch.setenv("GAPLESS_INT4_KERNEL", "triton")  # (on the CPU: the dequantizing reference path)
    qdir, refdir = write_quantized(ckpt, tmp_path, layout, group=32)
    outs, formats = [], []
    for path in (qdir, refdir):
        with LLM(str(path), device="cpu", dtype="float32", kv_cache_tokens=1024, overlap=False) as llm:
            outs.append([o.token_ids for o in llm.chat(CONVS[:2], GREEDY, use_tqdm=False)])
            formats.append(dict(llm.engine.info.weight_formats))
    assert outs[0] == outs[1]
    layers = json.loads((ckpt / "config.json").read_text())["text_config"]["num_hidden_layers"]
    int4 = {f: n for f, n in formats[0].items() if f.startswith(f"{layout} w4a16 g32")}
    assert list(int4.values()) == [4 * layers] and formats[0]["float32"] == 1, formats  # (the LM head)
