"""The pooling endpoints on a live server: `/v1/embeddings` driven by the official `openai` client and
checked against sentence-transformers, `/v1/score` and `/v1/rerank` (cosine of an embedding model) in
the order the reference's embeddings give, and every refusal (empty input, too long, a bad field, the
wrong kind of model both ways) a 4xx after which the server goes on."""

from __future__ import annotations

import base64
import time

import httpx
import numpy as np
import pytest
import torch

from gapless.testing.pooling import sentence_transformers_checkpoint
from gapless.testing.server import ServerProcess

from .conftest import API_KEY

pytest.importorskip("sentence_transformers", reason="the reference embeddings need sentence-transformers")
openai = pytest.importorskip("openai", reason="the official client drives /v1/embeddings")

TEXTS = ["hello world", "the cat sat on the mat", "a", "where is the station, please?"]
MAX_LEN = 64


@pytest.fixture(scope="module")
def embed_server(tmp_path_factory):
    path = sentence_transformers_checkpoint(tmp_path_factory.mktemp("st-mean"), "qwen3", pooling="mean")
    srv = ServerProcess(
        "--model", str(path), "--device", "cpu", "--kv-cache-tokens", "4096", "--max-model-len", str(MAX_LEN)
    )
    srv.path = path
    yield srv
    assert srv.stop() == 0, srv.output


@pytest.fixture(scope="module")
def reference(embed_server):
    from gapless.testing.pooling import sentence_transformers_embeddings

    return sentence_transformers_embeddings(embed_server.path, TEXTS)


@pytest.fixture(scope="module")
def http(embed_server):
    with httpx.Client(base_url=embed_server.url, timeout=60) as c:
        yield c


def test_openai_client_embeddings_equal_sentence_transformers(embed_server, reference):
    client = openai.OpenAI(base_url=f"{embed_server.url}/v1", api_key="none")
    out = client.embeddings.create(model=str(embed_server.path), input=TEXTS)  # base64 under the hood
    got = torch.tensor([d.embedding for d in out.data])
    assert [d.index for d in out.data] == list(range(len(TEXTS)))
    assert torch.nn.functional.cosine_similarity(got, reference, dim=1).min() >= 0.9999
    assert out.usage.prompt_tokens == out.usage.total_tokens > len(TEXTS)
    floats = client.embeddings.create(model=str(embed_server.path), input=TEXTS[1], encoding_format="float")
    assert torch.allclose(torch.tensor(floats.data[0].embedding), got[1], atol=1e-6)


def test_token_ids_base64_and_dimensions(http, reference, embed_server):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(embed_server.path)).encode(TEXTS[3])
    body = {"input": [ids, TEXTS[0]], "encoding_format": "base64", "dimensions": 16}
    r = http.post("/v1/embeddings", json=body)
    assert r.status_code == 200, r.text
    vecs = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in r.json()["data"]]
    for vec, ref in zip(vecs, reference[[3, 0]]):
        want = torch.nn.functional.normalize(ref[:16], dim=0)  # truncated, then normalized again
        assert vec.shape == (16,) and float(torch.dot(torch.from_numpy(vec.copy()), want)) >= 0.9999


def test_score_and_rerank_follow_the_reference_cosines(http, reference):
    cos = torch.nn.functional.cosine_similarity(reference[:1], reference[1:], dim=1).tolist()
    r = http.post("/v1/score", json={"text_1": TEXTS[0], "text_2": TEXTS[1:]})
    assert r.status_code == 200, r.text
    scores = [d["score"] for d in r.json()["data"]]
    assert np.allclose(scores, cos, atol=1e-4)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = http.post(path, json={"query": TEXTS[0], "documents": TEXTS[1:], "top_n": 2})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == sorted(range(3), key=lambda i: -cos[i])[:2]
        assert results[0]["document"]["text"] == TEXTS[1 + results[0]["index"]]
    pairwise = http.post("/score", json={"text_1": TEXTS[:2], "text_2": TEXTS[2:]}).json()["data"]
    want = torch.nn.functional.cosine_similarity(reference[:2], reference[2:], dim=1).tolist()
    assert np.allclose([d["score"] for d in pairwise], want, atol=1e-4)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/embeddings", {"input": ""}, "input"),
        ("/v1/embeddings", {"input": []}, "input"),
        ("/v1/embeddings", {"input": [[]]}, "input"),
        ("/v1/embeddings", {"input": list(range(MAX_LEN + 5))}, "input"),
        ("/v1/embeddings", {"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ("/v1/embeddings", {"input": "hi", "dimensions": 0}, "dimensions"),
        ("/v1/embeddings", {"input": "hi", "dimensions": 100000}, "dimensions"),
        ("/v1/embeddings", {"input": "hi", "model": "other"}, "model"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
        ("/v1/score", {"text_1": "a", "text_2": []}, "text_2"),
        ("/v1/rerank", {"query": "", "documents": ["a"]}, "query"),
        ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model"),
        ("/v1/completions", {"prompt": "hi"}, "model"),
    ],
)
def test_bad_requests_are_refused_and_the_server_goes_on(http, path, body, param):
    r = http.post(path, json=body)
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert http.post("/v1/embeddings", json={"input": "still here"}).status_code == 200


def test_text_too_long_once_tokenized_is_a_400(http):
    r = http.post("/v1/embeddings", json={"input": ["fine", "word " * (MAX_LEN * 2)]})
    assert r.status_code == 400 and "at most 63" in r.json()["error"]["message"], r.text


def test_chat_model_asked_for_embeddings_names_the_flag(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for path, body in [
        ("/v1/embeddings", {"input": "hi"}),
        ("/v1/score", {"text_1": "a", "text_2": "b"}),
        ("/v1/rerank", {"query": "a", "documents": ["b"]}),
    ]:
        r = httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=30)
        assert r.status_code == 400 and "--task embed" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=headers)
    assert r.status_code == 200, r.text


def test_many_concurrent_embeddings_batch_and_match(embed_server, reference):
    client = openai.OpenAI(base_url=f"{embed_server.url}/v1", api_key="none")
    import concurrent.futures

    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(
            pool.map(lambda t: client.embeddings.create(model=str(embed_server.path), input=t), TEXTS * 4)
        )
    assert time.monotonic() - start < 60
    got = torch.tensor([o.data[0].embedding for o in outs])
    assert torch.nn.functional.cosine_similarity(got, reference.repeat(4, 1), dim=1).min() >= 0.9999


def test_openapi_publishes_the_pooling_requests(http):
    doc = http.get("/openapi.json").json()
    assert {"/v1/embeddings", "/v1/score", "/v1/rerank"} <= set(doc["paths"])
    assert {"input", "encoding_format", "dimensions"} <= set(
        doc["components"]["schemas"]["EmbeddingRequest"]["properties"]
    )


@pytest.mark.slow  # (~10 s)
def test_causal_lm_reranker_scores_and_ranks_as_transformers(ckpt_factory, tmp_path):
    """`--task score`: each pair's prompt from `--score-template` (a file), scored by the true token against
    the false one at its end; /v1/rerank's order and /v1/score's values are transformers'."""
    from transformers import AutoTokenizer

    from gapless.testing.pooling import score_token_reference

    path = ckpt_factory("qwen3")
    tok = AutoTokenizer.from_pretrained(str(path))
    true, false = [t for t in ("a", "b", "x", "y") if len(tok.encode(t, add_special_tokens=False)) == 1][:2]
    template = tmp_path / "template.txt"
    template.write_text("Query: {query}\nDocument: {document}\nRelevant:")
    query, docs = "the cat", ["a cat sat", "the station", "cats and dogs", "x"]
    ids = [tok.encode(t, add_special_tokens=False)[0] for t in (true, false)]
    prompts = [template.read_text().format(query=query, document=d) for d in docs]
    want = score_token_reference(path, prompts, *ids)
    args = ["--model", str(path), "--device", "cpu", "--kv-cache-tokens", "4096", "--max-model-len", "128"]
    args += ["--runner", "pooling", "--score-token", true, "--score-false-token", false]
    srv = ServerProcess(*args, "--score-template", str(template))
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            r = http.post("/v1/rerank", json={"query": query, "documents": docs, "return_documents": False})
            assert r.status_code == 200, r.text
            results = r.json()["results"]
            assert [x["index"] for x in results] == sorted(range(4), key=lambda i: -want[i])
            assert [x["relevance_score"] for x in results] == pytest.approx(
                sorted(want, reverse=True), abs=1e-5
            )
            assert "document" not in results[0]
            scores = http.post("/v1/score", json={"text_1": query, "text_2": docs}).json()["data"]
            assert [d["score"] for d in scores] == pytest.approx(want, abs=1e-5)
            for path_, body in [
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                ("/v1/embeddings", {"input": "hi"}),
            ]:
                r = http.post(path_, json=body)
                assert r.status_code == 400, r.text
            assert (
                "--task generate"
                in http.post("/v1/completions", json={"prompt": "hi"}).json()["error"]["message"]
            )
    finally:
        assert srv.stop() == 0, srv.output
