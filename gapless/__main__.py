"""Command line: `gapless serve [--model PATH]` (the HTTP server) and `gapless chat [--model PATH]`
(a terminal chat); also `python -m gapless ...`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from gapless.server.launch import add_serve_args, serve

    parser = argparse.ArgumentParser(prog="gapless")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_args(
        sub.add_parser("serve", help="OpenAI-compatible HTTP server (default: the built-in model)")
    )
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
