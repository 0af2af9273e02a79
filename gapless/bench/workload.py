"""Benchmark workloads: the same requests for every engine, regenerated exactly from a seed.

The offline workload follows nano-vllm's `bench.py`: random prompt token ids, prompt and output lengths
drawn uniformly (inclusive bounds), and every request run to its output length (`ignore_eos`), so
throughput depends only on the lengths and never on what a random-weight model happens to emit.
It is plain data (token ids and lengths) so the online benchmark can replay it against the server.
"""

from __future__ import annotations

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
