"""Greedy output equals transformers' greedy continuation, token for token, across the engine's options.

Every architecture × page_size {1, 16} × radix cache on/off × small/large chunked prefill × a KV pool
large enough vs small enough to force retraction (two corners of that for the families in `REDUCED`; for
those in `SLOW_REST` the rest of the matrix runs in the slow tier).
A divergence is accepted only at a near-tie of the reference's top-2 logits, and the test says so.
"""

from __future__ import annotations

import itertools
import warnings

import pytest

from gapless import LLM, SamplingParams
from gapless.testing import ARCHS
from gapless.testing.hf_reference import check_greedy, greedy_references, make_prompts

MAX_NEW = 24
SMALL_KV = 192  # < the workload's peak need, > any single request (90 + 24 tokens): forces retraction
# admit optimistically (reserve almost nothing for future decode tokens): decode runs out of KV, retracts
RETRACT_EAGERLY = {"init_new_token_ratio": 0.02, "min_new_token_ratio": 0.02}


@pytest.fixture(scope="module")
def references(ckpt_factory):
    return greedy_references(ckpt_factory, make_prompts, MAX_NEW)


# Families whose difference is inside the layer (fused weights, norms, multipliers, Gemma 3's RoPE bases
# and q/k norms on Gemma 2's window, the mixtures of experts) and not in what the engine's options touch
# (paging, prefix reuse, chunking, retraction) run two corners of the matrix, to keep the suite's time in
# check: every option off-default in one, every one at its default in the other. The rest, Gemma 2's
# sliding window among them, run all of it.
# Of the rest, Llama (plain attention) and Gemma 2 (window, soft-capping) run all of it in `make test`;
# Qwen2, Qwen3 and Mistral their corners there and the rest of the matrix in the slow tier (CI runs both).
REDUCED = ("phi3", "olmo2", "granite", "gemma3_text", "qwen2_moe", "qwen3_moe", "mixtral", "olmoe")
SLOW_REST = ("qwen2", "qwen3", "mistral")
CORNERS = [(1, True, 16, SMALL_KV), (16, False, 2048, None)]
COMBOS = [
    pytest.param(arch, *combo, marks=[pytest.mark.slow] if arch in SLOW_REST and combo not in CORNERS else [])
    for arch in ARCHS
    for combo in (
        CORNERS
        if arch in REDUCED
        else itertools.product([1, 16], [True, False], [16, 2048], [None, SMALL_KV])
    )
]
# overlap on runs the same scheduler against a device worker thread here (the device process is
# exercised by tests/engine/test_overlap.py: it costs a process start per engine)
LOOPS = {"plain": {"overlap": False}, "overlap": {"overlap": True, "cpu_worker": "thread"}}


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize(("arch", "page_size", "radix", "chunk", "kv"), COMBOS)
def test_greedy_parity(references, arch, page_size, radix, chunk, kv, loop):
    path, prompts, refs = references(arch)
    llm = LLM(
        str(path),
        device="cpu",
        dtype="float32",
        page_size=page_size,
        radix_cache=radix,
        chunked_prefill_size=chunk,
        kv_cache_tokens=kv or 8192,
        max_running_requests=256,
        **RETRACT_EAGERLY if kv == SMALL_KV else {},
        **LOOPS[loop],
    )
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    for i, (out, ref) in enumerate(zip(outs, refs)):
        note = check_greedy(out.token_ids, ref)
        if note:
            warnings.warn(f"{arch} prompt {i}: {note}", stacklevel=1)
        assert out.finish_reason == "length"
    if kv == SMALL_KV:
        assert llm.engine.stats.retractions > 0, "the small KV pool was meant to force retraction"
    llm.check_integrity()
