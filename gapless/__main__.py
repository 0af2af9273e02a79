"""Command line: `gapless serve [MODEL]` (the HTTP server) and `gapless chat [MODEL]` (a terminal chat that
streams its replies); also `python -m gapless ...`.

Building the parser imports neither torch, transformers nor the web stack, so `gapless --help` and every
argument error answer at once; a subcommand imports what it runs only once its arguments are read. An
argument error prints the subcommand's usage and one line (every unknown flag, each with gapless's name
for it or the nearest known one) and exits with status 2. `--config FILE`, vLLM's and SGLang's YAML file of
flags, is read first by the same parser, its errors naming the file; the command line's flags win.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys

from gapless.chat import add_chat_args
from gapless.cli import DOTTED_FLAGS, FOREIGN_FLAGS, apply_switches, config_file_args
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
    for each in subs.values():
        each.add_argument(
            "--config",
            metavar="FILE",
            help="read flags from a YAML file (vLLM's and SGLang's): `port: 8000`, `max-model-len: 4096`, "
            "`enforce-eager: true`, `served-model-name: [a, b]`; the command line's flags win",
        )
    return parser, subs


# a prefix that turns a switch on or off: no hint crosses from one to another
_POLARITY = ("--enable-", "--disable-", "--no-")


def _flag_kinds(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each flag's kind, as a config file's value is read for it: "switch" (no value), "append" (given
    once per value), "value"."""
    kinds: dict[str, str] = {}
    for action in parser._actions:
        appends = isinstance(action, argparse._AppendAction)
        kind = "switch" if action.nargs == 0 else "append" if appends else "value"
        kinds |= dict.fromkeys(action.option_strings, kind)
    return kinds


def _polarity(flag: str) -> str:
    return next((p for p in _POLARITY if flag.startswith(p)), "")


def unknown_arguments(extra: list[str], parser: argparse.ArgumentParser) -> str:
    """The error for arguments `parser` does not know: each unknown flag, with what to use instead (another
    server's flag with no twin here: `FOREIGN_FLAGS`) or the nearest known flag that turns nothing the
    other way (no --enable- for a --disable-)."""
    flags = [a.split("=", 1)[0] for a in extra if a.startswith("-")]
    if not flags:
        return f"unexpected argument(s): {' '.join(extra)}"
    known = _flag_kinds(parser)  # (its keys: every flag)

    def said(flag: str) -> str:
        if flag in FOREIGN_FLAGS:
            return f"{flag} ({FOREIGN_FLAGS[flag]})"
        if flag.startswith("--no-") and f"--{flag[5:]}" in known:  # (vLLM's negation of a switch)
            return f"{flag} (the default here: leave it out)"
        close = difflib.get_close_matches(flag, known, n=3, cutoff=0.75)
        near = [k for k in close if _polarity(k) == _polarity(flag)]
        return f"{flag}; did you mean {near[0]}?" if near else f"{flag} (see {parser.prog} --help)"

    unknown = list(dict.fromkeys(flags))
    return f"unknown flag{'s' if len(unknown) > 1 else ''} {'; '.join(map(said, unknown))}"


def _dashed(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`argv` with vLLM's underscored spellings of known flags (`--max_model_len`) dashed."""
    known = _flag_kinds(parser)  # (its keys: every flag)

    def dash(arg: str) -> str:
        flag, eq, value = arg.partition("=")
        dashed = flag.replace("_", "-")
        return dashed + eq + value if arg.startswith("--") and "_" in flag and dashed in known else arg

    return [dash(arg) for arg in argv]


def _undotted(argv: list[str]) -> list[str]:
    """`argv` with vLLM's dotted spellings of its compilation flags (`-O.level=3`, `-O.level 3`,
    `--compilation-config.level 3`) as the flag and one value, which is not read; and a bare `-O` whose
    next word is no level (0-3) or JSON without one (as newer vLLM reads it: `-O /ckpt` names the model)."""
    out, i = [], 0
    while i < len(argv):
        arg, after = argv[i], argv[i + 1] if i + 1 < len(argv) else ""
        flag, dot, key = arg.partition(".")
        if dot and flag.replace("_", "-") in DOTTED_FLAGS:
            value = key if "=" in key else f"{key}={after}"
            arg, i = f"--compilation-config={value}", i + (0 if "=" in key else 1)
        elif arg == "-O" and not (after in ("0", "1", "2", "3") or after.startswith("{")):
            arg = "--compilation-config="
        out.append(arg)
        i += 1
    return out


def _words(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    return _dashed(_undotted(argv), parser)


def _config_file(argv: list[str], parser: argparse.ArgumentParser) -> tuple[str | None, list[str]]:
    """The file `--config FILE` names (None: none), and `argv` without it."""
    at = [i for i, arg in enumerate(argv) if arg == "--config" or arg.startswith("--config=")]
    if len(at) > 1:
        parser.error("--config given more than once: one file")
    if not at:
        return None, argv
    i = at[0]
    if argv[i] != "--config":
        return argv[i].partition("=")[2], argv[:i] + argv[i + 1 :]
    if i + 1 == len(argv) or argv[i + 1].startswith("-"):  # (no value: argparse says so)
        return None, argv
    return argv[i + 1], argv[:i] + argv[i + 2 :]


def _read_config(path: str, parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The options a `--config` file gives, read by `parser` as the same flags on the command line would
    be; an error names the file, with the subcommand's usage and status 2."""
    try:
        words = _words(config_file_args(path, _flag_kinds(parser)), parser)
        parser.exit_on_error = False  # (its errors raised here, to name the file)
        args, extra = parser.parse_known_args(words)
    except (ValueError, argparse.ArgumentError) as e:
        parser.error(f"--config {path}: {e}")
    finally:
        parser.exit_on_error = True
    if args.model_arg is not None:  # a value no flag took (a list given to a flag of one value)
        extra = [args.model_arg, *extra]
    if extra:
        parser.error(f"--config {path}: {unknown_arguments(extra, parser)}")
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Read the command line, and the `--config` file it names first (its flags lose to the command
    line's; a model named on the command line wins over the file's); an error exits with the
    subcommand's usage and status 2."""
    parser, subs = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in subs:  # (help, no subcommand, or a word before it: argparse says)
        args, extra = parser.parse_known_args(argv)
        subs[args.command].error(unknown_arguments(extra, subs[args.command]))
    sub = subs[argv[0]]
    path, words = _config_file(_words(argv[1:], sub), sub)
    args = _read_config(path, sub) if path is not None else argparse.Namespace()
    file_model, args.model = getattr(args, "model", None), None
    file_off, args.switched_off = getattr(args, "switched_off", None) or {}, None
    args, extra = sub.parse_known_args(words, args)
    if extra:
        sub.error(unknown_arguments(extra, sub))
    if args.model is None and args.model_arg is None:
        args.model = file_model
    # the file's switches that turned an option off, but where the command line set that option
    kept = {option: off for option, off in file_off.items() if getattr(args, option) == off}
    args.switched_off = {**kept, **(args.switched_off or {})}
    args.command, args.config = argv[0], path
    return apply_switches(args)


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
