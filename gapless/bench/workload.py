"""Benchmark workloads: the same requests for every engine, regenerated exactly from a seed.

The offline workload follows nano-vllm's `bench.py`: random prompt token ids, prompt and output lengths
drawn uniformly (inclusive bounds), and every request run to its output length (`ignore_eos`), so
throughput depends only on the lengths and never on what a random-weight model happens to emit. The
serving benchmark also draws a ShareGPT-shaped one (`sharegpt_workload`). A workload is plain data (token
ids and lengths), so the offline benchmarks run it in process and the serving one replays it against a
server.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    """`prompts[i]` is request i's prompt token ids; `output_lens[i]` the tokens it must generate."""

    prompts: list[list[int]]
    output_lens: list[int]

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.output_lens):
            raise ValueError(f"{len(self.prompts)} prompts but {len(self.output_lens)} output lengths")

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    def head(self, n: int) -> Workload:
        """The first `n` requests: a slice for a slower engine that cannot run the whole workload."""
        return Workload(self.prompts[:n], self.output_lens[:n])


def random_workload(
    num_seqs: int,
    min_input: int,
    max_input: int,
    min_output: int,
    max_output: int,
    vocab_size: int,
    seed: int = 0,
) -> Workload:
    """nano-vllm's offline workload (there: 256 seqs, lengths in [100, 1024], token ids below 10000).

    A private `random.Random(seed)` keeps it deterministic and independent of global RNG state; prompts
    are drawn first and output lengths after, as in nano-vllm, so changing the output range leaves the
    prompts unchanged. Token ids are uniform in [0, vocab_size).
    """
    if num_seqs < 1:
        raise ValueError(f"num_seqs must be >= 1, got {num_seqs}")
    if not 1 <= min_input <= max_input:
        raise ValueError(f"need 1 <= min_input <= max_input, got [{min_input}, {max_input}]")
    if not 1 <= min_output <= max_output:
        raise ValueError(f"need 1 <= min_output <= max_output, got [{min_output}, {max_output}]")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(vocab_size) for _ in range(rng.randint(min_input, max_input))] for _ in range(num_seqs)
    ]
    output_lens = [rng.randint(min_output, max_output) for _ in range(num_seqs)]
    return Workload(prompts, output_lens)


# ShareGPT-shaped lengths (see `sharegpt_workload`): the means the vLLM paper gives for its ShareGPT workload,
# log-space sigmas for a long tail of prompts and more concentrated answers, and vLLM's clip range.
SHAREGPT_INPUT_MEAN = 161
SHAREGPT_OUTPUT_MEAN = 338
SHAREGPT_INPUT_SIGMA = 1.2
SHAREGPT_OUTPUT_SIGMA = 0.8
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_LEN = 1024


def random_bounds(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive `[L*(1-r), L*(1+r)]`, rounded, never below 1: the serving benchmark's `random` lengths."""
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    return max(1, round(length * (1.0 - range_ratio))), max(1, round(length * (1.0 + range_ratio)))


def lognormal_lengths(rng: random.Random, n: int, mean: float, sigma: float, lo: int, hi: int) -> list[int]:
    """`n` lognormal lengths whose unclipped mean is `mean`, rounded and clipped to `[lo, hi]`."""
    if mean <= 0 or sigma < 0:
        raise ValueError(f"need mean > 0 and sigma >= 0, got mean={mean}, sigma={sigma}")
    if not 1 <= lo <= hi:
        raise ValueError(f"need 1 <= lo <= hi, got [{lo}, {hi}]")
    mu = math.log(mean) - sigma * sigma / 2.0  # E[exp(N(mu, s^2))] = exp(mu + s^2/2)
    return [min(hi, max(lo, round(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def sharegpt_workload(
    num_seqs: int,
    input_mean: float = SHAREGPT_INPUT_MEAN,
    output_mean: float = SHAREGPT_OUTPUT_MEAN,
    min_input: int = SHAREGPT_MIN_LEN,
    max_input: int = SHAREGPT_MAX_LEN,
    min_output: int = SHAREGPT_MIN_LEN,
    max_output: int = SHAREGPT_MAX_LEN,
    vocab_size: int = 1000,
    seed: int = 0,
) -> Workload:
    """Synthetic lengths shaped like the ShareGPT conversations vLLM benchmarks with, nothing downloaded.

    Each length is lognormal, clipped to `[min, max]` (default [4, 1024]: vLLM's ShareGPT loader keeps
    prompts of 4 to 1024 tokens and prompt + output within 2048, so capping outputs at 1024 too stays inside
    that). The means default to 161 prompt and 338 output tokens, the averages the vLLM paper gives for its
    ShareGPT workload (Kwon et al., SOSP 2023). The log-space sigmas are 1.2 for prompts and 0.8 for outputs:
    real ShareGPT prompts are mostly short questions with a long tail of pasted documents (median well below
    the mean: here ~78 tokens, ~1.5% clipped at 1024), while answers are more concentrated around a few
    hundred tokens (median ~245, a few percent at the 1024 cap). The lognormal mu is set so the unclipped mean
    equals the requested mean; clipping lowers it (defaults: ~150 and ~322).

    As in `random_workload`, one private `random.Random(seed)` draws everything: prompt lengths, then output
    lengths, then the prompts' token ids (uniform in [0, vocab_size)).
    """
    if num_seqs < 1:
        raise ValueError(f"num_seqs must be >= 1, got {num_seqs}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    rng = random.Random(seed)
    input_lens = lognormal_lengths(rng, num_seqs, input_mean, SHAREGPT_INPUT_SIGMA, min_input, max_input)
    output_lens = lognormal_lengths(rng, num_seqs, output_mean, SHAREGPT_OUTPUT_SIGMA, min_output, max_output)
    prompts = [[rng.randrange(vocab_size) for _ in range(n)] for n in input_lens]
    return Workload(prompts, output_lens)
