"""A server with `--enable-lora`: the official `openai` client picks an adapter by `model` (greedy tokens
equal transformers + peft), `/v1/models` lists the adapters with their parent, an unknown adapter is a
404 like an unknown model, and `/v1/load_lora_adapter` / `/v1/unload_lora_adapter` (behind the API key)
change what is served, refusing a bad adapter by name."""

from __future__ import annotations

import json

import httpx
import pytest
from transformers import AutoTokenizer

from gapless.lora.modules import LoRAModule, parse_lora_modules
from gapless.testing.hf_reference import hf_greedy
from gapless.testing.lora import ATTENTION, MLP, make_adapter, peft_model
from gapless.testing.server import ServerProcess

openai = pytest.importorskip("openai", reason="the official client drives the server")
pytest.importorskip("peft", reason="the reference is transformers + peft")

KEY = "lora-key"
PROMPT = [5, 17, 99, 3, 250, 31, 8]
MAX_NEW = 6


@pytest.fixture(scope="module")
def setup(ckpt_factory, tmp_path_factory):
    base = ckpt_factory("qwen3")
    out = tmp_path_factory.mktemp("served-loras")
    paths = {
        "alpha": make_adapter(base, out / "alpha", ATTENTION + MLP, r=8, seed=11),
        "beta": make_adapter(base, out / "beta", ["q_proj", "v_proj", "down_proj"], r=4, seed=12),
        "gamma": make_adapter(base, out / "gamma", ATTENTION, r=8, seed=13),
        "wide": make_adapter(base, out / "wide", ["q_proj"], r=16, seed=14),
    }
    refs = {name: hf_greedy(peft_model(base, p), PROMPT, MAX_NEW).tokens for name, p in paths.items()}
    refs[None] = hf_greedy(peft_model(base, None), PROMPT, MAX_NEW).tokens
    beta = json.dumps({"name": "beta", "path": str(paths["beta"]), "base_model_name": "base"})
    srv = ServerProcess(
        "--model", str(base), "--device", "cpu", "--kv-cache-tokens", "4096", "--served-model-name", "base",
        "--api-key", KEY, "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
        "--lora-modules", f"alpha={paths['alpha']}", beta,
    )  # fmt: skip
    srv.base = base
    yield srv, paths, refs
    srv.stop()


def _complete(oai, model: str) -> str:
    r = oai.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_NEW, temperature=0.0, extra_body={"ignore_eos": True}
    )
    return r.choices[0].text


def test_served_adapters(setup):
    srv, paths, refs = setup
    oai = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0)
    models = {m.id: m for m in oai.models.list().data}
    assert set(models) == {"base", "alpha", "beta"}
    assert models["alpha"].model_extra["parent"] == "base" and models["alpha"].model_extra["root"] == str(
        paths["alpha"]
    )
    tok = AutoTokenizer.from_pretrained(str(srv.base))
    for name, ref in (("alpha", refs["alpha"]), ("beta", refs["beta"]), ("base", refs[None])):
        assert _complete(oai, name) == tok.decode(ref, skip_special_tokens=True), name
    assert len({tuple(refs[n]) for n in ("alpha", "beta", None)}) == 3, "adapters that change nothing"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        _complete(oai, "nope")
    http = httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert (
        httpx.post(f"{srv.url}/v1/load_lora_adapter", json={"lora_name": "g", "lora_path": "x"}).status_code
        == 401
    )
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "gamma", "lora_path": str(paths["gamma"])})
    assert r.status_code == 200, r.text
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "wide", "lora_path": str(paths["wide"])})
    assert r.status_code == 400 and "rank 16 is above max_lora_rank=8" in r.json()["error"]["message"]
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "gamma", "lora_path": str(paths["gamma"])})
    assert r.status_code == 400 and "already loaded" in r.json()["error"]["message"]
    assert "gamma" in {m.id for m in oai.models.list().data}
    # three adapters through two device slots, each answered as transformers + peft does
    for name in ("gamma", "alpha", "beta"):
        assert _complete(oai, name) == tok.decode(refs[name], skip_special_tokens=True), name
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "gamma"})
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        _complete(oai, "gamma")
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "gamma"}).status_code == 404
    http.close()


def test_parse_lora_modules():
    js = '{"name": "b", "path": "/p/b", "base_model_name": "m"}'
    assert parse_lora_modules(["a=/p/a", js]) == [LoRAModule("a", "/p/a"), LoRAModule("b", "/p/b", "m")]
    with pytest.raises(ValueError, match="expected name=path"):
        parse_lora_modules(["a"])
    with pytest.raises(ValueError, match="given twice"):
        parse_lora_modules(["a=/x", "a=/y"])
    with pytest.raises(ValueError, match="needs string fields name and path"):
        parse_lora_modules(['{"name": "a"}'])


def test_start_up_refusals(ckpt_factory, tmp_path):
    """`gapless serve`'s checks before anything loads: adapters without --enable-lora, a bad adapter
    named by --lora-modules."""
    import argparse

    from gapless.config import EngineConfig
    from gapless.model.config import load_model_config
    from gapless.server.launch import _check_loras

    base = ckpt_factory("qwen3")
    mcfg = load_model_config(base)
    on = EngineConfig(model=str(base), enable_lora=True, max_lora_rank=4)
    with pytest.raises(ValueError, match="add --enable-lora"):
        _check_loras(
            argparse.Namespace(lora_modules=["a=/x"], api_server_count=1), EngineConfig(model=str(base)), mcfg
        )
    _check_loras(argparse.Namespace(lora_modules=None, api_server_count=2), on, mcfg)  # (served alike)
    with pytest.raises(ValueError, match=r"LoRA adapter 'a': .* is not a directory"):
        _check_loras(
            argparse.Namespace(lora_modules=[f"a={tmp_path / 'none'}"], api_server_count=1), on, mcfg
        )
    wide = make_adapter(base, tmp_path / "wide", ["q_proj"], r=8)
    with pytest.raises(ValueError, match="rank 8 is above max_lora_rank=4"):
        _check_loras(argparse.Namespace(lora_modules=[f"w={wide}"], api_server_count=1), on, mcfg)


def test_api_servers_share_one_registry(ckpt_factory, tmp_path):
    """Two processes' registries on one file: ids never collide, and a load or unload through either
    is what the other serves at its next lookup."""
    from gapless.lora.adapter import LoRAError
    from gapless.lora.modules import served_adapters
    from gapless.model.config import load_model_config

    base = ckpt_factory("qwen3")
    mcfg = load_model_config(base)
    a, b = (make_adapter(base, tmp_path / n, ["q_proj"], r=4, seed=i) for i, n in enumerate("ab"))
    shared = str(tmp_path / "loras.json")
    first = served_adapters([f"a={a}"], mcfg, 8, shared)
    second = served_adapters([f"a={a}"], mcfg, 8, shared)  # starts later: reads, adds nothing
    assert [lo.lora_int_id for lo in second.served()] == [1]
    assert second.add_path("b", b).lora_int_id == 2
    found = first.lookup("b")
    assert found is not None and found.lora_int_id == 2
    with pytest.raises(LoRAError, match="already loaded"):
        first.add_path("b", a)
    first.remove("b")
    assert second.lookup("b") is None and {lo.lora_name for lo in second.served()} == {"a"}
    assert second.add_path("b", b).lora_int_id == 3  # unloaded and loaded again: a new adapter
    found = first.lookup("b")
    assert found is not None and found.lora_int_id == 3


def _pinned_clients(url: str, count: int) -> dict[int, httpx.Client]:
    """One keep-alive connection to each of `count` API server processes (which one took a connection:
    its /debug/state)."""
    found: dict[int, httpx.Client] = {}
    for _ in range(200):
        c = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        k = c.get("/debug/state").json()["api_server"]
        if k in found:
            c.close()
        else:
            found[k] = c
        if len(found) == count:
            return found
    raise AssertionError(f"connections reached API servers {sorted(found)} only")


@pytest.mark.slow  # (three API server processes, ~8 s)
def test_adapters_loaded_through_any_api_server_are_served_by_all(setup):
    """`--api-server-count 2`: an adapter loaded through one API server process is listed and answered
    (as transformers + peft) by the other, and one unloaded through either is gone from both."""
    first, paths, refs = setup
    base = first.base
    srv = ServerProcess(
        "--model", str(base), "--device", "cpu", "--kv-cache-tokens", "4096", "--served-model-name", "base",
        "--api-key", KEY, "--enable-lora", "--max-lora-rank", "8", "--api-server-count", "2",
        "--lora-modules", f"alpha={paths['alpha']}",
    )  # fmt: skip
    tok = AutoTokenizer.from_pretrained(str(base))
    body = {"prompt": PROMPT, "max_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}
    try:
        clients = _pinned_clients(srv.url, 2)

        def models(k: int) -> set[str]:
            return {m["id"] for m in clients[k].get("/v1/models").json()["data"]}

        def complete(k: int, model: str) -> httpx.Response:
            return clients[k].post("/v1/completions", json={**body, "model": model})

        assert models(0) == models(1) == {"base", "alpha"}
        r = clients[1].post(
            "/v1/load_lora_adapter", json={"lora_name": "gamma", "lora_path": str(paths["gamma"])}
        )
        assert r.status_code == 200, r.text
        assert "gamma" in models(0)
        for k, name in ((0, "gamma"), (1, "gamma"), (1, "alpha")):
            r = complete(k, name)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == tok.decode(refs[name], skip_special_tokens=True), (
                k,
                name,
            )
        r = clients[0].post(
            "/v1/load_lora_adapter", json={"lora_name": "gamma", "lora_path": str(paths["beta"])}
        )
        assert r.status_code == 400 and "already loaded" in r.json()["error"]["message"]
        assert clients[0].post("/v1/unload_lora_adapter", json={"lora_name": "gamma"}).status_code == 200
        assert "gamma" not in models(1) and complete(1, "gamma").status_code == 404
        # the name again, another adapter: a new id, so no slot or cached prefix of the old one is used
        r = clients[1].post(
            "/v1/load_lora_adapter", json={"lora_name": "gamma", "lora_path": str(paths["beta"])}
        )
        assert r.status_code == 200, r.text
        text = complete(0, "gamma").json()["choices"][0]["text"]
        assert text == tok.decode(refs["beta"], skip_special_tokens=True)
        for c in clients.values():
            c.close()
    finally:
        srv.stop()
