"""The rounding the quantized CPU layouts take, measured on the default model (SmolLM2-135M-Instruct,
Q4_1 with a Q8_0 embedding table): perplexity of a fixed text, and greedy agreement over 64 new tokens
of a few prompts, kept-quantized against the same file dequantized to float32. Run as

    PYTHONPATH=. .venv/bin/python bench/experiments/gguf_quality.py [FILE.gguf] [--int4-path]

`--int4-path`: the projections as a GPU holds them instead (`gapless.model.quant.gguf_int4`, the reference
path's dequantized weights), in float32 and in bfloat16 (a GPU's dtype: scales and zeros held in it),
each against the file dequantized in the same dtype.
"""

from __future__ import annotations

import math
import os
import sys

from gapless import LLM, SamplingParams
from gapless.default_model.smollm2 import smollm2_path

TEXT = (
    "The river starts in the hills above the town, where snow melts in spring and runs down through the "
    "pine woods into a narrow valley. For most of the year it is shallow enough to cross on foot, but "
    "after heavy rain it rises quickly and has flooded the lower streets more than once. The old stone "
    "bridge was built in the eighteenth century by the owners of the mill, who needed a way to bring "
    "grain from the farms on the far bank. Today the mill is a museum, and the bridge carries only "
    "walkers and cyclists. In the summer, children swim in the pool below the weir, and anglers wait "
    "along the banks for trout. The town council has argued for years about whether to build a second "
    "bridge for cars, since the nearest crossing is twelve kilometres downstream. Supporters say it "
    "would bring trade and shorten journeys to the hospital; opponents fear more traffic, noise and "
    "the loss of the meadow where the market is held each autumn."
)
PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Explain why the sky is blue in two sentences.",
    "List three uses of copper:",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "Translate to French: Good morning, how are you?",
]


Top = list[list[list[tuple[int, float]]]]  # per prompt, per step, the top (token, logprob) pairs


def run(
    path: str, dtype: str = "float32", **options: object
) -> tuple[float, list[list[int]], Top, list[list[float]]]:
    """(perplexity of TEXT, greedy tokens of PROMPTS, their top-2 and chosen logprobs) of `path` on the CPU
    in `dtype`, with the engine's `options`."""
    with LLM(path, device="cpu", dtype=dtype, kv_cache_tokens=4096, overlap=False, **options) as llm:
        ids = llm.tokenizer.encode(TEXT)
        out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        nll = [-lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], ids[1:])]
        greedy = llm.generate(
            PROMPTS,
            SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, logprobs=2),
            use_tqdm=False,
        )
    top = [o.top_logprobs or [] for o in greedy]
    chosen = [o.logprobs or [] for o in greedy]
    return math.exp(sum(nll) / len(nll)), [o.token_ids for o in greedy], top, chosen


def file_types(path: str) -> str:
    """The file's matrices by tensor type, e.g. "Q4_1 x210, Q8_0 x1" (norms, 1-D, left out)."""
    from collections import Counter

    from gguf import GGUFReader

    kinds = Counter(t.tensor_type.name for t in GGUFReader(path).tensors if len(t.shape) == 2)
    return ", ".join(f"{k} x{n}" for k, n in kinds.most_common())


def int4_path(path: str) -> None:
    """`--int4-path`: the file's projections on the int4/int8 path, against the file dequantized, in
    float32 and bfloat16 (the module's docstring)."""
    from gapless.model import loader

    os.environ["GAPLESS_INT4_KERNEL"] = "triton"  # (on the CPU: the reference path, the weights as held)
    kept = loader.gguf_kept
    for dtype in ("float32", "bfloat16"):
        os.environ["GAPLESS_GGUF_WEIGHTS"] = "dequantize"
        ppl_f, toks_f, _, _ = run(path, dtype)
        os.environ["GAPLESS_GGUF_WEIGHTS"] = "quantized"
        loader.gguf_kept = lambda p, device: "int4" if kept(p, device) else ""  # type: ignore[assignment]
        try:
            ppl_q, toks_q, _, _ = run(path, dtype)
        finally:
            loader.gguf_kept = kept  # type: ignore[assignment]
        same = sum(q == f for q, f in zip(toks_q, toks_f))
        print(
            f"{dtype}: perplexity dequantized {ppl_f:.4f}, int4 path {ppl_q:.4f} "
            f"({100 * (ppl_q / ppl_f - 1):+.2f}%); greedy identical {same}/{len(PROMPTS)}"
        )


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--int4-path"]
    path = args[0] if args else str(smollm2_path())
    if "--int4-path" in sys.argv:
        print(f"file {path}: {file_types(path)}")
        int4_path(path)
        return
    os.environ["GAPLESS_GGUF_WEIGHTS"] = "dequantize"
    ppl_f, toks_f, top_f, lp_f = run(path)
    os.environ["GAPLESS_GGUF_WEIGHTS"] = "quantized"
    ppl_q, toks_q, _, lp_q = run(path)
    first = [next((i for i, (a, b) in enumerate(zip(q, f)) if a != b), None) for q, f in zip(toks_q, toks_f)]
    # the float model's top-2 logprob gap (= logit gap) where the quantized model first chose otherwise
    gaps = [None if i is None else round(t[i][0][1] - t[i][1][1], 3) for i, t in zip(first, top_f)]
    print(f"file {path}: {file_types(path)}")
    print(f"perplexity of the fixed text ({len(TEXT)} chars): float32 {ppl_f:.4f}, quantized {ppl_q:.4f}")
    print(f"greedy, {len(PROMPTS)} prompts x 64 tokens: identical {first.count(None)}/{len(PROMPTS)}")
    print(f"first divergence step per prompt (None: identical): {first}")
    print(f"the float model's top-2 logit gap there: {gaps}")
    # how far the quantized model's logprobs move, on the tokens both chose before they diverged
    moved = [abs(a - b) for q, f, i in zip(lp_q, lp_f, first) for a, b in zip(q[:i], f[:i])]
    mean = sum(moved) / len(moved)
    print(f"|logprob change| of the chosen token before divergence: max {max(moved):.3f}, mean {mean:.3f}")


if __name__ == "__main__":
    main()
