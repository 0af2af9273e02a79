"""lm-evaluation-harness against `gapless serve`: its `local-completions` model (echo + logprobs for
loglikelihoods, plain completions for generations) gives what its `hf` model gives on the same checkpoint,
with `tokenized_requests` true (token-id prompts) and false (text): per-choice loglikelihoods within 1e-3,
the same accuracy, the same rolling perplexity, the same generations. The tasks are tiny local ones
(`tasks/`: a multiple-choice set, a rolling-perplexity text and a generation set, JSONL with their YAMLs).

lm-eval is the optional `eval` extra (`pip install -e .[eval]`); without it this test skips, saying so."""

from __future__ import annotations

from pathlib import Path

import pytest

from gapless.testing.server import ServerProcess

lm_eval = pytest.importorskip(
    "lm_eval", reason="lm-eval is not installed (the `eval` extra: pip install -e .[eval])"
)

TASKS = Path(__file__).parent / "tasks"
NAMES = ["gapless_mc", "gapless_ppl", "gapless_gen"]
MAX_LENGTH = 512
TOL = 1e-3


def evaluate(monkeypatch: pytest.MonkeyPatch, model: str, model_args: dict) -> dict:
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(TASKS)  # the YAMLs name their JSONL files relative to this folder
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the tasks and metrics are local: never wait on the network
    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=NAMES,
        task_manager=TaskManager(include_path=str(TASKS), include_defaults=False),
        batch_size=4,
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )


@pytest.fixture(scope="module")
def checkpoint(ckpt_factory):
    return str(ckpt_factory("qwen3"))


@pytest.fixture(scope="module")
def hf_results(checkpoint, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("datasets")))
        args = {"pretrained": checkpoint, "dtype": "float32", "device": "cpu", "max_length": MAX_LENGTH}
        return evaluate(mp, "hf", args)


@pytest.fixture(scope="module")
def served(checkpoint):
    srv = ServerProcess("--device", "cpu", "--model", checkpoint, "--max-model-len", str(MAX_LENGTH))
    yield srv
    assert srv.stop() == 0, srv.output


def responses(results: dict, task: str) -> list:
    return [s["filtered_resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


@pytest.mark.parametrize("tokenized", [True, False])
def test_local_completions_equals_hf(hf_results, served, checkpoint, tokenized, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path))
    args = {
        "base_url": f"{served.url}/v1/completions",
        "model": checkpoint,
        "tokenizer": checkpoint,
        "tokenizer_backend": "huggingface",
        "tokenized_requests": tokenized,
        "max_length": MAX_LENGTH,
        "max_retries": 1,
    }
    ours = evaluate(monkeypatch, "local-completions", args)
    # multiple choice: every choice's loglikelihood, and the accuracy they give
    for got, want in zip(responses(ours, "gapless_mc"), responses(hf_results, "gapless_mc"), strict=True):
        assert [ll for ll, _ in got] == pytest.approx([ll for ll, _ in want], abs=TOL)
    assert ours["results"]["gapless_mc"]["acc,none"] == hf_results["results"]["gapless_mc"]["acc,none"]
    # rolling perplexity: each text's loglikelihood and the perplexities
    got, want = responses(ours, "gapless_ppl"), responses(hf_results, "gapless_ppl")
    assert [g[0] for g in got] == pytest.approx([w[0] for w in want], abs=TOL)
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert ours["results"]["gapless_ppl"][metric] == pytest.approx(
            hf_results["results"]["gapless_ppl"][metric], rel=TOL
        )
    # greedy generations, text for text
    assert responses(ours, "gapless_gen") == responses(hf_results, "gapless_gen")
    assert (
        ours["results"]["gapless_gen"]["exact_match,none"]
        == hf_results["results"]["gapless_gen"]["exact_match,none"]
    )
