"""Engine behaviour beyond greedy parity: caching, bad input, seeds, abort, finish reasons, loading."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from gapless import LLM, SamplingParams
from gapless.testing import make_checkpoint
from gapless.testing.hf_reference import check_greedy, hf_greedy, load_hf_model, make_prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3(ckpt_factory):
    return str(ckpt_factory("qwen3"))


@pytest.fixture()
def llm(qwen3):
    with LLM(qwen3, device="cpu", kv_cache_tokens=2048, max_model_len=256) as llm:
        yield llm


def test_repeated_prompt_hits_cache_with_same_output(llm):
    prompt = make_prompts(llm.engine.vocab_size, n=1, seed=3, shared_prefix=40, max_len=70)[0]
    first = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    again = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert first.cached_tokens == 0
    assert again.cached_tokens > 0
    assert again.token_ids == first.token_ids
    llm.check_integrity()


def test_stats_name_each_figure_once(llm):
    prompts = make_prompts(llm.engine.vocab_size, n=3, seed=4, shared_prefix=20, max_len=40)
    llm.generate(prompts, GREEDY, use_tqdm=False)
    llm.generate(prompts[:1], GREEDY, use_tqdm=False)  # served from the prefix cache
    st, flat = llm.engine.stats, llm.get_stats()
    assert {k: flat[k] for k in dataclasses.asdict(st)} == dataclasses.asdict(st)
    assert flat["device_jobs"] == st.prefill_batches + st.decode_batches > 0  # every launched batch ran
    assert flat["steps"] >= flat["device_jobs"]  # a step launches at most one batch
    assert flat["generated_tokens"] == 4 * GREEDY.max_tokens and flat["prefix_hit_rate"] > 0
    assert flat["kv_used_tokens"] == 0 and flat["running_requests"] == flat["waiting_requests"] == 0
    assert flat["kv_free_tokens"] + flat["kv_cached_tokens"] == flat["kv_total_tokens"]


def test_text_prompts_and_per_prompt_params(llm):
    outs = llm.generate(
        ["hello world", "café"],
        [GREEDY, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)],
        use_tqdm=False,
    )
    assert [len(o.token_ids) for o in outs] == [12, 3]
    assert outs[0].prompt == "hello world"
    assert outs[0].text == llm.tokenizer.decode(outs[0].token_ids, skip_special_tokens=True)


def test_bad_input_raises_clear_errors_and_engine_keeps_working(llm):
    good = [5, 6, 7]
    with pytest.raises(ValueError, match=r"300 tokens.*256"):
        llm.generate([list(range(3, 303))], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[1, 10**6]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(TypeError):
        SamplingParams(temprature=1.0)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="sampling params"):
        llm.generate([good, good], [GREEDY], use_tqdm=False)
    # a batch with one bad prompt queues nothing
    with pytest.raises(ValueError):
        llm.generate([good, []], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    out = llm.generate([good], GREEDY, use_tqdm=False)[0]
    assert len(out.token_ids) == 12
    llm.check_integrity()


def test_prompt_longer_than_kv_pool_names_both_lengths(qwen3):
    with LLM(qwen3, device="cpu", kv_cache_tokens=64) as small:
        with pytest.raises(ValueError, match=r"100 tokens.*KV cache.*64"):
            small.generate([list(range(3, 103))], GREEDY, use_tqdm=False)


def test_seeded_sampling_same_alone_and_in_mixed_batch(llm):
    prompt = [11, 12, 13, 14, 15]
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].token_ids
    others = [
        SamplingParams(max_tokens=n, temperature=t, ignore_eos=True)
        for n, t in [(5, 0.0), (20, 1.3), (9, 0.7)]
    ]
    mixed = llm.generate(
        [[3, 4], [9] * 30, prompt, [20, 21, 22]], [others[0], others[1], seeded, others[2]], use_tqdm=False
    )
    assert mixed[2].token_ids == alone
    other_seed = llm.generate(
        [prompt], SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True), use_tqdm=False
    )[0].token_ids
    assert other_seed != alone


def test_seeded_sampling_with_penalties_survives_retraction(qwen3):
    prompts = make_prompts(1000, n=12, seed=5, max_len=60)
    params = [
        SamplingParams(
            max_tokens=20,
            temperature=0.8,
            seed=i,
            repetition_penalty=1.3,
            frequency_penalty=0.5,
            presence_penalty=0.3,
            ignore_eos=True,
        )
        for i in range(len(prompts))
    ]
    with LLM(qwen3, device="cpu", kv_cache_tokens=4096) as roomy:
        ref = [o.token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    with LLM(
        qwen3,
        device="cpu",
        kv_cache_tokens=160,
        page_size=4,
        chunked_prefill_size=16,
        init_new_token_ratio=0.02,
        min_new_token_ratio=0.02,
    ) as tight:
        got = [o.token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
        assert tight.engine.stats.retractions > 0
        tight.check_integrity()
    assert got == ref


def test_abort_at_every_stage_leaves_nothing_behind(qwen3):
    with LLM(
        qwen3, device="cpu", kv_cache_tokens=1024, chunked_prefill_size=16, max_running_requests=4
    ) as llm:
        eng = llm.engine
        long_prompt = list(range(3, 83))  # 80 tokens: 5 chunks of 16
        params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
        decoding = eng.add_request([5, 6, 7], params)
        chunked = eng.add_request(long_prompt, params)
        waiting = [eng.add_request([9, 10, 11 + i], params) for i in range(5)]
        eng.step()  # prefill: `decoding` and the first chunk of `chunked`
        eng.step()
        assert chunked.status.value == "prefill" and decoding.status.value == "running"
        for r in (decoding, chunked, waiting[-1]):
            eng.abort(r.rid)
        done = eng.step()
        for r in (decoding, chunked, waiting[-1]):
            assert r in done and r.finish_reason == "abort" and r.row is None
        eng.abort("no-such-request")  # unknown ids are ignored
        while eng.has_unfinished():
            eng.step()
        assert all(r.finish_reason == "length" for r in waiting[:-1])
        llm.check_integrity()


def test_finish_reasons(qwen3, llm):
    prompt = [40, 41, 42, 43]
    free = llm.generate(
        [prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False
    )[0]
    # stop token: the 5th generated token
    tok = free.token_ids[4]
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[tok]), use_tqdm=False
    )[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: free.token_ids.index(tok) + 1]
    # stop string: text of generated tokens 3..5; output text stops right before it
    full_text = llm.tokenizer.decode(free.token_ids)
    stop = llm.tokenizer.decode(free.token_ids[3:6]).strip() or llm.tokenizer.decode(free.token_ids[3:6])
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=24, temperature=0.0, stop=[stop], ignore_eos=True), use_tqdm=False
    )[0]
    assert out.finish_reason == "stop"
    assert out.text == full_text[: full_text.find(stop)]
    assert stop not in out.text
    # max_tokens
    assert free.finish_reason == "length" and len(free.token_ids) == 24
    # context limit: max_model_len 256 caps prompt + output
    out = llm.generate(
        [list(range(3, 253))],
        SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6
    llm.check_integrity()


def test_eos_stops_unless_ignored(tmp_path, qwen3):
    # make EOS the greedy choice: the first greedy token becomes the model's EOS id
    probe = LLM(qwen3, device="cpu", kv_cache_tokens=512)
    first = probe.generate([[7, 8, 9]], GREEDY, use_tqdm=False)[0].token_ids
    probe.shutdown()
    ckpt = tmp_path / "eos"
    shutil.copytree(qwen3, ckpt)
    gen = json.loads((ckpt / "generation_config.json").read_text())
    gen["eos_token_id"] = (
        [gen["eos_token_id"], first[2]] if isinstance(gen["eos_token_id"], int) else [first[2]]
    )
    (ckpt / "generation_config.json").write_text(json.dumps(gen))
    with LLM(str(ckpt), device="cpu", kv_cache_tokens=512) as llm:
        stopped = llm.generate([[7, 8, 9]], SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)[0]
        ignored = llm.generate([[7, 8, 9]], GREEDY, use_tqdm=False)[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == first[:3]
    assert ignored.token_ids == first


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_policies_give_reference_outputs(ckpt_factory, policy):
    path = ckpt_factory("llama")
    hf = load_hf_model(path)
    prompts = make_prompts(hf.config.vocab_size, n=8, seed=11)
    with LLM(
        str(path), device="cpu", schedule_policy=policy, max_running_requests=3, kv_cache_tokens=4096
    ) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        for p, o in zip(prompts, outs):
            assert check_greedy(o.token_ids, hf_greedy(hf, p, 12)) is None
        llm.check_integrity()


def test_sharded_checkpoint_matches_single_file(tmp_path, qwen3):
    sharded = make_checkpoint(tmp_path / "sharded", "qwen3", shards=3)
    assert (sharded / "model.safetensors.index.json").is_file()
    prompts = [[5, 6, 7, 8], [100, 200]]
    with (
        LLM(str(sharded), device="cpu", kv_cache_tokens=512) as a,
        LLM(qwen3, device="cpu", kv_cache_tokens=512) as b,
    ):
        assert [o.token_ids for o in a.generate(prompts, GREEDY, use_tqdm=False)] == [
            o.token_ids for o in b.generate(prompts, GREEDY, use_tqdm=False)
        ]


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"architectures": ["DeepseekV3ForCausalLM"]}, "unsupported architecture 'DeepseekV3ForCausalLM'"),
        ({"num_experts": 8}, "mixture-of-experts"),
        ({"architectures": ["Qwen3MoeForCausalLM"]}, "Qwen3MoeForCausalLM: the config lacks num_experts"),
        (
            {
                "architectures": ["Qwen3MoeForCausalLM"],
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "use_sliding_window": True,
                "sliding_window": 64,
            },
            "Qwen3MoeForCausalLM: sliding-window attention",
        ),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}},
            "rope scaling type 'yarn'",
        ),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_unsupported_checkpoints_are_refused_by_name(tmp_path, qwen3, patch, message):
    ckpt = tmp_path / "bad"
    shutil.copytree(qwen3, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(patch)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        LLM(str(ckpt), device="cpu")


def test_integrity_check_catches_a_leak(llm):
    llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    leaked = llm.engine.scheduler.allocator.alloc(1)
    with pytest.raises(AssertionError):
        llm.check_integrity()
    llm.engine.scheduler.allocator.free(leaked)
    llm.check_integrity()


@pytest.mark.parametrize("overlap", [False, True])
def test_max_running_requests_is_respected_and_reached(qwen3, overlap):
    with LLM(
        qwen3,
        device="cpu",
        kv_cache_tokens=4096,
        max_running_requests=3,
        overlap=overlap,
        cpu_worker="thread",
    ) as llm:
        eng = llm.engine
        for i in range(8):
            eng.add_request([5 + i, 6, 7], GREEDY)
        eng.step()
        assert len(eng.scheduler.queues.running) == 3, "one prefill batch admits up to the cap"
        while eng.has_unfinished():
            eng.step()
            assert len(eng.scheduler.queues.running) + (eng.scheduler.queues.chunked is not None) <= 3
        llm.check_integrity()


def test_a_full_engine_plans_no_admission_while_requests_wait(qwen3, monkeypatch):
    """At max_running_requests with more waiting, a step does none of an admission's work per request (the
    running requests' reservation summed, the waiting queue ordered): it could admit none. Once a row is
    free again, it does, and the waiting requests still all finish."""
    from gapless.engine.scheduler.prefill import PrefillPlanner

    orders = []
    order = PrefillPlanner._order_waiting
    monkeypatch.setattr(PrefillPlanner, "_order_waiting", lambda self: orders.append(1) or order(self))
    params = dataclasses.replace(GREEDY, max_tokens=6)
    with LLM(qwen3, device="cpu", kv_cache_tokens=4096, max_running_requests=2, overlap=False) as llm:
        eng = llm.engine
        for i in range(5):
            eng.add_request([5 + i, 6, 7], params)
        eng.step()  # admits 2
        assert len(orders) == 1
        for _ in range(4):  # decodes while 3 wait: none can be admitted
            eng.step()
        assert len(orders) == 1 and len(eng.scheduler.queues.waiting) == 3
        while eng.has_unfinished():
            eng.step()
        assert len(orders) > 1  # the waiting ones were admitted as rows freed
        llm.check_integrity()


def test_the_running_requests_reservation_sum_is_each_ones_summed():
    """`DecodeReserve.total` (admission's sum over the running requests, written out for speed) is
    `tokens` summed: at every ratio, with requests near max_tokens, past it, near the context's end and
    above the per-request cap."""
    import random

    from gapless.config import EngineConfig
    from gapless.engine.request import Req
    from gapless.engine.scheduler.budget import CLIP_MAX_NEW_TOKENS, DecodeReserve

    rng = random.Random(0)
    reserve = DecodeReserve(EngineConfig("m"), max_context=5000)
    reqs = []
    for i in range(300):
        params = dataclasses.replace(GREEDY, max_tokens=rng.choice([1, 7, 300, CLIP_MAX_NEW_TOKENS + 900]))
        out = rng.randrange(0, min(params.max_tokens + 3, 5000))
        reqs.append(Req(str(i), [1] * rng.randrange(1, 1000), params, 0, i, output_ids=[2] * out))
    for ratio in (1.0, 0.7, 0.333, 0.05):
        reserve.ratio = ratio
        assert reserve.total(reqs) == sum(reserve.tokens(r) for r in reqs)
        assert reserve.total(reqs[:1]) == reserve.tokens(reqs[0]) and reserve.total([]) == 0
    assert any(r.remaining_tokens(5000) == 0 for r in reqs) and any(
        r.remaining_tokens(5000) > CLIP_MAX_NEW_TOKENS for r in reqs
    )


def test_a_waiting_requests_prefix_key_is_built_once_while_it_waits(qwen3):
    """Ordering the waiting queue by cached prefix (lpm) looks up every waiting prompt each step: its key
    (its tokens as the prefix cache's tuple) is built once while it waits, a new one when its tokens the
    cache may supply change (a retracted request's outputs), and none kept once it is admitted."""
    from gapless.engine.scheduler.kv import _match_key

    params = dataclasses.replace(GREEDY, max_tokens=4)
    with LLM(qwen3, device="cpu", kv_cache_tokens=4096, max_running_requests=1, overlap=False) as llm:
        eng = llm.engine
        eng.add_request([5, 6, 7, 8], params)  # runs first, in the one row
        waiting = eng.add_request([9, 10, 11], params)
        eng.step()
        key = _match_key(waiting)
        assert key == (9, 10) and _match_key(waiting) is key
        eng.step()
        assert waiting.match_key is not None and waiting.match_key[1] is key  # still waiting: kept
        waiting.output_ids.append(12)  # as a retracted request comes back with its outputs
        assert _match_key(waiting) == (9, 10, 11)
        waiting.output_ids.pop()
        for _ in range(20):  # until the first finishes and the waiting one is admitted
            eng.step()
            if waiting.row is not None:
                break
        assert waiting.row is not None and waiting.match_key is None
        while eng.has_unfinished():
            eng.step()
        llm.check_integrity()


@pytest.mark.parametrize("overlap", [False, True])
def test_interrupt_mid_step_leaves_an_engine_that_only_shuts_down(qwen3, monkeypatch, overlap):
    """Ctrl-C can land anywhere inside a step, e.g. after a batch's host state moved but before it was
    launched. The interrupt must reach the caller (not an error from a drain over half-moved state), the
    engine must refuse further steps by name, and shutdown must still stop the device side cleanly."""
    from gapless.engine.scheduler import Scheduler

    llm = LLM(str(qwen3), device="cpu", dtype="float32", kv_cache_tokens=4096, overlap=overlap)
    calls = {"n": 0}
    launch = Scheduler.launch

    def interrupted_launch(self, batch):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return launch(self, batch)

    monkeypatch.setattr(Scheduler, "launch", interrupted_launch)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[5, 6, 7], [8, 9, 10, 11]], params, use_tqdm=False)
    assert llm.engine.broken
    with pytest.raises(RuntimeError, match="interrupted"):
        llm.generate([[5, 6]], params, use_tqdm=False)
    llm.shutdown()  # no drain, no error
