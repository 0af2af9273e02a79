"""Greedy output equals transformers' greedy continuation, token for token, across the engine's options.

Every architecture × page_size {1, 16} × radix cache on/off × small/large chunked prefill × a KV pool
large enough vs small enough to force retraction (two corners of that for the families in `REDUCED`),
each in the plain and the overlap loop; `make test` runs a part of it (`CASES`), the slow tier the rest.
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
# sliding window among them, run all of it. `make test` runs every family's two corners in both loops and
# Gemma 2's whole matrix (its window meets paging, chunking and retraction) in the plain loop; the rest
# runs in the slow tier, which CI runs too (all of it took ~120 s of `make test`'s 15 minutes on 2 cores).
REDUCED = ("phi3", "olmo2", "granite", "gemma3_text", "qwen2_moe", "qwen3_moe", "mixtral", "olmoe")
CORNERS = [(1, True, 16, SMALL_KV), (16, False, 2048, None)]
COMBOS = [
    (arch, *combo)
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


def _slow(arch: str, combo: tuple, loop: str) -> bool:
    """Whether a case of the matrix runs in the slow tier alone (above)."""
    return combo not in CORNERS and (arch != "gemma2" or loop != "plain")


CASES = [
    pytest.param(arch, *combo, loop, marks=[pytest.mark.slow] if _slow(arch, tuple(combo), loop) else [])
    for arch, *combo in COMBOS
    for loop in LOOPS
]


@pytest.mark.parametrize(("arch", "page_size", "radix", "chunk", "kv", "loop"), CASES)
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
