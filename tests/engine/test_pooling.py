"""Pooling models offline (gapless.engine.pooling): `LLM.embed` equals sentence-transformers on tiny
random decoders made sentence-transformers checkpoints here (last, mean and cls pooling, prompts
prefilled in chunks, again through the prefix cache), `LLM.score` of a causal-LM reranker equals the
score tokens' logits transformers computes, and every wrong use is refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from gapless import LLM
from gapless.config import EngineConfig
from gapless.testing.pooling import score_token_reference, sentence_transformers_checkpoint

TEXTS = ["hello world", "the cat sat on the mat and looked at the door", "a", "where is it?"]
SMALL = {"device": "cpu", "kv_cache_tokens": 2048, "max_model_len": 128}


@pytest.mark.parametrize(
    "arch, pooling, normalize, overlap",
    [("qwen3", "last", True, True), ("llama", "mean", True, True), ("qwen2", "cls", False, False)],
)
def test_embed_equals_sentence_transformers(tmp_path, arch, pooling, normalize, overlap):
    pytest.importorskip("sentence_transformers", reason="the reference is sentence-transformers")
    from gapless.testing.pooling import sentence_transformers_embeddings

    path = sentence_transformers_checkpoint(tmp_path / "st", arch, pooling=pooling, normalize=normalize)
    ref = sentence_transformers_embeddings(path, TEXTS)
    # chunks of 4 tokens: every prompt but the shortest pools across chunks
    with LLM(str(path), **SMALL, chunked_prefill_size=4, overlap=overlap) as llm:
        assert llm.engine.pooling is not None and llm.engine.pooling.pooling == pooling
        first = torch.tensor([o.embedding for o in llm.embed(TEXTS)])
        again = torch.tensor([o.embedding for o in llm.embed(TEXTS[::-1])]).flip(0)  # prefixes cached now
        llm.check_integrity()
        stats = llm.get_stats()
    # prefill only: no token sampled (nor dropped), no decode batch
    assert stats["generated_tokens"] == stats["dropped_tokens"] == stats["decode_batches"] == 0, stats
    assert stats["prefill_batches"] > len(TEXTS)  # (in chunks)
    cos = torch.nn.functional.cosine_similarity(first, ref, dim=1)
    assert cos.min() >= 0.9999, cos
    assert torch.allclose(first.norm(dim=1), ref.norm(dim=1), rtol=1e-4)  # normalized or not, as ST
    assert torch.allclose(first, again, atol=1e-5)


def _single_tokens(path, n: int) -> list[str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    found = [
        t for t in ("yes", "no", "a", "b", "x", "y", "z") if len(tok.encode(t, add_special_tokens=False)) == 1
    ]
    return found[:n]


def test_causal_lm_reranker_scores_equal_transformers(ckpt_factory):
    path = ckpt_factory("qwen3")
    true, false = _single_tokens(path, 2)
    template = "Query: {query}\nDocument: {document}\nRelevant:"
    query, docs = "the cat", ["a cat sat", "the station", "cats and dogs", "x"]
    ids = [_id(path, true), _id(path, false)]
    want = score_token_reference(path, [template.format(query=query, document=d) for d in docs], *ids)
    options = {"score_token": true, "score_false_token": false, "score_template": template}
    with LLM(str(path), **SMALL, task="rerank", **options) as llm:
        got = llm.score(query, docs)
        one = LLM.score(llm, [query], docs[:1])
        with pytest.raises(ValueError, match="task embed"):
            llm.embed("hi")
    assert got == pytest.approx(want, abs=1e-5)
    assert sorted(range(4), key=lambda i: -got[i]) == sorted(range(4), key=lambda i: -want[i])
    assert one == pytest.approx(want[:1], abs=1e-5)
    with LLM(str(path), **SMALL, task="score", score_token=true) as llm:  # one token: its sigmoid
        assert llm.score(query, docs[0]) == pytest.approx(
            score_token_reference(path, [query + docs[0]], ids[0], None), abs=1e-5
        )


def _id(path, token: str) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path)).encode(token, add_special_tokens=False)[0]


def test_wrong_uses_are_refused_by_name(tmp_path, ckpt_factory):
    path = sentence_transformers_checkpoint(tmp_path / "st", "qwen3", pooling="mean")
    with LLM(str(path), **SMALL) as llm:
        with pytest.raises(ValueError, match="does not generate"):
            llm.generate("hi")
        with pytest.raises(ValueError, match="empty"):
            llm.embed("")
        with pytest.raises(ValueError, match="128 tokens"):
            llm.embed(list(range(200)))
        with pytest.raises(ValueError, match="give one, or as many"):
            llm.score(["a", "b"], ["a", "b", "c"])
        assert len(llm.embed(["ok"])[0].embedding) == 64  # and it goes on
    with LLM(str(ckpt_factory("qwen3")), **SMALL) as chat, pytest.raises(ValueError, match="task embed"):
        chat.embed("hi")
    with pytest.raises(ValueError, match="score_token"):
        EngineConfig(model="m", task="score")
    with pytest.raises(ValueError, match="pooling_type"):
        EngineConfig(model="m", pooling_type="max")
    with pytest.raises(ValueError, match="must be one"):
        LLM(str(ckpt_factory("qwen3")), **SMALL, task="score", score_token="hello world again")
    conf = path / "1_Pooling" / "config.json"
    conf.write_text(json.dumps({**json.loads(conf.read_text()), "pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="1_Pooling/config.json"):
        LLM(str(path), **SMALL)
    assert EngineConfig(model="m", task="embedding", pooling_type="MEAN").task == "embed"


def test_a_bare_decoder_without_its_head_loads_for_embeddings(tmp_path):
    """Qwen3-Embedding's layout: weights saved from the decoder body (no `model.` prefix, no lm_head)."""
    pytest.importorskip("sentence_transformers", reason="the reference is sentence-transformers")
    from safetensors.torch import load_file, save_file

    from gapless.testing.pooling import sentence_transformers_embeddings

    path = sentence_transformers_checkpoint(
        tmp_path / "st", "qwen3", pooling="last", tie_word_embeddings=False
    )
    (weights,) = path.glob("*.safetensors")
    tensors = load_file(weights)
    save_file({k.removeprefix("model."): v for k, v in tensors.items() if k != "lm_head.weight"}, weights)
    ref = sentence_transformers_embeddings(path, TEXTS[:2])
    with LLM(str(path), **SMALL) as llm:
        got = torch.tensor([o.embedding for o in llm.embed(TEXTS[:2])])
    assert torch.nn.functional.cosine_similarity(got, ref, dim=1).min() >= 0.9999


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; the CPU tests above run the same path")
def test_embed_and_score_on_cuda_equal_the_references(tmp_path, ckpt_factory):
    """The same checks on the GPU: Triton attention, the fused kernels, prompts in chunks, float32."""
    pytest.importorskip("sentence_transformers", reason="the reference is sentence-transformers")
    from gapless.testing.pooling import sentence_transformers_embeddings

    path = sentence_transformers_checkpoint(tmp_path / "st", "qwen3", pooling="mean")
    ref = sentence_transformers_embeddings(path, TEXTS)
    with LLM(
        str(path), device="cuda", kv_cache_tokens=2048, max_model_len=128, chunked_prefill_size=4
    ) as llm:
        got = torch.tensor([o.embedding for o in llm.embed(TEXTS)])
    assert torch.nn.functional.cosine_similarity(got, ref, dim=1).min() >= 0.9999
    chat = ckpt_factory("qwen3")
    true, false = _single_tokens(chat, 2)
    docs = ["a cat sat", "the station", "cats and dogs"]
    want = score_token_reference(chat, ["the cat" + d for d in docs], _id(chat, true), _id(chat, false))
    options = {"score_token": true, "score_false_token": false}
    with LLM(
        str(chat), device="cuda", kv_cache_tokens=2048, max_model_len=128, task="score", **options
    ) as llm:
        assert llm.score("the cat", docs) == pytest.approx(want, abs=1e-4)


def test_a_pooling_request_aborted_while_its_last_chunk_runs_ends_once(tmp_path):
    """Overlap keeps the last chunk in flight after its step: the request is in no queue then (status
    POOLING), so the abort takes effect when that batch is processed, and the KV goes back once."""
    from gapless.engine.request import ReqStatus
    from gapless.sampling_params import SamplingParams

    path = sentence_transformers_checkpoint(tmp_path / "st", "qwen3", pooling="last")
    with LLM(str(path), **SMALL, overlap=True) as llm:
        engine = llm.engine
        req = engine.add_request(engine.tokenize("hello world"), SamplingParams())
        assert engine.step() == [] and req.status is ReqStatus.POOLING and req.inflight == 1
        engine.abort(req.rid)
        while engine.has_unfinished():
            engine.step()
        assert req.finish_reason == "abort" and req.output_ids == []
        engine.check_integrity()
        assert len(llm.embed(["hello world"])[0].embedding) == 64  # and it goes on
