"""Greedy speculative decoding gives exactly the tokens decoding without it gives: every family against
transformers over the parity matrix's corners, and a model whose drafts are mostly right for the runs
themselves (EOS, stop strings and max_tokens inside an accepted run, chaos, aborts, retraction); no KV
leaked or freed twice (the integrity check after each workload)."""

from __future__ import annotations

import random
import warnings

import pytest

from gapless import LLM, SamplingParams
from gapless.default_model.tokenizer import build_tokenizer
from gapless.testing import ARCHS
from gapless.testing.hf_reference import check_greedy, greedy_references, make_prompts

from .conftest import ids

MAX_NEW = 20
SPEC = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 4}
LOOPS = {"plain": {"overlap": False}, "overlap": {"overlap": True, "cpu_worker": "thread"}}
RETRACT_EAGERLY = {"init_new_token_ratio": 0.02, "min_new_token_ratio": 0.02}
# families whose random-weight model never continues a prompt with one of its own n-grams, so every draft
# is rejected (verification still runs, its first token checked): accepted runs are exercised by the other
# families and by the scripted cyclic model
NEVER_ECHOES = {"gemma3_text"}
# (page_size, radix, chunked_prefill_size, kv_cache_tokens): every option off-default, then at default
CORNERS = {"p1-radix-chunk16-smallkv": (1, True, 16, 192), "p16-noradix-chunk2048": (16, False, 2048, 8192)}


def _prompts(vocab: int) -> list[list[int]]:
    """The parity prompts, and prompts that repeat themselves (where n-gram drafts get accepted)."""
    rng = random.Random(1)
    loops = [[rng.randrange(3, vocab) for _ in range(n)] * r for n, r in ((3, 6), (7, 4), (12, 3))]
    return make_prompts(vocab, n=8) + loops


@pytest.fixture(scope="module")
def references(ckpt_factory):
    return greedy_references(ckpt_factory, _prompts, MAX_NEW)


# each family runs one corner in one loop; together they run both corners in both loops, twice
MATRIX = [(arch, list(CORNERS)[i % 2], list(LOOPS)[i // 2 % 2]) for i, arch in enumerate(ARCHS)]


@pytest.mark.parametrize(("arch", "corner", "loop"), MATRIX)
def test_greedy_parity_with_speculation(references, arch, corner, loop):
    stats = _check_parity(references, arch, corner, loop, SPEC)
    if arch not in NEVER_ECHOES:
        assert stats["spec_accepted_tokens"] > 0, "no draft was accepted: the runs were not exercised"


# a draft model: the target itself (its drafts are right: runs accepted) or a random model of another
# family with the same tokenizer (its drafts are wrong: the target's own token every step); each family
# once, together every draft in both corners and both loops
DRAFT_MATRIX = [
    (arch, list(CORNERS)[i // 2 % 2], list(LOOPS)[i % 2], ("self", "other")[i // 4 % 2])
    for i, arch in enumerate(ARCHS)
]


@pytest.mark.parametrize(("arch", "corner", "loop", "draft"), DRAFT_MATRIX)
def test_greedy_parity_with_a_draft_model(references, ckpt_factory, arch, corner, loop, draft):
    path = references(arch)[0]
    other = ckpt_factory("llama", seed=7, num_hidden_layers=1)
    spec = {
        **SPEC,
        "speculative_algorithm": "draft",
        "speculative_draft_model": str(path if draft == "self" else other),
    }
    stats = _check_parity(references, arch, corner, loop, spec)
    if draft == "self":
        assert stats["spec_acceptance_rate"] >= 0.9, stats


def _check_parity(references, arch: str, corner: str, loop: str, spec: dict) -> dict:
    """Run the parity prompts on `arch` in `corner` and `loop` with speculation `spec`: the tokens of
    transformers' greedy decoding (up to near-ties), verification exercised, retraction forced in the small
    pool, no KV leaked. Returns the engine's stats."""
    path, prompts, refs = references(arch)
    page, radix, chunk, kv = CORNERS[corner]
    with LLM(
        path,
        device="cpu",
        page_size=page,
        radix_cache=radix,
        chunked_prefill_size=chunk,
        kv_cache_tokens=kv,
        **RETRACT_EAGERLY if kv < 1000 else {},
        **LOOPS[loop],
        **spec,
    ) as llm:
        outs = llm.generate(
            prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True), use_tqdm=False
        )
        for i, (out, ref) in enumerate(zip(outs, refs)):
            note = check_greedy(out.token_ids, ref)
            if note:
                warnings.warn(f"{arch} prompt {i}: {note}", stacklevel=1)
        stats = llm.get_stats()
        assert stats["spec_drafted_tokens"] > 0, "nothing was drafted: verification was not exercised"
        if kv < 1000:
            assert stats["retractions"] > 0, "the small KV pool was meant to force retraction"
        llm.check_integrity()
        return stats


def _run(path: str, prompts, params, **options) -> tuple[list, dict]:
    with LLM(path, device="cpu", kv_cache_tokens=4096, **options) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        llm.check_integrity()
        return [(o.token_ids, o.text, o.finish_reason) for o in outs], llm.get_stats()


CYCLIC_PROMPTS = {
    "cycle": "xabcdeab",  # continues c d e a b ...: drafts after the first lap are all right
    "eos_inside_run": "fghij" + "\n" + "f",  # drafts g h i j \n: the target says EOS where \n was drafted
    "short": "b",
}


def _spec(algorithm: str, model: str) -> dict:
    """SPEC with `algorithm`; with "draft", the draft model is `model` itself (its drafts are right)."""
    return (
        SPEC
        if algorithm == "ngram"
        else {**SPEC, "speculative_algorithm": "draft", "speculative_draft_model": model}
    )


@pytest.mark.parametrize("algorithm", ["ngram", "draft"])
@pytest.mark.parametrize("loop", LOOPS)
def test_stops_inside_an_accepted_run(cyclic, loop, algorithm):
    """EOS, a stop string and max_tokens land inside runs of accepted drafts (n-gram lookups, or the model
    drafting for itself): the output stops exactly where decoding without speculation stops, and the rest
    of the run is dropped."""
    eos = build_tokenizer().eos_token_id
    prompts = [ids(p) for p in CYCLIC_PROMPTS.values()]
    prompts[1] = ids("fghij") + [eos] + ids("f")  # the drafts after f: g h i j EOS
    params = [
        SamplingParams(max_tokens=13, temperature=0.0),  # max_tokens mid-run
        SamplingParams(max_tokens=30, temperature=0.0),  # EOS mid-run
        SamplingParams(max_tokens=30, temperature=0.0, stop=["ea"]),  # a stop string across two drafts
    ]
    plain, _ = _run(cyclic, prompts, params, **LOOPS[loop])
    spec, stats = _run(cyclic, prompts, params, **LOOPS[loop], **_spec(algorithm, cyclic))
    assert spec == plain
    assert [p[2] for p in plain] == ["length", "stop", "stop"]
    assert plain[1][0][-1] == eos and len(plain[1][0]) == 5
    assert stats["spec_accepted_tokens"] >= 10
    assert stats["spec_mean_accepted_length"] > 2


# (seed, speculative_algorithm, cuda_graph_max_bs: verifies through the graph runner's padded buffers)
CHAOS = [(0, "ngram", 0), (1, "ngram", 0), (2, "ngram", 4), (0, "draft", 4)]
GUIDED = {2: "(cdeaq){20}", 5: "[a-e]{50}"}  # requests under a regex, drafting n-grams under it


@pytest.mark.parametrize(("chaos_seed", "algorithm", "graphs"), CHAOS)
def test_chaos_aborts_and_retraction(cyclic, chaos_seed, algorithm, graphs):
    """Overlap with seeded random delays on both sides and the future-slot check on verify batches, a
    small pool that forces retraction, requests aborted while their verify batches are in flight, and
    (with n-gram drafts) two under a grammar: the others' tokens are those of plain decoding, and no KV is
    leaked or freed twice."""
    rng = random.Random(chaos_seed)
    prompts = [ids("x" + "".join(rng.choice("abcdeq") for _ in range(rng.randint(1, 30)))) for _ in range(8)]
    # (under a draft model, whose grammar requests draft nothing, none is guided: the test watches verifies)
    guided = GUIDED if algorithm == "ngram" else {}
    params = [
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, regex=guided.get(i)) for i in range(8)
    ]
    reference, _ = _run(cyclic, prompts, params, overlap=False)
    options = dict(
        overlap=True,
        cpu_worker="thread",
        chaos_seed=chaos_seed,
        chunked_prefill_size=16,
        cuda_graph_max_bs=graphs,
        **_spec(algorithm, cyclic),
    )
    with LLM(cyclic, device="cpu", kv_cache_tokens=160, **RETRACT_EAGERLY, **options) as llm:
        eng = llm.engine
        sched, overlapped = eng.scheduler, []
        process = sched._process_oldest

        def watched():  # a verify processed while the next one is already launched: nothing waited
            overlapped.append(
                len(sched.inflight) == 2 and all(b.drafts is not None for b, _ in sched.inflight)
            )
            return process()

        sched._process_oldest = watched
        reqs = [eng.add_request(p, q) for p, q in zip(prompts, params)]
        aborted = {reqs[1].rid, reqs[4].rid}
        for step in range(2000):
            if not eng.has_unfinished():
                break
            eng.step()
            if step == 3 + chaos_seed:
                eng.abort(reqs[1].rid)  # early: waiting or prefilling
            if reqs[4].inflight and len(reqs[4].output_ids) > 6:
                eng.abort(reqs[4].rid)  # a verify of it in flight
        assert not eng.has_unfinished()
        for req, ref in zip(reqs, reference):
            if req.rid in aborted:
                assert req.finish_reason == "abort"
            else:
                assert (req.output_ids, req.finish_reason) == (ref[0], ref[2])
        assert eng.stats.retractions > 0
        assert eng.stats.spec_accepted_tokens > 0
        assert sum(overlapped) > 10, "verify N+1 should be launched before verify N is processed"
        if graphs:
            assert sum(eng.runner.graphs.verify_runs.values()) > 0, "no verify ran through the graph runner"
        llm.check_integrity()
