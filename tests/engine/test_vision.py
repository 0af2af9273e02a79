"""LLaVA-1.5 end to end, offline: greedy tokens equal transformers' `LlavaForConditionalGeneration` on a
tiny random checkpoint (one, two and three images of different sizes, text before, between and after), with
overlap on and off, chunks that cut through an image, page sizes 1 and 16; the radix cache keyed by
image content (a repeated image hits, a different image of the same size misses); each image encoded
once per request; and every image limit refused before anything is queued."""

from __future__ import annotations

import base64
import io
from functools import partial

import pytest
import torch
from PIL import Image

from gapless import LLM, SamplingParams
from gapless.config import parse_limit_mm
from gapless.engine.image_io import ImageError
from gapless.testing.vision_checkpoints import make_llava_checkpoint
from gapless.testing.vision_reference import (
    chat,
    chat_inputs,
    check_greedy_chats,
    check_prefix_cache_keys_images,
    check_retraction,
    greedy_cases,
    hf_chat_greedy,
    image,
    image_count,
)

MAX_TOKENS = 10
TOKENS_PER_IMAGE = 16  # (56 / 14) ** 2


IM_A, IM_B, IM_C = image(40, 70, 0), image(90, 30, 1), image(40, 70, 2)  # A and C: the same size


CONVS = [
    chat("Describe", IM_A, "briefly please"),  # text before and after one image
    chat("First", IM_A, "then", IM_B, "compare them"),  # two images of different sizes, text between
    chat(IM_B, "what now"),  # an image first
    chat("Three", IM_B, "one", IM_A, "two", image(60, 50, 3), "three"),  # three images of three sizes
    # images in two messages of one conversation
    [*chat("See", IM_B), {"role": "assistant", "content": "A picture."}, *chat(IM_A, "and this one?")],
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_llava_checkpoint(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def reference(ckpt):
    """transformers' greedy tokens for each conversation of CONVS (and the same chat with image C)."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(ckpt)
    model = LlavaForConditionalGeneration.from_pretrained(ckpt).eval()
    convs = [*CONVS, chat("Describe", IM_C, "briefly please")]
    return hf_chat_greedy(model, partial(chat_inputs, processor), convs, MAX_TOKENS)


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


@pytest.mark.parametrize("options", greedy_cases(10, 7))
def test_greedy_equals_transformers(ckpt, reference, options):
    """Overlap on with chunks of 10 cutting through every image, the plain loop, the device process."""
    check_greedy_chats(ckpt, options, CONVS, GREEDY, reference[: len(CONVS)], encoded=image_count(CONVS))


def test_prefix_cache_keys_images_by_content(ckpt, reference):
    other = chat("Describe", IM_C, "briefly please")
    check_prefix_cache_keys_images(
        ckpt, CONVS[0], other, GREEDY, reference[0], reference[len(CONVS)], rows=TOKENS_PER_IMAGE
    )


def _data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def _url_chat(url: str) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": url}}],
        }
    ]


def test_data_url_and_path_equal_pil_image(ckpt, reference, tmp_path):
    IM_A.save(tmp_path / "a.png")
    as_url = {"type": "image_url", "image_url": {"url": _data_url(IM_A), "detail": "high"}}
    as_path = {"type": "image", "image": str(tmp_path / "a.png")}
    text = [{"type": "text", "text": "Describe"}, {"type": "text", "text": "briefly please"}]
    convs = [[{"role": "user", "content": [text[0], part, text[1]]}] for part in (as_url, as_path)]
    with LLM(str(ckpt), device="cpu") as llm:
        assert [o.token_ids for o in llm.chat(convs, GREEDY, use_tqdm=False)] == [reference[0]] * 2


@pytest.mark.parametrize(
    "conv, message",
    [
        (
            _url_chat("data:image/png;base64," + base64.b64encode(b"not an image").decode()),
            "cannot be decoded",
        ),
        (_url_chat("data:image/png;base64,@@@"), "not valid base64"),
        (_url_chat("https://example.com/cat.png"), "remote image URLs are not fetched"),
        (_url_chat(_data_url(image(8, 8, 3), "TIFF")), "format TIFF is not supported"),
        (_url_chat(_data_url(image(100, 100, 3))), "more than the limit 5000"),  # pixels
        (chat("a", IM_A, IM_A, IM_A), "3 images in one prompt, more than the limit 2"),
        ([{"role": "user", "content": [{"type": "audio", "audio": "x"}]}], "type 'audio' is not supported"),
    ],
    ids=["broken", "base64", "remote", "format", "pixels", "count", "kind"],
)
def test_bad_images_refused_before_queueing(ckpt, conv, message):
    llm = _limited(ckpt)
    with pytest.raises(ImageError, match=message) as e:
        llm.chat(conv, GREEDY, use_tqdm=False)
    assert e.value.param.startswith("messages")
    assert not llm.engine.has_unfinished() and not llm.engine.reqs


_LIMITED: dict[str, LLM] = {}


def _limited(ckpt) -> LLM:
    """One engine for every refusal test (each refusal leaves it untouched, so sharing it tests that too)."""
    if "llm" not in _LIMITED:
        _LIMITED["llm"] = LLM(str(ckpt), device="cpu", limit_mm_per_prompt="image=2", max_image_pixels=5000)
    return _LIMITED["llm"]


@pytest.fixture(scope="module", autouse=True)
def _close_limited():
    yield
    if "llm" in _LIMITED:
        _LIMITED.pop("llm").shutdown()


def test_limit_syntax():
    assert parse_limit_mm("image=3") == 3
    assert parse_limit_mm('{"image": 0}') == 0
    assert parse_limit_mm("image=2,video=0") == parse_limit_mm('{"image": 2, "video": 0}') == 2  # (0: none)
    for bad, why in [
        ("video=1", "only images"),
        ("image=x", "integer"),
        ("image", "expected"),
        ("image=-1", ">= 0"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_limit_mm(bad)
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        LLM("unused", limit_mm_per_prompt="audio=1")


class _FakeEncoder:
    """Each image's rows: its first input's value, repeated; counts its calls."""

    spec = None

    def __init__(self) -> None:
        self.calls: list[int] = []

    def encode(self, images):
        self.calls.append(len(images))
        return [im[0].expand(4, 2).clone() for im in images]


def test_encoder_cache_keeps_a_cut_image_and_batches_calls():
    from gapless.engine.vision import EncoderCache, ImageBatch, ImageSpan

    enc = _FakeEncoder()
    cache = EncoderCache(enc, max_batch=2)  # type: ignore[arg-type]
    val = lambda v: (torch.tensor([float(v)]),)  # noqa: E731
    # row 0: image 7's rows 0..1 (cut: kept); row 1: image 8 whole, then image 9's first row
    first = ImageBatch(
        (
            ImageSpan(0, 7, 0, 0, 2, False, val(7)),
            ImageSpan(1, 8, 2, 0, 4, True, val(8)),
            ImageSpan(1, 9, 6, 0, 1, False, val(9)),
        )
    )
    out = cache.rows(first, torch.device("cpu"))
    assert enc.calls == [2, 1]  # three images, two a call
    assert out.flat.tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert out.rows[:, 0].tolist() == [7, 7, 8, 8, 8, 8, 9]
    assert sorted(cache.kept) == [0, 1] and cache.encoded == 3
    # the next chunk finishes both cut images without encoding them again
    second = ImageBatch((ImageSpan(0, 7, 0, 2, 2, True, val(7)), ImageSpan(1, 9, 2, 1, 3, True, val(9))))
    out = cache.rows(second, torch.device("cpu"))
    assert enc.calls == [2, 1] and out.rows[:, 0].tolist() == [7, 7, 9, 9, 9]
    assert cache.kept == {}


def test_memory_plan_counts_the_encoder(ckpt):
    from gapless.config import EngineConfig
    from gapless.engine.memory_plan import encoder_images, plan_gpu_kv
    from gapless.model.config import load_model_config
    from gapless.model.vision import new_encoder

    cfg = EngineConfig(model="m", chunked_prefill_size=100, max_running_requests=4)
    cfg.limit_mm_per_prompt = "image=2"
    assert encoder_images(cfg, 16) == 8  # 100 // 16 + 2 = 8 = 4 rows x 2 images
    cfg.limit_mm_per_prompt = "image=1"
    assert encoder_images(cfg, 16) == 4  # every row's prompts bring no more
    spec = load_model_config(ckpt).vision
    enc = new_encoder(spec, 64, torch.float32, torch.device("cpu"))
    one, four = enc.activation_bytes(1, torch.float32), enc.activation_bytes(4, torch.float32)
    out = enc.encode([(torch.zeros(3, 56, 56),)])[0]
    assert four == 4 * one and one > out.numel() * 4  # at least its output rows
    kw = dict(total=10 << 30, free=8 << 30, allocated=1 << 30, activation_peak=0, graph_bytes=0)
    plain = plan_gpu_kv(**kw, mem_fraction_static=0.9, bytes_per_token=1024)
    vision = plan_gpu_kv(**kw, mem_fraction_static=0.9, bytes_per_token=1024, encoder_bytes=1 << 30)
    assert plain.tokens - vision.tokens == (1 << 30) // 1024
    assert "vision encoder 1.00 GiB" in vision.describe()


def test_retraction_re_encodes_and_keeps_the_tokens(ckpt, reference):
    """Requests retracted mid-decode resume (their image KV recomputed, or found in the radix cache)."""
    check_retraction(ckpt, CONVS, GREEDY, reference[: len(CONVS)], kv_cache_tokens=120)
