"""The memory bound of prompt logprobs: an 8k-token prompt with `prompt_logprobs=20` on a random checkpoint
with Qwen's 151,936-token vocabulary needs at most `SCRATCH_BOUND` more memory than generating from the same
prompt (measured as the process's peak resident memory, in a fresh process, and printed), where its whole
float32 logits would be 8,192 x 151,936 x 4 bytes = 4.6 GiB."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from gapless.testing import cached_checkpoint

PROMPT_TOKENS = 8192
VOCAB = 151936
TOP_K = 20
# the README's bound: a piece's float32 logits and their log-softmax (40 MiB each), the rank mask (10 MiB),
# and for a half-precision model the logits before their float cast (20 MiB)
SCRATCH_BOUND = 128 << 20
# the answer itself, on the host: per scored position its logprob, rank and 20 (id, logprob) pairs
RESULT_BYTES_PER_POSITION = 150 * TOP_K

SCRIPT = textwrap.dedent(
    """
    import json, random, resource, sys
    import torch
    from gapless import LLM, SamplingParams

    torch.set_num_threads(1)
    path, n, k = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    prompt = [random.Random(0).randrange(3, 151000) for _ in range(n)]
    with LLM(path, device="cpu", dtype="float32", kv_cache_tokens=n + 64, chunked_prefill_size=2048,
             radix_cache=False, overlap=False) as llm:
        eng = llm.engine

        def run(params):
            req = eng.add_request(prompt, params)
            while eng.has_unfinished():
                eng.step()
            return req

        run(SamplingParams(max_tokens=1))
        before = peak()
        req = run(SamplingParams(max_tokens=1, prompt_logprobs=k))
        after = peak()
    print(json.dumps({"before": before, "after": after, "scored": len(req.prompt_lp.values)}))
    """
)


@pytest.mark.slow
def test_8k_prompt_logprobs_stay_within_the_bound():
    # the smallest shape that still is a model: the time goes to the 8k x 152k logits, not to the layers.
    # Kept in gapless's cache: its 151,936-entry tokenizer takes a while to build, once per machine
    path = cached_checkpoint(
        "llama",
        vocab_size=VOCAB,
        max_position_embeddings=2 * PROMPT_TOKENS,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=16,
        rope_scaling=None,
    )
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(path), str(PROMPT_TOKENS), str(TOP_K)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["scored"] == PROMPT_TOKENS - 1
    extra = got["after"] - got["before"]
    results = RESULT_BYTES_PER_POSITION * PROMPT_TOKENS
    print(
        f"\nprompt_logprobs={TOP_K} over {PROMPT_TOKENS} tokens, vocab {VOCAB}: "
        f"peak RSS +{extra / 2**20:.1f} MiB "
        f"over the same prompt unscored (bound {SCRATCH_BOUND / 2**20:.0f} MiB of scratch + "
        f"{results / 2**20:.1f} MiB of results; whole float32 logits would be "
        f"{PROMPT_TOKENS * VOCAB * 4 / 2**30:.1f} GiB)"
    )
    assert extra <= SCRATCH_BOUND + results
