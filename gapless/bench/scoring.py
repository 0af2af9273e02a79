"""Prompt scoring throughput: gapless's prompt logprobs vs a `transformers` forward pass, same prompts, same
process.

    python -m gapless.bench.scoring            # default CPU workload, a minute or two on 2 cores
    python -m gapless.bench.scoring --quick    # a few seconds, to check that it runs

What an evaluation harness or a reranker asks of an engine: every prompt token's logprob (and its top k),
nothing generated. gapless gets all prompts in one `LLM.generate` call with `prompt_logprobs=k` and
`max_tokens=1` (the one token the last prefill chunk samples anyway: what the server's `echo` with
`max_tokens` 0 runs). transformers gets what a user would write: right-padded batches of
`--hf-batch-size` prompts through the model's forward, then log-softmax, the prompt tokens' logprobs and
the top k, with the [batch, length, vocab] logits in memory. The figure is tokens scored per second (every
prompt position after the first); the two results are compared, and their largest difference printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

from gapless.bench import cli

DEFAULTS = dict(num_seqs=64, min_input=64, max_input=512)
QUICK = dict(num_seqs=4, min_input=8, max_input=32)


def _parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gapless.bench.scoring", description=__doc__.split("\n")[0])
    w = p.add_argument_group("workload (random token prompts, uniform lengths)")
    w.add_argument("--num-seqs", type=cli.positive_int, help=f"prompts (default {DEFAULTS['num_seqs']})")
    w.add_argument("--min-input", type=cli.positive_int, help=f"shortest (default {DEFAULTS['min_input']})")
    w.add_argument("--max-input", type=cli.positive_int, help=f"longest (default {DEFAULTS['max_input']})")
    w.add_argument("--top-k", type=int, default=1, help="top logprobs per position (default 1, as lm-eval)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--quick", action="store_true", help="a few-second smoke run")
    m = cli.add_model_args(p, "bench", ("tiny", "overlap", "bench", "qwen3-0.6b"), "model and machine")
    m.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    m.add_argument("--dtype", default=None, help="default: float32 on the CPU, bfloat16 on CUDA")
    m.add_argument(
        "--hf-batch-size", type=cli.positive_int, default=8, help="transformers' batch (default 8)"
    )
    m.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch threads")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument(
        "--mc",
        action="store_true",
        help="also: the share of prompt tokens a multiple-choice workload computes",
    )
    args = p.parse_args(argv)
    for name, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def run_gapless(path: str, prompts: list[list[int]], k: int, device: str, dtype: str) -> tuple[float, list]:
    """Seconds to score `prompts` (after a warm-up) and each prompt's [(logprob, top ids)] per position."""
    from gapless import LLM, SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k)
    with LLM(path, device=device, dtype=dtype, radix_cache=False) as llm:
        llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
        cli.progress("gapless: scoring")
        t0 = time.perf_counter()
        reqs = [llm.engine.add_request(p, params) for p in prompts]
        while llm.engine.has_unfinished():
            llm.engine.step()
        took = time.perf_counter() - t0
    scores = [[(lp, [t for t, _ in top]) for lp, _, top in r.prompt_lp.values] for r in reqs]
    return took, scores


@torch.inference_mode()
def run_transformers(
    path: str, prompts: list[list[int]], k: int, device: str, dtype: str, batch: int
) -> tuple[float, list]:
    """The same with transformers: padded batches through `forward`, then log-softmax, gather and top k."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model.to(device).eval()  # type: ignore[arg-type]  # transformers' wrapped `to` types as unbound

    def score(group: list[list[int]]) -> list:
        longest = max(map(len, group))
        ids = torch.zeros(len(group), longest, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(group):
            ids[i, : len(p)], mask[i, : len(p)] = torch.tensor(p), 1
        ids, mask = ids.to(device), mask.to(device)
        logprobs = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float().log_softmax(-1)
        token_lp = logprobs.gather(2, ids[:, 1:, None]).squeeze(2).cpu()
        top = logprobs.topk(k, dim=-1).indices.cpu() if k else None
        return [
            [
                (float(token_lp[i, j]), top[i, j].tolist() if top is not None else [])
                for j in range(len(p) - 1)
            ]
            for i, p in enumerate(group)
        ]

    score(prompts[:1])  # warm-up
    cli.progress("transformers: scoring")
    t0 = time.perf_counter()
    out = [s for start in range(0, len(prompts), batch) for s in score(prompts[start : start + batch])]
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def computed_fraction(path: str, vocab: int, questions: int = 8, choices: int = 4, seed: int = 0) -> dict:
    """The share of prompt tokens a multiple-choice workload computes (the rest comes from the radix cache),
    scoring each choice as lm-eval does (a shared question, then the choice): with every prompt position
    scored (`echo`: no position may come from the cache), and with scoring from the choice on (SGLang's
    `logprob_start_len`: the question's KV is reused, up to the position before the first scored one)."""
    import random

    from gapless import LLM, SamplingParams

    rng = random.Random(seed)
    tok = lambda: rng.randrange(3, vocab)  # noqa: E731
    work = []
    for _ in range(questions):
        context = [tok() for _ in range(rng.randint(96, 192))]
        work += [(context, [tok() for _ in range(rng.randint(2, 8))]) for _ in range(choices)]
    out = {}
    total = sum(len(c) + len(x) for c, x in work)
    for name, start in (("score every position (echo)", lambda c: 0), ("score from the choice on", len)):
        cached = 0
        with LLM(path, device="cpu", dtype="float32", page_size=1) as llm:
            for c, x in work:  # one at a time, as a harness with batch size 1 sends them
                params = SamplingParams(max_tokens=1, prompt_logprobs=1, prompt_logprobs_start=start(c))
                cached += llm.generate([c + x], params, use_tqdm=False)[0].cached_tokens
        out[name] = 1 - cached / total
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parse_args(argv)
    torch.set_num_threads(args.threads)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    path, _ = cli.model_path(args)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    from gapless.bench.workload import random_workload

    work = random_workload(
        args.num_seqs, args.min_input, args.max_input, 1, 1, vocab_size=vocab, seed=args.seed
    )
    prompts = work.prompts
    scored = sum(len(p) - 1 for p in prompts)
    ours_s, ours = run_gapless(str(path), prompts, args.top_k, device, dtype)
    hf_s, ref = run_transformers(str(path), prompts, args.top_k, device, dtype, args.hf_batch_size)
    diff = max(abs(a[0] - b[0]) for o, r in zip(ours, ref) for a, b in zip(o, r))
    same_top = sum(a[1] == b[1] for o, r in zip(ours, ref) for a, b in zip(o, r)) / scored
    result: dict[str, Any] = {
        "command": cli.command_line("gapless.bench.scoring", argv),
        "device": device,
        "dtype": dtype,
        "model": str(path),
        "prompts": len(prompts),
        "tokens_scored": scored,
        "top_k": args.top_k,
        "gapless_s": ours_s,
        "transformers_s": hf_s,
        "gapless_tok_s": scored / ours_s,
        "transformers_tok_s": scored / hf_s,
        "ratio": hf_s / ours_s,
        "max_abs_logprob_diff": diff,
        "same_top_k_fraction": same_top,
    }
    print(
        f"{result['command']}\n{len(prompts)} prompts, {scored:,} tokens scored (top {args.top_k}), {device} "
        f"{dtype}\n| engine | s | tokens scored/s |\n|---|---:|---:|\n"
        f"| gapless | {ours_s:.2f} | {scored / ours_s:,.0f} |\n| transformers forward | {hf_s:.2f} | "
        f"{scored / hf_s:,.0f} |\ngapless / transformers: {hf_s / ours_s:.2f}x; largest logprob difference "
        f"{diff:.2e}; same top-{args.top_k} ids at {same_top:.1%} of positions"
    )
    if args.mc:
        result["mc_computed_fraction"] = fractions = computed_fraction(str(path), vocab)
        for name, share in fractions.items():
            print(f"multiple choice (8 questions x 4 choices), {name}: {share:.1%} of prompt tokens computed")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
