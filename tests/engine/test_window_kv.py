"""Freeing the KV that left the sliding window (gapless.engine.scheduler.window): a Mistral checkpoint whose
every layer slides a 12-token window decodes past it, and

- its greedy tokens equal transformers' across page sizes 1 and 16, radix cache on/off, chunked prefill
  across the window's edge, plain and overlapped (chaos) loops, a pool small enough to force retraction,
  while every freed slot is poisoned with NaN on the device the moment it is freed (stream order);
- nothing leaks (`check_integrity`) after retraction and abort;
- a long generation's pool usage stays bounded by about the window, and more long requests run at once
  without retraction than with the KV kept;
- a model with a global layer beside its window layers (Gemma 2) frees nothing.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from gapless import LLM, SamplingParams
from gapless.engine.runner import ModelRunner
from gapless.engine.scheduler import window as window_module
from gapless.engine.scheduler.window import WindowKV, freeing_window
from gapless.memory.allocator import PageAllocator
from gapless.testing.hf_reference import check_greedy, greedy_references, make_prompts

WINDOW = 12
MAX_NEW = 40
SMALL_KV = 96  # below the workload's peak need, above one request's (40 + 40): retraction
RETRACT_EAGERLY = {"init_new_token_ratio": 0.02, "min_new_token_ratio": 0.02}
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
LOOPS = {"plain": {"overlap": False}, "overlap": {"overlap": True, "cpu_worker": "thread", "chaos_seed": 3}}


def _prompts(vocab: int) -> list[list[int]]:
    # lengths 1..40 (past the window, chunked across its edge by chunks of 16), a third sharing a
    # 20-token prefix: a prefix hit that ends past the window
    return make_prompts(vocab, n=6, seed=3, shared_prefix=20, max_len=40)


@pytest.fixture(scope="module")
def references(ckpt_factory):
    return greedy_references(lambda arch: ckpt_factory(arch, sliding_window=WINDOW), _prompts, MAX_NEW)


def poison_freed(runner: ModelRunner) -> list[int]:
    """Make the device side fill every slot the scheduler frees with NaN, just before the batch that
    frees it runs (its table writes point the freed positions at slot 0; the slots they pointed at are
    read off the device table first). A NaN read anywhere, masked or not, would reach the tokens.
    Returns a one-item list counting the poisoned slots."""
    poisoned = [0]
    forward_hidden = runner.forward_hidden

    def poisoning(batch):  # noqa: ANN001, ANN202 - the runner's own signature
        if batch.table_writes is not None:
            rows, positions, slots = batch.table_writes
            gone = slots == 0
            old = runner.req_table.device_table[rows[gone], positions[gone]].long()
            assert bool((old != 0).all()), "a position was freed twice"
            runner.kv_pool.k_buffer[:, old] = float("nan")
            runner.kv_pool.v_buffer[:, old] = float("nan")
            poisoned[0] += old.numel()
        return forward_hidden(batch)

    runner.forward_hidden = poisoning  # type: ignore[method-assign]
    return poisoned


# the small pool in the two corners where freeing alone does not avert retraction: the radix cache's
# locked prompt chunks are not freed; pages of 16 free late (a page goes only once wholly behind)
COMBOS = [
    (page_size, radix, loop, kv)
    for page_size, radix, loop in itertools.product([1, 16], [True, False], LOOPS)
    for kv in ([None, SMALL_KV] if (page_size, radix) in ((1, True), (16, False)) else [None])
]


@pytest.mark.parametrize(("page_size", "radix", "loop", "kv"), COMBOS)
def test_greedy_parity_while_freeing(references, page_size, radix, loop, kv):
    path, prompts, refs = references("mistral")
    with LLM(
        str(path),
        device="cpu",
        dtype="float32",
        page_size=page_size,
        radix_cache=radix,
        chunked_prefill_size=16,
        kv_cache_tokens=kv or 4096,
        **RETRACT_EAGERLY if kv else {},
        **LOOPS[loop],
    ) as llm:
        assert llm.engine.scheduler.kv.window is not None
        poisoned = poison_freed(llm.engine.runner)
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        for out, ref in zip(outs, refs):
            check_greedy(out.token_ids, ref)
        assert poisoned[0] > 0, "nothing was freed"
        if kv:
            assert llm.engine.stats.retractions > 0, "the small pool was meant to force retraction"
        if radix:
            assert sum(out.cached_tokens for out in outs) > 0, "no prefix hit"
        llm.check_integrity()


@pytest.mark.slow  # (a device process, ~9 s)
def test_device_process_overlap(references):
    """The overlap loop against a real device process (what a CPU with 4+ cores runs): freeing at
    schedule time while the process still runs the previous batch keeps tokens exact and leaks nothing."""
    path, prompts, refs = references("mistral")
    opts = dict(device="cpu", dtype="float32", page_size=16, radix_cache=False, chunked_prefill_size=16)
    with LLM(
        str(path), overlap=True, cpu_worker="process", kv_cache_tokens=SMALL_KV, **RETRACT_EAGERLY, **opts
    ) as llm:
        for out, ref in zip(llm.generate(prompts, GREEDY, use_tqdm=False), refs):
            check_greedy(out.token_ids, ref)
        assert llm.engine.stats.retractions > 0 and llm.engine.scheduler.kv.window is not None
        llm.check_integrity()


def test_retraction_and_abort_of_requests_that_freed(references, monkeypatch):
    """A request retracted after freeing resumes from its cached prefix by recomputing (its KV does not
    enter the tree); an aborted one gives everything back; the others are unchanged."""
    path, prompts, refs = references("mistral")
    released: list[int] = []
    real = window_module.WindowKV.has_freed

    def spy(self, row, cached_len):  # noqa: ANN001, ANN202
        freed = real(self, row, cached_len)
        released.append(freed)
        return freed

    monkeypatch.setattr(window_module.WindowKV, "has_freed", spy)
    opts = dict(device="cpu", dtype="float32", page_size=1, overlap=False, kv_cache_tokens=4096)
    with LLM(str(path), **opts) as llm:
        eng = llm.engine
        poisoned = poison_freed(eng.runner)
        reqs = [eng.add_request(p, GREEDY) for p in prompts]
        victim, target = reqs[0], reqs[1]
        for _ in range(200):
            eng.step()
            eng.scheduler.kv.check_live([r for r in reqs if r.row is not None])
            if victim.row is not None and real(eng.scheduler.kv.window, victim.row, victim.cached_len):
                break
        eng.scheduler.decode_planner._retract(victim)  # as decode does when the pool runs dry
        eng.abort(target.rid)
        while eng.has_unfinished():
            eng.step()
            eng.scheduler.kv.check_live([r for r in reqs if r.row is not None])
        assert target.finish_reason == "abort"
        for req, ref in zip(reqs, refs):
            if req is not target:
                check_greedy(req.output_ids, ref)
        assert eng.stats.retractions == 1 and poisoned[0] > 0
        assert any(released), "no request released after freeing"
        llm.check_integrity()


def _peak_usage(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[int, int]:
    """(most KV tokens requests held at once, most requests running at once) over a greedy run."""
    eng = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for p in prompts:
        eng.add_request(p, params)
    used = running = 0
    while eng.has_unfinished():
        eng.step()
        used = max(used, eng.scheduler.kv.usage()["kv_used_tokens"])
        running = max(running, len(eng.scheduler.queues.running))
    llm.check_integrity()
    return used, running


@pytest.mark.parametrize("page_size", [1, 16])
def test_long_generation_holds_about_a_window(ckpt_factory, page_size):
    path = ckpt_factory("mistral", sliding_window=WINDOW)
    with LLM(str(path), device="cpu", dtype="float32", page_size=page_size, kv_cache_tokens=4096) as llm:
        used, _ = _peak_usage(llm, [list(range(3, 13))], max_tokens=200)
    # 210 tokens without freeing; with it the window plus the pages it straddles
    assert used <= WINDOW + 2 * page_size + page_size, used


def test_more_long_requests_fit_before_retraction(ckpt_factory, monkeypatch):
    """8 requests of 8 + 100 tokens in a 256-token pool: freed behind the window, all run at once and none
    is retracted; kept whole (freeing turned off), the same workload retracts."""
    path = str(ckpt_factory("mistral", sliding_window=WINDOW))
    prompts = [[3 + i] * 8 for i in range(8)]
    opts = dict(device="cpu", dtype="float32", page_size=1, kv_cache_tokens=256, max_running_requests=8)
    with LLM(path, **opts) as llm:
        _, running = _peak_usage(llm, prompts, max_tokens=100)
        assert llm.engine.stats.retractions == 0 and running == 8
    monkeypatch.setattr("gapless.engine.scheduler.freeing_window", lambda *a: None)
    with LLM(path, **opts) as llm:
        assert llm.engine.scheduler.kv.window is None
        _peak_usage(llm, prompts, max_tokens=100)
        assert llm.engine.stats.retractions > 0


def test_only_models_whose_every_layer_slides_free(ckpt_factory):
    assert freeing_window(24, (True, True), speculative=False) == 24
    assert freeing_window(24, (True, False), speculative=False) is None  # Gemma 2: a global layer
    assert freeing_window(None, (), speculative=False) is None
    assert freeing_window(24, (True, True), speculative=True) is None
    with LLM(str(ckpt_factory("gemma2")), device="cpu", kv_cache_tokens=1024) as llm:
        assert llm.engine.scheduler.kv.window is None


@pytest.mark.parametrize("page_size", [1, 4])
def test_plan_frees_whole_own_pages_below_the_window(page_size):
    """Host bookkeeping alone: a request with a 4-token cached prefix decoding at position 29 under a
    window of 8 frees its own pages wholly below position 22, once, and points them at slot 0."""
    ps = page_size
    alloc = PageAllocator(64, ps)
    table = np.zeros((2, 64), dtype=np.int64)
    table[1, :32] = alloc.page_slots(alloc.alloc(32 // ps)).numpy()
    win = WindowKV(8, alloc, table)
    win.admit(1, 4)
    free_before = alloc.num_free_pages
    plan = win.plan(np.array([1]), np.array([29]))
    assert plan is not None
    dead = 22 // ps * ps
    assert plan.page_pos.tolist() == list(range(4, dead, ps))
    rows, positions, slots = win.free(plan)
    assert alloc.num_free_pages == free_before + (dead - 4) // ps
    assert positions.tolist() == list(range(4, dead)) and not slots.any() and set(rows.tolist()) == {1}
    assert not table[1, 4:dead].any() and table[1, :4].all() and table[1, dead:32].all()
    assert win.has_freed(1, 4) and win.plan(np.array([1]), np.array([29])) is None
    with pytest.raises(RuntimeError):
        win.shared(1, 4, 8)  # a prompt chunk cached after decode freed: a bug
    assert table[1, dead:32].tolist() == list(range(ps + dead, ps + 32))  # pages 1.. in order


def test_triton_backend_never_reads_freed_slots(ckpt_factory):
    """The Triton kernels (under the interpreter without a GPU; slow there, so one run) with decode
    through the graph runner's static buffers, whose attention spans the whole max context: freed slots
    poisoned with NaN, greedy tokens still transformers'."""
    pytest.importorskip("triton", reason="triton is not installed (or does not import here)")
    from gapless.attention import triton_kernels as tk
    from gapless.testing.hf_reference import hf_greedy, load_hf_model

    if not torch.cuda.is_available() and not tk.INTERPRET:
        pytest.fail("triton_kernels was imported before TRITON_INTERPRET was set (tests/conftest.py sets it)")
    path = ckpt_factory("mistral", sliding_window=WINDOW)
    hf = load_hf_model(path)
    prompts = [list(range(40, 54)), [5, 6, 7]]
    refs = [hf_greedy(hf, p, 16) for p in prompts]
    with LLM(
        str(path),
        device="cuda" if torch.cuda.is_available() else "cpu",
        dtype="float32",
        attention_backend="triton",
        page_size=4,
        kv_cache_tokens=256,
        overlap=False,
        cuda_graph_max_bs=2,
    ) as llm:
        poisoned = poison_freed(llm.engine.runner)
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        for out, ref in zip(llm.generate(prompts, params, use_tqdm=False), refs, strict=True):
            check_greedy(out.token_ids, ref)
        assert poisoned[0] > 0
        assert llm.engine.runner.graphs.runs[2] > 0
        llm.check_integrity()
