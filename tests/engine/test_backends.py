"""The whole engine on the Triton attention backend: greedy tokens equal transformers'.

Without a GPU the kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET before
anything imports Triton), which is slow: two architectures (GQA with q/k norm, and MQA), three short
prompts and then one more, a few tokens. Paged KV (page_size 4), chunked prefill and a radix-cache hit
put prefixes in front of extends. One architecture decodes eagerly, the other through the graph runner's
padded static buffers (batch 3 in bucket 4, attention over the whole max context with a fixed split
count), which runs the decode kernel as a CUDA graph does.
"""

from __future__ import annotations

import pytest
import torch

from gapless import LLM, SamplingParams
from gapless.testing.hf_reference import check_greedy, hf_greedy, load_hf_model
from gapless.testing.triton import import_kernels_or_skip

tk = import_kernels_or_skip("gapless.attention.triton_kernels")

from gapless.attention.triton_backend import TritonBackend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MAX_NEW = 6
PREFIX = list(range(40, 52))
PROMPTS = [PREFIX + [7, 8, 9], [5, 6, 7, 8, 9], [3] * 9]
LATER = PREFIX + list(range(60, 80))  # run after the first three: its prefix comes from the radix cache


# qwen3: GQA, q/k norm, head_dim != hidden / heads; mistral: MQA; gemma2: a 24-token window on layer 0
# (LATER and its decode run past it; chunks of 16 cross its edge; its radix prefix ends inside it) and
# soft-capped scores
@pytest.mark.parametrize(("arch", "graph_bs"), [("qwen3", 0), ("mistral", 4), ("gemma2", 4)])
def test_triton_backend_greedy_parity(ckpt_factory, arch, graph_bs):
    path = ckpt_factory(arch)
    hf = load_hf_model(path)
    refs = [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS + [LATER]]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    with LLM(
        str(path),
        device=DEVICE,
        dtype="float32",
        attention_backend="triton",
        page_size=4,
        chunked_prefill_size=16,
        kv_cache_tokens=512,
        overlap=False,
        cuda_graph_max_bs=graph_bs,
    ) as llm:
        runner = llm.engine.runner
        assert isinstance(runner.backend, TritonBackend)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        outs += llm.generate([LATER], params, use_tqdm=False)
        for out, ref in zip(outs, refs, strict=True):
            check_greedy(out.token_ids, ref)
        assert llm.engine.stats.cached_prompt_tokens > 0, "the shared prefix should come from the radix cache"
        if graph_bs:
            assert runner.graphs is not None and runner.graphs.runs[4] > 0 and runner.graphs.padded_rows > 0
        llm.check_integrity()
