"""Overlap scheduling: race safety under chaos, abort at every stage, finish while in flight,
future-token slots, the device process, the bubble meter and the trace."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch

from gapless import LLM, SamplingParams
from gapless.config import EngineConfig
from gapless.engine.meter import BubbleMeter
from gapless.engine.request import ReqStatus
from gapless.engine.runner import ModelRunner
from gapless.engine.stream.chaos import ChaosStream, FutureCheckingRunner
from gapless.engine.stream.inline import InlineStream
from gapless.engine.stream.thread import ThreadStream

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
BACKGROUND = [[5, 6, 7], [9] * 20, list(range(30, 70)), [11, 12]]
TARGET = list(range(100, 180))  # 80 tokens: 5 chunks of 16


@pytest.fixture(scope="module")
def qwen3(ckpt_factory):
    return str(ckpt_factory("qwen3"))


@pytest.fixture(scope="module")
def reference(qwen3):
    """Outputs of the background requests and of the target, run alone without overlap."""
    with LLM(qwen3, device="cpu", overlap=False, kv_cache_tokens=2048) as llm:
        outs = llm.generate(BACKGROUND + [TARGET], GREEDY, use_tqdm=False)
    return [o.token_ids for o in outs]


def overlap_llm(path: str, chaos_seed: int, worker: str = "thread", **kw) -> LLM:
    return LLM(
        path,
        device="cpu",
        overlap=True,
        cpu_worker=worker,
        chaos_seed=chaos_seed,
        chunked_prefill_size=16,
        kv_cache_tokens=2048,
        **kw,
    )


# Where in its life the target is when the abort arrives; each is a predicate on its state after a step.
STAGES = {
    "waiting": lambda r: True,  # before any step
    "mid_chunked_prefill": lambda r: r.status is ReqStatus.PREFILL and 16 < r.kv_len < 64,
    "last_chunk_in_flight": lambda r: r.status is ReqStatus.RUNNING and r.inflight > 0 and not r.output_ids,
    "decode_in_flight": lambda r: len(r.output_ids) >= 2 and r.inflight > 0,
    "last_token_in_flight": lambda r: r.sampled == r.params.max_tokens and r.inflight > 0 and not r.finished,
}


@pytest.mark.parametrize("chaos_seed", [0, 1, 2])
@pytest.mark.parametrize("stage", STAGES)
def test_abort_at_every_stage(qwen3, reference, stage, chaos_seed):
    with overlap_llm(qwen3, chaos_seed) as llm:
        eng = llm.engine
        bg = [eng.add_request(p, GREEDY) for p in BACKGROUND]
        target = eng.add_request(TARGET, GREEDY)
        if stage != "waiting":
            for _ in range(200):
                eng.step()
                if STAGES[stage](target):
                    break
            else:
                pytest.fail(f"target never reached stage {stage}")
        eng.abort(target.rid)
        while eng.has_unfinished():
            eng.step()
        assert target.finish_reason == "abort"
        assert len(target.output_ids) < GREEDY.max_tokens  # the in-flight token is never emitted
        assert target.output_ids == reference[-1][: len(target.output_ids)]
        assert [r.output_ids for r in bg] == reference[:-1]
        llm.check_integrity()


@pytest.mark.parametrize("chaos_seed", [0, 1, 2])
def test_finish_while_in_flight_emits_nothing_more(qwen3, reference, chaos_seed):
    """A stop token ends a request while the next batch (launched before the host saw the token) still
    holds it: no extra token, KV and row freed exactly once, and an abort after that is a no-op."""
    stop_at = {i: ref[4] for i, ref in enumerate(reference[:-1])}
    with overlap_llm(qwen3, chaos_seed) as llm:
        eng = llm.engine
        reqs = [
            eng.add_request(p, SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop_at[i]]))
            for i, p in enumerate(BACKGROUND)
        ]
        aborted_late = False
        while eng.has_unfinished():
            eng.step()
            for r in reqs:
                if r.finished and r.inflight > 0:  # finished, its in-flight batch not processed yet
                    eng.abort(r.rid)
                    aborted_late = True
        for r, ref in zip(reqs, reference):
            expected = ref[: ref.index(stop_at[reqs.index(r)]) + 1]
            assert r.output_ids == expected and r.finish_reason == "stop"
        assert eng.stats.dropped_tokens > 0, "no request finished while a batch still held it"
        assert aborted_late
        llm.check_integrity()


@pytest.mark.slow  # (~9 s: the device process; the in-process chaos cases stay in make test)
def test_device_process_with_chaos_matches_reference(qwen3, reference):
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    with overlap_llm(qwen3, chaos_seed=7, worker="process") as llm:
        outs = llm.generate(BACKGROUND + [TARGET], GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == reference
        stats = llm.get_stats()
        assert stats["steps"] > 0 and 0.0 <= stats["device_idle_fraction"] < 1.0
        assert stats["generated_tokens"] == sum(len(o.token_ids) for o in outs)
        assert stats["mean_host_ms_per_step"] > 0 and stats["device_busy_s"] > 0
        llm.check_integrity()
    # the host was pinned to one core for the device process: closing gave it all back
    assert os.sched_getaffinity(0) == affinity and torch.get_num_threads() == threads


def test_test_machinery_is_installed_only_under_chaos_seed(qwen3):
    with overlap_llm(qwen3, chaos_seed=None) as llm:
        assert type(llm.engine.runner) is ModelRunner
        assert isinstance(llm.engine.stream, ThreadStream) and type(llm.engine.stream.jobs) is InlineStream
    with overlap_llm(qwen3, chaos_seed=5) as llm:
        assert isinstance(llm.engine.runner, FutureCheckingRunner)
        host = llm.engine.stream
        assert isinstance(host, ChaosStream) and isinstance(host.stream, ThreadStream)
        assert isinstance(host.stream.jobs, ChaosStream)  # delays on the device side too


def test_seeded_sampling_same_with_and_without_overlap(qwen3):
    params = [
        SamplingParams(
            max_tokens=12, temperature=1.0, top_p=0.9, seed=i, frequency_penalty=0.5, ignore_eos=True
        )
        for i in range(len(BACKGROUND))
    ]
    with LLM(qwen3, device="cpu", overlap=False, kv_cache_tokens=2048) as plain:
        ref = [o.token_ids for o in plain.generate(BACKGROUND, params, use_tqdm=False)]
    for worker in ("thread", "process"):
        with overlap_llm(qwen3, chaos_seed=3, worker=worker) as llm:
            assert [o.token_ids for o in llm.generate(BACKGROUND, params, use_tqdm=False)] == ref


def test_reading_an_unwritten_future_slot_fails_loudly(qwen3):
    # chaos_seed installs the checking runner
    with LLM(qwen3, device="cpu", overlap=False, kv_cache_tokens=512, chaos_seed=0) as llm:
        eng = llm.engine
        req = eng.add_request([5, 6, 7], GREEDY)
        eng.step()  # prefill: samples the first token into the row's slot
        eng.step()  # decode: consumes it (slot marked invalid), samples the next
        eng.runner.token_buf[req.row] = -1  # as if the sampler had not written it
        with pytest.raises(RuntimeError, match="unwritten future-token slot"):
            eng.step()


@pytest.mark.slow  # (a device process killed, ~10 s)
def test_device_process_death_is_an_error_not_a_hang(qwen3):
    llm = overlap_llm(qwen3, chaos_seed=None, worker="process")
    stream = llm.engine.stream  # the engine lets go of it at shutdown
    proc = stream.proc
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)  # dead before the send (the other order, dying mid-job, is the recv path)
    with pytest.raises(RuntimeError, match="device process died"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    llm.shutdown()  # nothing left to drain: it closes the stream
    assert stream.conn.closed


@pytest.mark.slow  # (a device process, ~7 s)
def test_bad_checkpoint_error_comes_back_from_the_device_process(tmp_path, qwen3):
    import shutil

    from safetensors.torch import load_file, save_file

    # a checkpoint that passes the start-up checks (config, weights file, tokenizer) but lacks a weight,
    # which only loading it, in the device process, finds
    ckpt = tmp_path / "bad"
    shutil.copytree(qwen3, ckpt)
    (weights,) = ckpt.glob("*.safetensors")
    tensors = load_file(weights)
    del tensors["model.norm.weight"]
    save_file(tensors, weights)
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    with pytest.raises(ValueError, match="lacks weights: model.norm.weight"):
        overlap_llm(str(ckpt), chaos_seed=None, worker="process")
    # the failed start gave the host its cores and threads back
    assert os.sched_getaffinity(0) == affinity and torch.get_num_threads() == threads


def test_overlap_switch(monkeypatch):
    assert EngineConfig("m").overlap is True
    monkeypatch.setenv("GAPLESS_DISABLE_OVERLAP", "1")
    assert EngineConfig("m").overlap is False
    assert EngineConfig("m", overlap=True).overlap is True


def test_bubble_meter_counts_gaps_only_while_work_is_pending():
    m = BubbleMeter(keep_trace=True)
    m.job("extend", 0.0, 1.0)
    m.job("decode", 1.5, 2.5)  # 0.5 s bubble
    m.host_span("schedule", 2.5, 2.7)
    m.step_done()
    m.went_idle()
    m.job("decode", 10.0, 11.0)  # after an idle period: not a bubble
    st = m.stats()
    assert st.device_jobs == 3 and st.device_busy_s == pytest.approx(3.0)
    assert (st.prefill_device_s, st.decode_device_s) == pytest.approx((1.0, 2.0))
    assert st.device_idle_s == pytest.approx(0.5)
    assert st.device_idle_fraction == pytest.approx(0.5 / 3.5)
    assert st.mean_host_ms_per_step == pytest.approx(200.0)


def test_a_paused_span_is_metered_in_two_parts_around_what_it_holds():
    """`span` meters a block as one host span; `paused` inside it leaves out what it holds (a drain's wait)
    while that block's own spans count, once; `record=False` meters nothing (an inline launch)."""
    m = BubbleMeter(keep_trace=True)
    with m.span("schedule"):
        with m.paused():
            with m.span("process"):
                pass
            time.sleep(0.02)  # the wait for the device: no span's
    with m.span("launch", record=False):
        pass
    m.step_done("decode")
    names = [name for _, name, _, _ in m.spans]
    assert names == ["schedule", "process", "schedule"]
    (_, _, s0, e0), (_, _, p0, p1), (_, _, s1, e1) = m.spans
    assert s0 <= e0 <= p0 <= p1 < s1 <= e1 and s1 - p1 >= 0.02
    st = m.stats()
    assert st.host_s == pytest.approx((e0 - s0) + (p1 - p0) + (e1 - s1)) and st.host_s < 0.02
    assert st.decode_steps == 1 and st.decode_host_s == pytest.approx(st.host_s)


def test_the_engine_exposes_its_meter(qwen3):
    with LLM(qwen3, device="cpu", overlap=False) as llm:
        engine = llm.engine
        assert engine.meter is engine.scheduler.meter  # (the old path keeps working)
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
        assert engine.meter.stats() is engine.stats and engine.stats.host_s > 0
        engine.meter.reset()
        assert engine.stats.steps == 0 and engine.stats.host_s == 0


def test_trace_has_host_and_device_spans(tmp_path, qwen3):
    trace = tmp_path / "trace.json"
    with overlap_llm(qwen3, chaos_seed=None, trace_path=str(trace)) as llm:
        llm.generate(BACKGROUND, GREEDY, use_tqdm=False)
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["tid"] for e in spans} == {1, 2}
    assert any(e["name"] == "decode" for e in spans) and any(e["name"] == "process" for e in spans)
    assert all(e["dur"] >= 0 for e in spans)


def test_a_retraction_drain_is_metered_once_and_never_its_wait(tmp_path, qwen3):
    """A retraction drains the batch in flight inside the step's scheduling: the meter counts the drain's
    processing once (as "process") and its wait for the device as none of the host's, so the host's
    spans of a run with retractions never overlap (they did: "schedule" held the drain's "process")."""
    trace = tmp_path / "trace.json"
    prompts = [[10 + i, 20 + i, 30 + i] * 4 for i in range(8)]
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    with LLM(qwen3, device="cpu", overlap=True, kv_cache_tokens=256, trace_path=str(trace)) as llm:
        llm.generate(prompts, params, use_tqdm=False)
        assert llm.get_stats()["retractions"] > 0
    events = json.loads(trace.read_text())["traceEvents"]
    host = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e["ph"] == "X" and e["tid"] == 1
    )
    overlaps = [(a, b) for a, b in zip(host, host[1:]) if b[0] < a[1] - 1e-3]  # µs, rounding aside
    assert not overlaps, overlaps[:3]


def test_batches_share_no_memory_with_host_state(qwen3):
    """The device side must never read an object the scheduler goes on mutating (SGLang #8056): every
    tensor a batch carries is its own, never a view of the host request table or of radix-tree slots."""
    import dataclasses

    with LLM(qwen3, device="cpu", overlap=False, kv_cache_tokens=1024, chunked_prefill_size=16) as llm:
        eng = llm.engine
        sched = eng.scheduler
        llm.generate([list(range(10, 50))], GREEDY, use_tqdm=False)  # cached: the next prompt hits the tree
        for p in ([*range(10, 50), 7, 8], [5, 6]):
            eng.add_request(p, SamplingParams(max_tokens=3, temperature=0.0, repetition_penalty=1.2))
        host = sched.req_table.host_table.untyped_storage().data_ptr()
        seen = 0
        while eng.has_unfinished():
            batch = sched.schedule()
            if batch is None:
                eng.step()
                continue
            tree = {n.value.untyped_storage().data_ptr() for n in _tree_nodes(sched.cache.root)}
            tensors = []
            for f in dataclasses.fields(batch.forward):
                v = getattr(batch.forward, f.name)
                tensors += [x for x in (v if isinstance(v, tuple) else (v,)) if isinstance(x, torch.Tensor)]
            for t in tensors:
                assert t.untyped_storage().data_ptr() not in tree | {host}
            for _, prompt, output in batch.forward.penalty_inits:  # copies, not the request's own lists
                assert all(prompt is not r.prompt_ids and output is not r.output_ids for r in batch.reqs)
            seen += bool(batch.forward.table_writes) + bool(batch.forward.penalty_inits)
            sched.launch(batch)
            while sched.inflight:
                sched._process_oldest()
        assert seen >= 2, "the workload should carry table writes and penalty inits"
        llm.check_integrity()


def _tree_nodes(node):
    for child in node.children.values():
        yield child
        yield from _tree_nodes(child)
