"""The server's detokenizer, one step of many streams at a time: `python bench/experiments/detokenize.py`.

Each engine step sends the detokenizer every running request's new tokens; it must turn them into text
deltas faster than the engine makes steps, or the streams fall behind. This measures its time per step
at `--requests` streams (256 by default, the host benchmark's batch), each getting `--tokens-per-step`
tokens a step of real text (the tokenizer's encoding of the built-in corpus, each stream from its own
offset), in four ways, alternating for `--rounds` rounds (the table shows medians):

- `per request, tokenizer.decode`: each stream's `IncrementalDetokenizer.update` through the Hugging Face
  tokenizer's `decode` (the detokenizer before whole-step decoding);
- `per request, Rust decoder`: the same through the tokenizer's Rust decoder (`Decoder.one`);
- `whole step`: `update_many`, the step's windows decoded in one call (`Decoder.many`);
- `whole step + deltas`: what the server's detokenizer stage does per step: `update_many`, the deltas
  built and the message encoded (msgpack), less the socket.

`--tokenizer` takes a model's tokenizer, named as `gapless serve --model` names one (a checkpoint, a GGUF
file, a built-in name such as `SmolLM2-135M-Instruct`, a Hugging Face id); the default is the built-in
byte-level BPE.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from gapless.bench import cli
from gapless.engine.detokenize import IncrementalDetokenizer, update_many
from gapless.server import protocol as P
from gapless.server.workers.detokenizer import DetokenizerStage

MODES = ("per request, tokenizer.decode", "per request, Rust decoder", "whole step", "whole step + deltas")


class _PlainDecode:
    """A tokenizer seen only through its `decode`: detokenizers of it call `tokenizer.decode` itself."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def streams(tokenizer: Any, requests: int, length: int) -> list[list[int]]:
    """`requests` token streams of `length` ids each: the corpus' encoding, each from its own offset."""
    from gapless.default_model.tokenizer import CORPUS

    text = " ".join(CORPUS)
    ids = tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < length + 7 * requests:
        ids = ids + ids
    return [ids[7 * i : 7 * i + length] for i in range(requests)]


def run_mode(
    mode: str, tokenizer: Any, ids: Sequence[Sequence[int]], per_step: int
) -> tuple[float, list[str]]:
    """Stream `ids` through one mode; return the mean ms per step and each stream's text."""
    steps = len(ids[0]) // per_step
    chunks = [[s[k * per_step : (k + 1) * per_step] for s in ids] for k in range(steps)]
    step: Callable[[list[list[int]]], list[str]]
    if mode == "whole step + deltas":
        stage = DetokenizerStage(tokenizer, socks=None)
        rids = [f"r{i}" for i in range(len(ids))]

        def step(new: list[list[int]]) -> list[str]:
            updates = [P.ReqUpdate(rid, t, prompt_tokens=16, cached_tokens=0) for rid, t in zip(rids, new)]
            deltas = stage.deltas(updates)
            P.encode(P.Deltas(deltas))
            return [d.text for d in deltas]
    else:
        tok = _PlainDecode(tokenizer) if mode == "per request, tokenizer.decode" else tokenizer
        dets = [IncrementalDetokenizer(tok) for _ in ids]
        if mode == "whole step":

            def step(new: list[list[int]]) -> list[str]:
                return update_many(dets, new)
        else:

            def step(new: list[list[int]]) -> list[str]:
                return [det.update(t) for det, t in zip(dets, new)]

    texts: list[list[str]] = [[] for _ in ids]
    start = time.perf_counter()
    for new in chunks:
        for parts, delta in zip(texts, step(new)):
            parts.append(delta)
    ms = (time.perf_counter() - start) * 1e3 / steps
    return ms, ["".join(parts) for parts in texts]


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=cli.positive_int, default=256, help="streams per step")
    ap.add_argument("--steps", type=cli.positive_int, default=256, help="steps per run")
    ap.add_argument(
        "--tokens-per-step", type=cli.positive_int, default=1, help="new tokens a stream gets a step"
    )
    ap.add_argument("--rounds", type=cli.positive_int, default=3, help="runs of every mode, alternating")
    ap.add_argument(
        "--tokenizer", default=None, help="a Hugging Face tokenizer (path or id); default: built-in"
    )
    ap.add_argument("--json", default=None, help="write the figures here")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = _parse_args(argv)

    if args.tokenizer is None:
        from gapless.testing import build_tokenizer

        tokenizer, name = build_tokenizer(), "built-in byte-level BPE"
    else:  # whatever `gapless serve --model` takes, as the server loads its tokenizer
        from gapless.config import EngineConfig
        from gapless.model.source import load_tokenizer, localize

        tokenizer, name = load_tokenizer(localize(EngineConfig(model=args.tokenizer))), args.tokenizer
    ids = streams(tokenizer, args.requests, args.steps * args.tokens_per_step)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    texts: dict[str, list[str]] = {}
    for r in range(args.rounds):
        for mode in MODES:
            ms, texts[mode] = run_mode(mode, tokenizer, ids, args.tokens_per_step)
            times[mode].append(ms)
        cli.progress(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{t[-1]:.3f}" for t in times.values()))
    same = all(t == texts[MODES[0]] for t in texts.values())
    medians = {m: statistics.median(t) for m, t in times.items()}
    rows = [(m, f"{ms:.3f}", f"{medians[MODES[0]] / ms:.2f}x") for m, ms in medians.items()]
    args_given = sys.argv[1:] if argv is None else argv
    print(shlex.join(["python", "bench/experiments/detokenize.py", *args_given]))
    print(cli.machine_line(cli.machine()))
    print(
        f"tokenizer: {name}; {args.requests} streams, {args.tokens_per_step} token(s) a step, {args.steps} "
        f"steps, median of {args.rounds} rounds"
    )
    print("\n".join(cli.markdown_table(("detokenizer", "ms/step", "vs per request"), rows, "lrr")))
    print("texts identical in every mode" if same else "TEXTS DIFFER between modes")
    res = {"args": vars(args), "ms_per_step": times, "median_ms_per_step": medians, "texts_identical": same}
    if args.json:
        cli.write_json(args.json, {**res, "machine": cli.machine()})
    return res


if __name__ == "__main__":
    raise SystemExit(0 if main()["texts_identical"] else 1)
