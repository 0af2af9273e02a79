"""`/v1/models` and `/metrics` say which weight formats the served model's layers are held in, and the KV
cache's (what the scheduler reported at start-up: `SchedulerInfo.quantization`, `weight_formats` and
`kv_cache`)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from gapless.server.api import create_app
from gapless.server.errors import BadRequest
from gapless.server.health import Health
from gapless.server.metrics import Metrics
from gapless.server.protocol import SchedulerInfo
from gapless.server.state import ServerState, Settings


class _Client:
    """Stands in for the engine client: no replica reports gauges."""

    async def replica_stats(self) -> list:
        return []


def _app(info: SchedulerInfo, aliases: tuple[str, ...] = ()):
    metrics = Metrics("m")
    metrics.set_weights(info.weight_formats)
    metrics.set_kv_cache(info.kv_cache)
    settings = Settings("m", "/models/m", info, model_aliases=aliases)
    return create_app(ServerState(settings, _Client(), Health(), metrics))  # type: ignore[arg-type]  # the stand-in client


def test_models_and_metrics_name_the_weight_formats():
    formats = {"bfloat16": 1, "fp8 e4m3 block 128x128": 196}
    kv = "fp8_e5m2, 73728 B/token"
    info = SchedulerInfo(64, 64, "cuda:0", 100, 2048, "weights: 9.1 GB", "fp8", formats, kv_cache=kv)
    with TestClient(_app(info)) as http:
        card = http.get("/v1/models").json()["data"][0]
        assert card["quantization"] == "fp8" and card["weight_formats"] == formats and card["kv_cache"] == kv
        text = http.get("/metrics").text
    assert 'gapless_weight_format_layers{format="fp8 e4m3 block 128x128",model="m"} 196.0' in text, text
    assert 'gapless_weight_format_layers{format="bfloat16",model="m"} 1.0' in text
    assert 'gapless_kv_cache_info{kv_cache="fp8_e5m2, 73728 B/token",model="m"} 1.0' in text, text


def test_each_served_name_is_listed_and_accepted():
    """`--served-model-name m b` (vLLM's several names): /v1/models lists the model under each, and a
    request may name either; another name is a 404."""
    info = SchedulerInfo(64, 64, "cpu", 100, 2048, "", None, {"float32": 15})
    with TestClient(_app(info, ("b",))) as http:
        cards = http.get("/v1/models").json()["data"]
        served = http.app.state.server.settings.served  # type: ignore[attr-defined]
    assert [c["id"] for c in cards] == ["m", "b"] and cards[1]["max_model_len"] == cards[0]["max_model_len"]
    assert served.check_model("b") is None and served.check_model("m") is None
    with pytest.raises(BadRequest) as e:
        served.check_model("c")
    assert e.value.status == 404


def test_a_float_model_says_no_quantization():
    with TestClient(_app(SchedulerInfo(64, 64, "cpu", 100, 2048, "", None, {"float32": 15}))) as http:
        card = http.get("/v1/models").json()["data"][0]
    assert card["quantization"] is None and card["weight_formats"] == {"float32": 15}


@pytest.mark.slow  # (a served model: ~15 s)
def test_a_served_fp8_checkpoint_names_its_formats(ckpt_factory, tmp_path):
    """The real path, not a stand-in: `gapless serve` of an fp8 checkpoint with an fp8 KV cache, read by
    the `openai` client (/v1/models) and over HTTP (/metrics), and answering a completion."""
    import httpx
    from openai import OpenAI

    from gapless.testing.fp8_checkpoints import write_fp8_checkpoint
    from gapless.testing.server import ServerProcess

    dst, _ = write_fp8_checkpoint(ckpt_factory("qwen3"), tmp_path / "q", "fp8", block=(32, 32))
    srv = ServerProcess(str(dst), "--device", "cpu", "--kv-cache-dtype", "fp8", "--kv-cache-tokens", "1024")
    try:
        client = OpenAI(base_url=f"{srv.url}/v1", api_key="none")
        card = client.models.list().data[0].model_extra or {}
        assert card["quantization"] == "fp8", card
        assert card["weight_formats"] == {"float32": 1, "fp8 e4m3 block 32x32": 8}, card  # 4 x 2 layers
        assert card["kv_cache"].startswith("fp8_e4m3, "), card
        text = httpx.get(f"{srv.url}/metrics").text
        assert 'format="fp8 e4m3 block 32x32"' in text and 'kv_cache="fp8_e4m3, ' in text, text
        done = client.completions.create(
            model=client.models.list().data[0].id, prompt="hi", max_tokens=4, extra_body={"ignore_eos": True}
        )
        assert done.usage is not None and done.usage.completion_tokens == 4
    finally:
        assert srv.stop() == 0, srv.output
