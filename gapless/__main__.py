"""Command line: `python -m gapless serve [--model PATH]` (also the `gapless` script)."""

from __future__ import annotations

import argparse
import sys
import time


def _serve(args: argparse.Namespace) -> int:
    from gapless import LLM, SamplingParams
    from gapless.testing import default_model_path

    model = args.model or str(default_model_path())
    print("gapless: the HTTP server arrives in a later issue; running an offline generation instead.")
    print(f"gapless: model {model}")
    options = {"overlap": False} if args.disable_overlap else {}  # else the default (and its env switch)
    with LLM(model, device=args.device, **options) as llm:
        prompts = ["The quick brown fox", "Once upon a time", "def fibonacci(n):", "café naïve"]
        t = time.perf_counter()
        outs = llm.generate(
            prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0), use_tqdm=False
        )
        dt = time.perf_counter() - t
        for p, o in zip(prompts, outs):
            print(f"  {p!r} -> {o.text!r} ({len(o.token_ids)} tokens, {o.finish_reason})")
        n = sum(len(o.token_ids) for o in outs)
        print(f"gapless: {n} tokens in {dt:.2f}s ({n / dt:.1f} tok/s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gapless")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model (default: the built-in tiny model)")
    serve.add_argument("--model", default=None, help="Hugging Face checkpoint directory")
    serve.add_argument("--device", default="auto")
    serve.add_argument("--max-tokens", type=int, default=32)
    serve.add_argument(
        "--disable-overlap",
        action="store_true",
        help="plain loop: process each batch before scheduling the next (also GAPLESS_DISABLE_OVERLAP=1)",
    )
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
