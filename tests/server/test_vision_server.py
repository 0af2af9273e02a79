"""A vision-language model served: the official `openai` client sends images as data URLs and gets the
text offline `LLM.chat` gives; a bad image is a 400 naming its message and part, and the server goes
on; a text model refuses image parts by name."""

from __future__ import annotations

import base64
import dataclasses
import io
import json

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from gapless import LLM, SamplingParams
from gapless.testing.server import ServerProcess
from gapless.testing.vision_checkpoints import make_llava_checkpoint


def _data_url(h: int, w: int, seed: int, fmt: str = "PNG") -> str:
    image = Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def _messages(*urls: str) -> list[dict]:
    parts: list[dict] = [{"type": "text", "text": "Look"}]
    for url in urls:
        parts += [
            {"type": "image_url", "image_url": {"url": url, "detail": "low"}},
            {"type": "text", "text": "and"},
        ]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_llava_checkpoint(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def server(ckpt):
    srv = ServerProcess(
        "--device",
        "cpu",
        "--model",
        str(ckpt),
        "--limit-mm-per-prompt",
        "image=2",
        "--max-image-pixels",
        "9000",
    )
    yield srv
    assert srv.stop() == 0, srv.output


def test_openai_client_matches_offline_chat(server, ckpt):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    urls = [_data_url(40, 70, 0), _data_url(90, 30, 1)]
    kw = dict(max_tokens=8, temperature=0.0)
    # one image, two in a message, and one in each of two user messages of a conversation
    convs = [_messages(urls[0]), _messages(*urls)]
    convs.append([*_messages(urls[1]), {"role": "assistant", "content": "Seen."}, *_messages(urls[0])])
    served = [
        client.chat.completions.create(model=str(ckpt), messages=conv, **kw).choices[0].message.content
        for conv in convs
    ]
    with LLM(str(ckpt), device="cpu") as llm:
        offline = [o.text for o in llm.chat(convs, SamplingParams(**kw), use_tqdm=False)]
    assert served == offline and all(served)


@pytest.mark.parametrize(
    "urls, message, param",
    [
        (
            ["data:image/png;base64," + base64.b64encode(b"junk").decode()],
            "cannot be decoded",
            "messages[0].content[1]",
        ),
        (["http://10.0.0.1/x.png"], "start it with --allow-remote-media", "messages[0].content[1]"),
        ([_data_url(8, 8, 3, "TIFF")], "format TIFF is not supported", "messages[0].content[1]"),
        ([_data_url(100, 100, 3)], "more than the limit 9000", "messages[0].content[1]"),
        ([_data_url(20, 20, k) for k in range(3)], "3 images in one prompt", "messages"),
    ],
    ids=["broken", "remote", "format", "pixels", "count"],
)
def test_bad_image_is_a_400_naming_the_part(server, ckpt, urls, message, param):
    body = {"model": str(ckpt), "messages": _messages(*urls), "max_tokens": 2}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert message in err["message"] and err["param"] == param
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_text_model_refuses_images(ckpt_factory):
    from gapless.server.errors import BadRequest
    from gapless.server.openai_protocol import ChatCompletionRequest, decode_body
    from gapless.server.served_model import ServedModel

    served = ServedModel.of_checkpoint("m", str(ckpt_factory("qwen3")), 1000, 256)
    part = b'{"type": "image_url", "image_url": {"url": "data:,"}}'
    body = decode_body(b'{"messages": [{"role": "user", "content": [' + part + b"]}]}", ChatCompletionRequest)
    with pytest.raises(BadRequest, match="takes no images") as e:
        body.submission(served)
    assert e.value.param == "messages[0].content[0]"


def test_each_part_is_named_by_its_index(ckpt_factory):
    from gapless.engine.image_io import ImageLimits
    from gapless.server.errors import BadRequest
    from gapless.server.openai_protocol import ChatCompletionRequest, decode_body
    from gapless.server.served_model import ServedModel

    served = ServedModel.of_checkpoint("m", str(ckpt_factory("qwen3")), 1000, 256)
    served = dataclasses.replace(served, images=ImageLimits())
    url = _data_url(8, 8, 0)
    parts = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": url}}]
    body = {"messages": [{"role": "user", "content": [*parts, {"type": "input_audio"}]}]}
    with pytest.raises(BadRequest, match="type 'input_audio' is not supported") as e:
        decode_body(json.dumps(body).encode(), ChatCompletionRequest).submission(served)
    assert e.value.param == "messages[0].content[2]"
    body["messages"][0]["content"] = parts * 2  # two images in a message, checked and kept in order
    sub = decode_body(json.dumps(body).encode(), ChatCompletionRequest).submission(served)
    chat = sub.prompts[0]
    assert len(chat.images) == 2 and [p["type"] for p in chat.messages[0].parts] == ["text", "image"] * 2
    # `detail`: OpenAI's values accepted, another refused by name
    for detail in ("auto", "low", "high"):
        parts[1]["image_url"]["detail"] = detail
        body["messages"][0]["content"] = parts
        assert decode_body(json.dumps(body).encode(), ChatCompletionRequest).submission(served).prompts
    parts[1]["image_url"]["detail"] = "ultra"
    with pytest.raises(BadRequest, match="detail must be one of auto, low, high, not 'ultra'") as e:
        decode_body(json.dumps(body).encode(), ChatCompletionRequest).submission(served)
    assert e.value.param == "messages[0].content[1]"
