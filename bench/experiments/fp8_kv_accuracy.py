"""Greedy agreement of an fp8 (e4m3) KV cache with a float32 reference, against bf16's, on a tiny model.

    PYTHONPATH=. python bench/experiments/fp8_kv_accuracy.py [--arch qwen3] [--prompts 8] [--tokens 12]

transformers' float32 greedy continuation of each prompt (`make_prompts`, seed 1) is the reference; gapless
runs the same checkpoint with float32 weights and KV, bf16 weights and KV, and fp8 KV under float32 and
bf16 weights (torch backend, CPU). For each it prints how many prompts diverge, and for each divergence
its step and how far the token chosen is below the reference's top logit (a near-tie when small). Also
the median top-2 gap of the reference's logits, the scale those gaps are to be read against.
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from gapless import LLM, SamplingParams
from gapless.testing import make_checkpoint
from gapless.testing.hf_reference import hf_greedy, load_hf_model, make_prompts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="qwen3")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=12)
    args = p.parse_args()
    path = make_checkpoint(tempfile.mkdtemp(), args.arch)
    hf = load_hf_model(path)
    prompts = make_prompts(hf.config.vocab_size, n=args.prompts, seed=1, max_len=60, shared_prefix=20)
    refs = [hf_greedy(hf, q, args.tokens) for q in prompts]
    gaps = torch.cat([r.logits.topk(2, dim=-1).values.diff(dim=-1).abs().flatten() for r in refs])
    print(
        f"{args.arch} tiny, {len(prompts)} prompts x {args.tokens} greedy tokens against transformers "
        f"float32; the reference's median top-2 logit gap {float(gaps.median()):.3f}"
    )
    greedy = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    for dtype, kv in (("float32", "auto"), ("bfloat16", "auto"), ("float32", "fp8"), ("bfloat16", "fp8")):
        opts = dict(device="cpu", dtype=dtype, kv_cache_tokens=2048, overlap=False, attention_backend="torch")
        with LLM(str(path), kv_cache_dtype=kv, **opts) as llm:
            outs = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        diverged = []
        for out, ref in zip(outs, refs):
            i = next((i for i, (a, b) in enumerate(zip(out, ref.tokens)) if a != b), None)
            if i is not None:
                diverged.append((i, round(float(ref.logits[i].max() - ref.logits[i][out[i]]), 3)))
        below = f"(step, below top): {diverged}"
        print(f"weights {dtype}, KV {kv}: {len(diverged)} of {len(prompts)} diverge; {below}")


if __name__ == "__main__":
    main()
