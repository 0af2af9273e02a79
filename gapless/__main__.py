"""Command line: `gapless serve [MODEL]` (the HTTP server) and `gapless chat [MODEL]` (a terminal chat that
streams its replies); also `python -m gapless ...`.

Building the parser imports neither torch, transformers nor the web stack, so `gapless --help` and every
argument error answer at once; a subcommand imports what it runs only once its arguments are read. An
argument error prints the subcommand's usage and one line (for an unknown flag, the nearest known one) and
exits with status 2.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys

from gapless.chat import add_chat_args
from gapless.server.serve_args import add_serve_args

SUBCOMMANDS = {
    "serve": "OpenAI-compatible HTTP server (default model: SmolLM2-135M-Instruct)",
    "chat": "chat in the terminal (/reset clears the history, /exit quits)",
}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The `gapless` parser and its subcommands' parsers, by name."""
    parser = argparse.ArgumentParser(
        prog="gapless", allow_abbrev=False, description="gapless: an LLM inference and serving engine"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,chat}")
    subs = {
        name: sub.add_parser(
            name, help=text, description=text, usage="%(prog)s [MODEL] [options]", allow_abbrev=False
        )
        for name, text in SUBCOMMANDS.items()
    }
    add_serve_args(subs["serve"])
    add_chat_args(subs["chat"])
    return parser, subs


def unknown_arguments(extra: list[str], parser: argparse.ArgumentParser) -> str:
    """The error for arguments `parser` does not know: the first unknown flag and the nearest known one."""
    flags = [a.split("=", 1)[0] for a in extra if a.startswith("-")]
    if not flags:
        return f"unexpected argument(s): {' '.join(extra)}"
    known = [name for action in parser._actions for name in action.option_strings]
    nearest = difflib.get_close_matches(flags[0], known, n=1)
    hint = f"; did you mean {nearest[0]}?" if nearest else f" (see {parser.prog} --help)"
    return f"unknown flag {flags[0]}{hint}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Read the command line; an error exits with the subcommand's usage and status 2."""
    parser, subs = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        subs[args.command].error(unknown_arguments(extra, subs[args.command]))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "serve":
        from gapless.server.launch import serve

        return serve(args)
    from gapless.chat import chat_main

    return chat_main(args)


if __name__ == "__main__":
    status = main()
    # Everything either command started has been stopped by now; what is left is the interpreter's
    # teardown of torch and transformers, about a second spent on nothing, so skip it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
