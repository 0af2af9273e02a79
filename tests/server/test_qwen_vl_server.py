"""Qwen2.5-VL served: the official `openai` client sends two images of different sizes as data URLs and
gets the text offline `LLM.chat` gives (each image's patches and grid cross from the tokenizer to the
scheduler; the scheduler computes the prompt's M-RoPE positions)."""

from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
from PIL import Image

from gapless import LLM, SamplingParams
from gapless.testing.qwen_vl_checkpoints import make_qwen_vl_checkpoint
from gapless.testing.server import ServerProcess


def _data_url(h: int, w: int, seed: int) -> str:
    image = Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.mark.slow  # (~12 s; tests/server/test_vision_server.py serves images in make test)
def test_openai_client_matches_offline_chat(tmp_path):
    ckpt = make_qwen_vl_checkpoint(tmp_path / "qwen_vl")
    parts: list[dict] = [{"type": "text", "text": "Look"}]
    for url in (_data_url(100, 140, 0), _data_url(150, 60, 1)):
        parts += [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "and"}]
    messages = [{"role": "user", "content": parts}]
    kw = dict(max_tokens=8, temperature=0.0)
    srv = ServerProcess("--device", "cpu", "--model", str(ckpt))
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
        served = client.chat.completions.create(model=str(ckpt), messages=messages, **kw)
    finally:
        assert srv.stop() == 0, srv.output
    with LLM(str(ckpt), device="cpu") as llm:
        offline = llm.chat(messages, SamplingParams(**kw), use_tqdm=False)[0].text
    assert served.choices[0].message.content == offline and offline
