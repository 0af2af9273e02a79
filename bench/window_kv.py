"""Freeing the KV behind a sliding window vs keeping it, on one workload (`README.md`, "Freeing behind the
sliding window"): a random Mistral checkpoint whose every layer slides a `--window`-token window (tiny,
made here, float32, CPU), `--requests` greedy requests of 32 prompt tokens and `--max-tokens` output
tokens each, in a `--kv-tokens` pool with pages of 16. "kept" is the same engine with the freeing turned
off (the scheduler's `freeing_window` answering None, as it does for Gemma 2/3), the behaviour before it
existed. Both runs in one process, one after the other; the claim is their ratio on the same machine.

    PYTHONPATH=. .venv/bin/python bench/window_kv.py
"""

from __future__ import annotations

import argparse
import tempfile
import time

import gapless.engine.scheduler as scheduler
from gapless import LLM, SamplingParams
from gapless.testing import make_checkpoint


def run(path: str, args: argparse.Namespace) -> dict[str, float]:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    opts = dict(device="cpu", dtype="float32", page_size=16, overlap=False)
    with LLM(path, kv_cache_tokens=args.kv_tokens, max_running_requests=args.requests, **opts) as llm:
        eng = llm.engine
        for i in range(args.requests):
            eng.add_request([3 + i] * 32, params)
        used = running = 0
        t = time.perf_counter()
        while eng.has_unfinished():
            eng.step()
            used = max(used, eng.scheduler.kv.usage()["kv_used_tokens"])
            running = max(running, len(eng.scheduler.queues.running))
        wall = time.perf_counter() - t
        llm.check_integrity()
        st = eng.stats
        return {
            "wall_s": wall,
            "peak_kv_used_tokens": used,
            "peak_running": running,
            "retractions": st.retractions,
            "decode_batches": st.decode_batches,
            "prompt_tokens_computed": st.prompt_tokens,
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--kv-tokens", type=int, default=2048)
    args = ap.parse_args()
    path = str(
        make_checkpoint(
            tempfile.mkdtemp() + "/w", "mistral", sliding_window=args.window, max_position_embeddings=1024
        )
    )
    freeing = scheduler.freeing_window
    results = {"freeing": run(path, args)}
    scheduler.freeing_window = lambda *a: None  # type: ignore[assignment]
    try:
        results["kept"] = run(path, args)
    finally:
        scheduler.freeing_window = freeing
    print(f"{vars(args)}")
    for name, r in results.items():
        print(
            f"{name:8s} "
            + " ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items())
        )
    print(f"wall time kept / freeing: {results['kept']['wall_s'] / results['freeing']['wall_s']:.2f}x")


if __name__ == "__main__":
    main()
