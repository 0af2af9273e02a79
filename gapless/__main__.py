"""Command line: `gapless serve [--model PATH]` (the HTTP server) and `gapless chat [--model PATH]`
(a terminal chat that streams its replies); also `python -m gapless ...`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from gapless.chat import add_chat_args, chat_main
    from gapless.server.launch import add_serve_args, serve

    parser = argparse.ArgumentParser(prog="gapless")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_args(
        sub.add_parser("serve", help="OpenAI-compatible HTTP server (default: the built-in model)")
    )
    add_chat_args(
        sub.add_parser("chat", help="chat in the terminal (/reset clears the history, /exit quits)")
    )
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args)
    return chat_main(args)


if __name__ == "__main__":
    sys.exit(main())
