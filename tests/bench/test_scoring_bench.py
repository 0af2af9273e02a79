"""The scoring benchmark runs end to end (`--quick`), gapless's prompt logprobs agree with transformers'
forward pass on its prompts, and a multiple-choice workload computes less with a logprob start."""

from __future__ import annotations

import json

from gapless.bench import scoring
from gapless.testing import cached_checkpoint


def test_quick_scoring_bench(tmp_path, capsys):
    out = tmp_path / "scoring.json"
    argv = [
        "--quick",
        "--size",
        "tiny",
        "--num-seqs",
        "3",
        "--top-k",
        "2",
        "--threads",
        "1",
        "--device",  # the float32 path on every machine: a GPU machine's default is bfloat16 on CUDA
        "cpu",
        "--dtype",
        "float32",
        "--out",
        str(out),
    ]
    assert scoring.main(argv) == 0
    got = json.loads(out.read_text())
    assert got["tokens_scored"] > 0 and got["gapless_tok_s"] > 0 and got["transformers_tok_s"] > 0
    assert got["max_abs_logprob_diff"] < 1e-4 and got["same_top_k_fraction"] > 0.95
    assert "gapless / transformers" in capsys.readouterr().out


def test_scoring_from_the_choice_reuses_the_question():
    every, from_choice = scoring.computed_fraction(
        str(cached_checkpoint("qwen3")), 1000, questions=2
    ).values()
    assert every == 1.0 and from_choice < 0.5
