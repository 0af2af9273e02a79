"""Tensor parallelism offline: `LLM(..., tensor_parallel_size=2)` on the CPU (gloo), one process per rank.

Greedy output equals transformers' for every family of the parity matrix (`tests/engine/test_parity.py`),
each in one of two corners of the engine's options (overlap on, small chunks, a KV pool small enough to
force retraction; or overlap off, page 16, one chunk), Mistral's single KV head replicated over both ranks.
Seeded sampling gives the tokens one rank gives; with n-gram or draft-model speculation on, greedy output
is unchanged. A rank that dies or hangs ends the engine with an error
naming it, and no process is left.
"""

from __future__ import annotations

import os
import signal
import time
import warnings

import pytest
import torch

from gapless import LLM, SamplingParams
from gapless.engine.tp.ranks import RankFailed
from gapless.model import parallel
from gapless.testing import ARCHS
from gapless.testing.hf_reference import check_greedy, greedy_references, make_prompts
from gapless.testing.server import alive, descendants, wait_until

MAX_NEW = 12
SMALL_KV = 160  # < the six prompts' peak need, > any one request (90 + 12 tokens): forces retraction
CORNERS = {
    "overlap+retract": dict(
        overlap=True,
        page_size=1,
        chunked_prefill_size=16,
        kv_cache_tokens=SMALL_KV,
        init_new_token_ratio=0.02,
        min_new_token_ratio=0.02,
    ),
    "plain": dict(overlap=False, page_size=16, chunked_prefill_size=2048, kv_cache_tokens=4096),
}
# each family in one corner, alternating down ARCHS: both corners see dense and mixture-of-experts models
COMBOS = [(arch, list(CORNERS)[i % 2]) for i, arch in enumerate(ARCHS)]
SEEDED = ("qwen3", "mixtral")  # also compare seeded sampling with one rank's
# families that also speculate (the greedy output must not change): n-gram drafts, and the model drafting
# for itself (its draft sharded like the target, with its own KV pool slice per rank)
SPECULATING = {"llama": "ngram", "mistral": "draft"}


def _speculation(arch: str, path: object) -> dict[str, object]:
    algo = SPECULATING.get(arch)
    if algo is None:
        return {}
    draft = {"speculative_draft_model": str(path)} if algo == "draft" else {}
    return {"speculative_algorithm": algo, **draft}


def _prompts(vocab: int) -> list[list[int]]:
    return make_prompts(vocab, n=6)


@pytest.fixture(scope="module")
def references(ckpt_factory):
    return greedy_references(ckpt_factory, _prompts, MAX_NEW)


def _sampled(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float] | None]]:
    """Seeded samples with logprobs, and a regex-constrained one (its mask is part of the broadcast job)."""
    params = [
        SamplingParams(max_tokens=MAX_NEW, temperature=1.0, top_p=0.9, seed=i, ignore_eos=True, logprobs=1)
        for i in range(len(prompts))
    ]
    params[0] = SamplingParams(max_tokens=MAX_NEW, temperature=1.0, seed=0, regex="[ab]{3,8}")
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert 3 <= len(outs[0].text) <= 8 and set(outs[0].text) <= {"a", "b"}, outs[0].text
    return [(o.token_ids, o.logprobs and [round(x, 3) for x in o.logprobs]) for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "corner"), COMBOS)
def test_two_ranks_give_transformers_greedy_output(references, arch, corner):
    path, prompts, refs = references(arch)
    before = descendants(os.getpid())
    options = dict(device="cpu", dtype="float32", max_running_requests=64, **CORNERS[corner])
    with LLM(str(path), tensor_parallel_size=2, **options, **_speculation(arch, path)) as llm:
        assert len(descendants(os.getpid()) - before) == 2  # one process per rank
        info = llm.engine.info  # (each rank's share of the weights and of the heads' KV, said so)
        assert info.kv_cache.endswith(" B/token on each of 2 ranks"), info.kv_cache
        assert info.weights.startswith("weights: ") and " MB on each of 2 ranks (" in info.weights, info
        greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
        for i, (out, ref) in enumerate(zip(llm.generate(prompts, greedy, use_tqdm=False), refs)):
            if note := check_greedy(out.token_ids, ref):
                warnings.warn(f"{arch} prompt {i}: {note}", stacklevel=1)
        if arch in SPECULATING:
            assert llm.get_stats()["spec_drafted_tokens"] > 0, "speculation was meant to draft"
        if corner == "overlap+retract":
            assert llm.engine.stats.retractions > 0, "the small KV pool was meant to force retraction"
        llm.check_integrity()
        if arch in SEEDED:
            sampled = _sampled(llm, prompts)
    if arch in SEEDED:
        with LLM(str(path), **options) as one:
            assert sampled == _sampled(one, prompts)
    assert wait_until(lambda: not (descendants(os.getpid()) - before), 10), "a rank outlived the engine"


def _rank_pids(before: set[int]) -> list[int]:
    """The new rank processes, in start order (rank 0 first)."""
    return sorted(descendants(os.getpid()) - before)


@pytest.mark.slow
@pytest.mark.parametrize(("fault", "rank"), [("killed", 0), ("killed", 1), ("hung", 1)])
def test_a_rank_that_dies_or_hangs_ends_the_engine_naming_it(ckpt_factory, fault, rank):
    before = descendants(os.getpid())
    llm = LLM(
        str(ckpt_factory("qwen3")), device="cpu", kv_cache_tokens=1024, tensor_parallel_size=2, dist_timeout=3
    )
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    assert llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].finish_reason == "length"
    ranks = _rank_pids(before)
    os.kill(ranks[rank], signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
    start = time.monotonic()
    try:
        with pytest.raises(RankFailed) as e:
            llm.generate([[5, 6, 7]], params, use_tqdm=False)
        if fault == "killed":
            assert f"tensor-parallel rank {rank} died (exit code -9)" in str(e.value)
        else:  # rank 0's collective timed out (dist_timeout=3): the hung rank is named
            assert f"tensor-parallel rank {rank} stopped answering" in str(e.value), e.value
        assert time.monotonic() - start < 30
    finally:
        llm.shutdown()  # kills what is left, the stopped rank included
    assert wait_until(lambda: not any(alive(p) for p in ranks), 15), "a rank outlived the engine"


@pytest.mark.slow
def test_a_checkpoint_the_ranks_refuse_as_they_load_is_a_refusal_naming_it(ckpt_factory, tmp_path):
    """A tensor its layout cannot hold (a packed AWQ weight stored as floats) is refused by every rank's
    loader; whichever rank reports first, the engine raises a ValueError with the loader's message (what
    `gapless serve` prints as its one line, status 2), not a rank's traceback, and no rank is left."""
    from safetensors.torch import load_file, save_file

    from gapless.testing.quant_checkpoints import write_quantized

    qdir, _ = write_quantized(ckpt_factory("qwen3"), tmp_path, "awq", group=32)
    tensors = load_file(str(qdir / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.qweight"
    tensors[name] = tensors[name].float()
    save_file(tensors, str(qdir / "model.safetensors"), metadata={"format": "pt"})
    before = descendants(os.getpid())
    with pytest.raises(ValueError, match=rf"^{name}: float32 \[.*int32 words"):
        LLM(str(qdir), device="cpu", kv_cache_tokens=1024, tensor_parallel_size=2)
    assert wait_until(lambda: not (descendants(os.getpid()) - before), 15), "a rank outlived the refusal"


def test_a_ranks_value_error_is_told_as_a_refusal_and_any_other_as_its_failure():
    """What a rank sends as its error: a ValueError (its loader refused the checkpoint) becomes a
    `RankRefused`, itself a ValueError with the message alone (the server's one line); anything else a
    `RankFailed` naming the rank."""
    import pickle
    from multiprocessing import Pipe

    from gapless.engine.tp.ranks import LocalRanks, RankRefused

    ranks = LocalRanks.__new__(LocalRanks)  # (no process: the pipe stands in for rank 1's)
    ranks.ranks, ranks.procs, ends = range(2), [], [Pipe(), Pipe()]
    ranks.conns = [ours for ours, _ in ends]
    ends[1][1].send_bytes(pickle.dumps(("error", ValueError("model.layers.0.mlp: bad"), "traceback")))
    refused = ranks.failure(1)
    assert isinstance(refused, RankRefused) and isinstance(refused, ValueError)
    assert str(refused) == "model.layers.0.mlp: bad"
    ends[1][1].send_bytes(pickle.dumps(("error", RuntimeError("CUDA error"), "traceback")))
    failed = ranks.failure(1)
    assert (
        type(failed) is RankFailed
        and str(failed) == "tensor-parallel rank 1 failed: RuntimeError('CUDA error')"
    )


def test_a_model_that_does_not_split_is_refused_before_any_rank_starts(ckpt_factory):
    before = descendants(os.getpid())
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by it"):
        LLM(str(ckpt_factory("qwen3")), device="cpu", tensor_parallel_size=3)
    assert descendants(os.getpid()) <= before


def test_a_single_rank_gloo_group_runs_every_collective():
    """The group's own calls, on one rank (CPU): what the layers and the job broadcast use."""
    store = parallel.serve_store("127.0.0.1:0", 10.0)
    group = parallel.connect(f"127.0.0.1:{store.port}", 0, 1, 10.0, torch.device("cpu"))
    _check_collectives(group, torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_single_rank_nccl_group_runs_every_collective():
    """A rank joins with its own GPU, indexed, as `tp.worker.rank_config` gives it (`cuda:LOCAL_RANK`):
    `torch.cuda.set_device` refuses a device without an index."""
    store = parallel.serve_store("127.0.0.1:0", 10.0)
    group = parallel.connect(f"127.0.0.1:{store.port}", 0, 1, 10.0, torch.device("cuda", 0))
    assert group.pg.name() == "nccl"
    _check_collectives(group, torch.device("cuda"))


def _check_collectives(group: parallel.TPGroup, device: torch.device) -> None:
    """Each call the layers and the job broadcast make, on the group's own process groups."""
    x = torch.arange(6, dtype=torch.float32, device=device)
    group.pg.allreduce([x]).wait()
    out = [torch.empty_like(x)]
    group.pg.allgather([out], [x]).wait()
    assert x.tolist() == out[0].tolist() == [0, 1, 2, 3, 4, 5]
    assert group.min_over_ranks(7) == 7 and group.broadcast_bytes(b"job") == b"job"
    assert group.host_pg.size() == group.pg.size() == 1
