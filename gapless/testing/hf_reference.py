"""The yardstick: greedy continuations and logits from `transformers` itself, for parity tests."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

TIE_TOLERANCE = 1e-3  # a greedy divergence is accepted only where the reference's top-2 logits are this close


def load_hf_model(path: str | Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="eager").eval()


@dataclass
class Reference:
    tokens: list[int]  # greedy continuation
    logits: torch.Tensor  # [steps, vocab] fp32 logits that chose each token


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> Reference:
    """Greedy decoding with the HF model and its own KV cache; no EOS stop (compare with ignore_eos)."""
    ids = torch.tensor([prompt])
    out = model(input_ids=ids, use_cache=True)
    tokens, logits = [], []
    for _ in range(max_new_tokens):
        step_logits = out.logits[0, -1].float()
        tok = int(step_logits.argmax())
        tokens.append(tok)
        logits.append(step_logits)
        out = model(input_ids=torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
    return Reference(tokens, torch.stack(logits))


@torch.inference_mode()
def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """Teacher-forced logits [len(ids), vocab] in fp32."""
    return model(input_ids=torch.tensor([ids])).logits[0].float()


def check_greedy(ours: list[int], ref: Reference, tol: float = TIE_TOLERANCE) -> str | None:
    """None if `ours` equals the reference, or first diverges at a near-tie (then returns a note saying so).
    Raises AssertionError on a real divergence."""
    n = min(len(ours), len(ref.tokens))
    assert len(ours) == len(ref.tokens), f"length {len(ours)} != reference {len(ref.tokens)}"
    for i in range(n):
        if ours[i] != ref.tokens[i]:
            step = ref.logits[i]
            top2 = step.topk(2).values
            gap = float(top2[0] - top2[1])
            ours_gap = float(step.max() - step[ours[i]])
            assert ours_gap <= tol, (
                f"diverged at step {i}: ours {ours[i]} vs reference {ref.tokens[i]}, "
                f"reference logit gap {ours_gap:.2e} > tie tolerance {tol:.0e}"
            )
            return f"accepted near-tie divergence at step {i} (top-2 gap {gap:.2e})"
    return None


def assert_agrees(model: str | Path, reference: torch.nn.Module, max_new: int = 8, **engine: object) -> None:
    """gapless' greedy tokens for `model` (engine options `engine`; on the CPU in float32 unless they say
    otherwise) equal `reference`'s on three prompts, or part from them once at most, at a near-tie."""
    from gapless import LLM, SamplingParams

    prompts = make_prompts(1000, n=3, max_len=30, shared_prefix=8)
    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    options = {"device": "cpu", "dtype": "float32", "kv_cache_tokens": 2048, "overlap": False, **engine}
    with LLM(str(model), **options) as llm:
        ours = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    notes = [check_greedy(o, hf_greedy(reference, p, max_new)) for o, p in zip(ours, prompts)]
    assert sum(n is not None for n in notes) <= 1, notes


def make_prompts(
    vocab: int, n: int = 16, seed: int = 0, shared_prefix: int = 48, max_len: int = 90
) -> list[list[int]]:
    """Varied lengths (1..max_len), a group sharing a long prefix, and some longer than a small chunk."""
    rng = random.Random(seed)
    tok = lambda: rng.randrange(3, vocab)  # noqa: E731
    prefix = [tok() for _ in range(shared_prefix)]
    prompts = []
    for i in range(n):
        if i % 3 == 0:
            prompts.append(prefix + [tok() for _ in range(rng.randint(1, max_len - shared_prefix))])
        else:
            prompts.append([tok() for _ in range(rng.choice([1, 3, 7, 20, 33, 64, max_len]))])
    return prompts


def prompts_and_references(
    path: str | Path, max_new_tokens: Sequence[int], **prompt_kw: int
) -> tuple[list[list[int]], list[Reference]]:
    """One prompt per entry of `max_new_tokens` (`make_prompts` over the checkpoint's vocabulary, with
    `prompt_kw`) and transformers' greedy reference of each, to its own length."""
    hf = load_hf_model(path)
    prompts = make_prompts(hf.config.vocab_size, n=len(max_new_tokens), **prompt_kw)
    return prompts, [hf_greedy(hf, p, n) for p, n in zip(prompts, max_new_tokens, strict=True)]


def greedy_references(
    checkpoint: Callable[[str], Path], prompts_for: Callable[[int], list[list[int]]], max_new_tokens: int
) -> Callable[[str], tuple[Path, list[list[int]], list[Reference]]]:
    """`get(arch)`: the checkpoint `checkpoint(arch)`, its prompts (`prompts_for(vocab_size)`) and
    transformers' greedy reference of each, computed once per arch (a module fixture's cache)."""
    cache: dict[str, tuple[Path, list[list[int]], list[Reference]]] = {}

    def get(arch: str) -> tuple[Path, list[list[int]], list[Reference]]:
        if arch not in cache:
            path = checkpoint(arch)
            hf = load_hf_model(path)
            prompts = prompts_for(hf.config.vocab_size)
            cache[arch] = (path, prompts, [hf_greedy(hf, p, max_new_tokens) for p in prompts])
        return cache[arch]

    return get
