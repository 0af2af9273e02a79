"""The command line: `gapless chat` through `main`, with its input piped; the parser (fast, no engine
imported, vLLM's and SGLang's flags as aliases, a near miss named); and `gapless serve`'s checks, each one
line and status 2 before any process starts (the server itself runs as a process in tests/server)."""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import pytest

import gapless
from gapless.__main__ import build_parser, main, parse_args
from gapless.cli import _PARALLEL_FLAGS, FLAG_ALIASES, chosen_model, config_from_args, engine_options
from gapless.config import EngineConfig
from gapless.testing.server import descendants

ROOT = Path(gapless.__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "fastapi", "uvicorn", "zmq")


def _python(args: list[str]) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=120)


def test_chat_subcommand_streams_and_resets(monkeypatch, ckpt_factory, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n/reset\nhello\n"))
    path = str(ckpt_factory("qwen3"))
    argv = ["chat", path, "--device", "cpu", "--max-tokens", "5", "--temperature", "0"]  # MODEL positional
    assert main(argv) == 0
    out = capsys.readouterr().out
    turns = out.split(">>> ")[1:]  # the prompt before each line read, and once more before EOF
    assert len(turns) == 4, out
    assert "history cleared" in turns[1]
    # the same message after /reset gets the same (greedy) reply: the history really was cleared
    assert turns[0].strip() and turns[0] == turns[2], out


def test_help_is_fast_and_parsing_imports_no_engine():
    # best of three: the machine is shared, and one slow start says nothing about the imports
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        done = _python(["-m", "gapless", "serve", "--help"])
        best = min(best, time.perf_counter() - start)
        assert done.returncode == 0 and "--max-num-seqs" in done.stdout, done.stderr
    assert best < 1.0, f"gapless serve --help took {best:.2f} s"
    code = (
        "import sys\n"
        "from gapless.__main__ import parse_args\n"
        "parse_args(['serve', 'm', '--max-num-seqs', '4', '--dtype', 'half'])\n"
        "parse_args(['chat', 'm', '--temperature', '0'])\n"
        "try:\n    parse_args(['serve', '--max-num-seq', '4'])\nexcept SystemExit:\n    pass\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    done = _python(["-c", code])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


@pytest.mark.slow  # (a fresh interpreter importing torch and transformers: ~5 s)
def test_serves_own_process_imports_no_modeling_code():
    """What `gapless serve`'s own process imports to check its configuration and serve HTTP (the model's
    source and config, the process layout, the API) leaves transformers' modeling code out: it pulls in
    torch._dynamo, which took ~1.6 s of each server's start on 2 cores (the workers' fork server imports
    what they run, beside it)."""
    modules = (
        "gapless.server.launch", "gapless.engine.preflight", "gapless.model.source", "gapless.server.layout",
        "gapless.server.workers.scheduler_loop", "gapless.server.workers.sockets", "gapless.server.api",
    )  # fmt: skip
    code = "import importlib, sys\n"
    code += f"for m in {modules!r}:\n    importlib.import_module(m)\n"
    code += "print(sorted(m for m in ('transformers.modeling_utils', 'torch._dynamo') if m in sys.modules))\n"
    done = _python(["-c", code])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def test_vllm_and_sglang_flags_are_aliases():
    args = parse_args(
        ["serve", "/ckpt", "--max-num-seqs", "8", "--max-num-batched-tokens", "512"]
        + ["--gpu-memory-utilization", "0.6", "--no-enable-prefix-caching", "--context-length", "256"]
        + ["--max-total-tokens", "4096", "--block-size", "16", "--random-seed", "3", "--enforce-eager"]
        + [
            "--disable-overlap-schedule",
            "--dtype",
            "half",
            "--tensor-parallel-size",
            "1",
            "--disable-log-stats",
        ]
    )
    assert args.model_arg == "/ckpt" and args.log_stats_interval == 0.0
    assert engine_options(args) == {
        "max_running_requests": 8,
        "chunked_prefill_size": 512,
        "mem_fraction_static": 0.6,
        "radix_cache": False,
        "max_model_len": 256,
        "kv_cache_tokens": 4096,
        "page_size": 16,
        "seed": 3,
        "cuda_graph_max_bs": 0,
        "overlap": False,
        "dtype": "float16",
        "tensor_parallel_size": 1,
    }
    assert parse_args(["serve", "--tp", "2"]).tensor_parallel_size == 2
    assert parse_args(["serve", "-tp", "2"]).tensor_parallel_size == 2
    assert engine_options(parse_args(["serve", "--enable-prefix-caching", "--dtype", "float"])) == {
        "radix_cache": True,
        "dtype": "float32",
    }
    assert parse_args(["serve", "--model-path", "/a"]).model == "/a"
    assert parse_args(["serve", "--enable-log-requests"]).log_requests is True
    assert parse_args(["chat", "/a", "--disable-cuda-graph"]).cuda_graph_max_bs == 0
    pieces = parse_args(["serve", "--piecewise-cuda-graph-max-tokens", "512"])
    assert engine_options(pieces) == {"piecewise_cuda_graph_max_tokens": 512}
    assert parse_args(["serve", "--disable-piecewise-cuda-graph"]).piecewise_cuda_graph_max_tokens == 0


@pytest.mark.parametrize(
    "argv, said",
    [
        (["serve", "--max-num-seq", "4"], "unknown flag --max-num-seq; did you mean --max-num-seqs?"),
        (["serve", "--gpu-memory-utilisation=0.5"], "did you mean --gpu-memory-utilization?"),
        (["chat", "--temprature", "0"], "unknown flag --temprature; did you mean --temperature?"),
        (["serve", "--frobnicate"], "unknown flag --frobnicate (see gapless serve --help)"),
        (["serve", "--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
        (["serve", "--port", "http"], "argument --port: 'http' is not a port number (0 to 65535)"),
        (["serve", "--port", "70000"], "argument --port: '70000' is not a port number"),
        (["serve", "--max-tokens-default", "0"], "argument --max-tokens-default: '0' is not a whole number"),
        (["serve", "--request-timeout", "0"], "argument --request-timeout: '0' is not a number of seconds"),
        (
            ["serve", "--request-timeout", "nan"],
            "argument --request-timeout: 'nan' is not a number of seconds",
        ),
    ],
)
def test_argument_errors_show_the_subcommands_usage_and_one_line(argv, said, capsys):
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    usage, error = capsys.readouterr().err.strip().split("\n")
    assert usage == f"usage: gapless {argv[0]} [MODEL] [options]"
    assert error.startswith(f"gapless {argv[0]}: error: ") and said in error, error


def test_every_flag_has_help_and_each_option_its_own():
    """Every flag of both subcommands has help; an engine option's is its field's `metadata["help"]`."""
    _, subs = build_parser()
    for name, parser in subs.items():
        bare = [a.option_strings or [a.dest] for a in parser._actions if not a.help]
        assert not bare, f"gapless {name}: flags without help: {bare}"
    actions: dict[str, argparse.Action] = {}
    for a in subs["serve"]._actions:
        actions.setdefault(a.dest, a)  # the option's own flag, before its aliases
    for f in fields(EngineConfig):
        assert f.metadata.get("help"), f"EngineConfig.{f.name} has no help"
        if f.name != "model":
            shown = (actions[f.name].help or "").replace("%%", "%")
            assert f.metadata["help"] in shown, f.name
    assert (actions["seed"].help or "").startswith("draws the seeds of requests")


def test_flag_help_needs_no_source(tmp_path):
    """The help comes from the options' metadata, not from reading their source: with the package's
    config-level modules shipped as bytecode alone, every engine flag still prints its help."""
    import compileall

    pkg = tmp_path / "gapless"
    pkg.mkdir()
    for name in ("__init__.py", "config.py", "cli.py", "env.py"):
        shutil.copy(ROOT / "gapless" / name, pkg / name)
    assert compileall.compile_dir(str(pkg), quiet=1, legacy=True)
    for source in pkg.glob("*.py"):
        source.unlink()
    code = (
        "import argparse, dataclasses, gapless.cli as c, gapless.config as g\n"
        "assert g.__file__.endswith('.pyc') and c.__file__.endswith('.pyc')\n"
        "p = argparse.ArgumentParser(); c.add_engine_args(p)\n"
        "helps = {a.dest: a.help for a in reversed(p._actions)}\n"
        "names = [f.name for f in dataclasses.fields(g.EngineConfig) if f.name != 'model']\n"
        "print(sum(bool(helps[n]) for n in names), len(names))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    with_help, options = map(int, out.stdout.split())
    assert with_help == options > 40


def test_vllm_and_sglang_values_and_spellings_are_read_as_theirs():
    """vLLM's human-readable integers (32k = 32000, 32K = 32768), "None" for no format, underscored flags;
    SGLang's upper-case algorithm names and STANDALONE for a draft model; each server's parser names."""
    args = parse_args(
        ["serve", "/ckpt", "--max_model_len", "32k", "--speculative-algorithm", "STANDALONE", "-q", "None"]
        + ["--tool-call-parser", "llama3_json", "--reasoning-parser", "deepseek_r1", "--tokenizer-path", "t"]
        + ["--disable-log-requests"]
    )
    options = engine_options(args)
    assert options == {"max_model_len": 32000, "speculative_algorithm": "draft", "tokenizer": "t"}, options
    parsers = (args.tool_call_parser, args.reasoning_parser)
    assert parsers == ("llama3", "deepseek-r1") and args.log_requests is False
    for value, want in (("32K", 32768), ("1.5k", 1500), ("2048", 2048)):
        assert engine_options(parse_args(["serve", "--context-length", value]))["max_model_len"] == want
    sglang = parse_args(["serve", "--speculative-algorithm", "NGRAM", "--tool-call-parser", "qwen25"])
    assert engine_options(sglang)["speculative_algorithm"] == "ngram" and sglang.tool_call_parser == "qwen"


def test_vllms_speculative_config_sets_the_speculative_options():
    """vLLM's one flag for speculation, its JSON read as gapless's options (its own flags win); a method
    not built, a key not read or no JSON object is one error naming it."""

    def options(spec: str, *more: str) -> dict:
        return engine_options(parse_args(["serve", "/ckpt", "--speculative-config", spec, *more]))

    ngram = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'
    want = {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 3}
    assert options(ngram) == {**want, "ngram_min": 2, "ngram_max": 5}
    assert options(ngram, "--speculative-num-draft-tokens", "6")["speculative_num_draft_tokens"] == 6
    assert options('{"model": "/draft", "num_speculative_tokens": 2}') == {
        "speculative_algorithm": "draft",
        "speculative_draft_model": "/draft",
        "speculative_num_draft_tokens": 2,
    }
    for spec, said in (
        ('{"method": "eagle3", "model": "/e"}', "method 'eagle3' is not built here"),
        ('{"method": "ngram", "draft_tensor_parallel_size": 1}', "draft_tensor_parallel_size not read here"),
        ("ngram", "--speculative-config 'ngram': not a JSON object"),
    ):
        with pytest.raises(ValueError, match=said):
            options(spec)


def test_a_switch_that_turns_an_option_off_wins_over_its_value():
    """SGLang's `--disable-cuda-graph` and vLLM's `--enforce-eager` turn CUDA graphs off whatever
    `--cuda-graph-max-bs` says, before or after them, as in those servers; the value alone still sets it.
    Of a pair of switches of one option (vLLM's `--enable-prefix-caching` and its `--no-` form) the last
    wins, as vLLM reads them."""

    def options(*argv: str) -> dict:
        return engine_options(parse_args(["serve", "/ckpt", *argv]))

    assert options("--disable-cuda-graph", "--cuda-graph-max-bs", "8") == {"cuda_graph_max_bs": 0}
    assert options("--cuda-graph-max-bs", "8", "--enforce-eager") == {"cuda_graph_max_bs": 0}
    assert options("--cuda-graph-max-bs", "8") == {"cuda_graph_max_bs": 8}
    assert options("--no-enable-prefix-caching", "--enable-prefix-caching") == {"radix_cache": True}
    assert options("--enable-prefix-caching", "--no-enable-prefix-caching") == {"radix_cache": False}
    assert options("--disable-radix-cache", "--enable-prefix-caching") == {"radix_cache": True}
    args = parse_args(["serve", "/ckpt", "--disable-log-stats", "--log-stats-interval", "5"])
    assert args.log_stats_interval == 0.0


def test_their_switches_for_what_gapless_does_anyway_change_nothing():
    """vLLM's --enable-chunked-prefill, --enable-auto-tool-choice, --swap-space and SGLang's --enable-metrics
    are taken (a command line written for them runs) and set no option."""
    plain = parse_args(["serve", "/ckpt", "--tool-call-parser", "hermes"])
    theirs = parse_args(
        ["serve", "/ckpt", "--tool-call-parser", "hermes", "--enable-chunked-prefill", "--swap-space", "4"]
        + ["--enable-auto-tool-choice", "--enable-metrics"]
    )
    assert engine_options(theirs) == engine_options(plain) and theirs.tool_call_parser == "hermes"
    assert theirs.already_so == ["--enable-chunked-prefill", "--enable-auto-tool-choice", "--enable-metrics"]


def test_vllms_compilation_flags_are_taken_and_change_nothing():
    """vLLM's -O in each spelling (-O3, -O 3, -O.level=3, -O.level 3, JSON), --compilation-config and
    --optimization-level are taken and set no option: gapless captures its own CUDA graphs
    (--cuda-graph-max-bs) and runs no torch.compile on a GPU."""
    plain = engine_options(parse_args(["serve", "/ckpt", "--cuda-graph-max-bs", "8"]))
    for flags in (
        ["-O3"],
        ["-O", "3"],
        ["-O.level=3"],
        ["-O.level", "3"],
        ["-O", '{"level": 3}'],
        ["--compilation-config", '{"level": 3, "cudagraph_capture_sizes": [1, 2, 4]}'],
        ["--compilation-config.max_cudagraph_capture_size", "16"],
        ["--optimization-level", "2"],
        ["--uvicorn-log-level", "info"],  # (vLLM's own example config file has it)
    ):
        args = parse_args(["serve", "/ckpt", *flags, "--cuda-graph-max-bs", "8"])
        assert args.model_arg == "/ckpt" and engine_options(args) == plain, flags


def test_sglangs_chunked_prefill_size_minus_one_chunks_no_prompt(ckpt_factory):
    """SGLang's `--chunked-prefill-size -1` (no chunking): the prefill budget becomes the context length,
    the longest a prompt can be (`--max-model-len`, else the model's); any other value below 1 is refused."""
    from gapless.engine.preflight import check_engine_config

    ckpt = str(ckpt_factory("qwen3"))
    checked = check_engine_config(
        config_from_args(parse_args(["serve", ckpt, "--chunked-prefill-size", "-1"]))
    )
    longest = checked.model.max_position_embeddings
    assert (checked.cfg.chunked_prefill_size, checked.cfg.max_model_len) == (longest, longest)
    args = parse_args(["serve", ckpt, "--chunked-prefill-size", "-1", "--context-length", "100"])
    assert check_engine_config(config_from_args(args)).cfg.chunked_prefill_size == 100
    for value in ("-2", "0"):
        with pytest.raises(ValueError, match=f"chunked_prefill_size={value}: must be >= 1, or -1"):
            config_from_args(parse_args(["serve", ckpt, "--chunked-prefill-size", value]))


def test_a_config_file_gives_its_flags_as_the_command_line_would(tmp_path):
    """vLLM's and SGLang's `--config FILE`: each key a flag (dashed, underscored, an alias), true a switch,
    false its --no- form or nothing, a list a flag's words, a mapping its JSON; the command line's flags
    win over the file's, and a model named on the command line over the file's."""
    config = tmp_path / "config.yaml"
    config.write_text(
        "model: /from-file\nport: 9000\ntensor-parallel-size: 2\nmax_model_len: 32k\nenforce-eager: true\n"
        "enable-prefix-caching: false\ndisable-radix-cache: false\nserved-model-name: [a, b]\n"
        "speculative-config: {method: ngram, num_speculative_tokens: 3}\nenable-chunked-prefill: true\n"
        "chunked-prefill-size: 512\n"
    )
    args = parse_args(["serve", "--config", str(config), "--port", "9100", "--max-num-batched-tokens", "64"])
    assert (args.model, args.port, args.served_model_name) == ("/from-file", 9100, ["a", "b"])
    assert args.already_so == ["--enable-chunked-prefill"] and args.config == str(config)
    assert engine_options(args) == {
        "speculative_algorithm": "ngram",
        "speculative_num_draft_tokens": 3,
        "tensor_parallel_size": 2,
        "max_model_len": 32000,
        "cuda_graph_max_bs": 0,
        "radix_cache": False,
        "chunked_prefill_size": 64,
    }
    named = parse_args(["serve", "/cli", f"--config={config}"])
    assert chosen_model(named) == "/cli" and named.port == 9000
    assert chosen_model(parse_args(["serve", "--config", str(config), "--model-path", "/flag"])) == "/flag"
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert engine_options(parse_args(["serve", "--config", str(empty)])) == {}


def test_a_config_files_nulls_falses_lists_and_switches_read_as_vllm_reads_them(tmp_path):
    """null or blank: not set (vLLM's reading; a blank `api-key:` once required the key 'None'); false
    for a flag that takes a value: refused, not dropped; a list for a flag given once per value: one per
    item; a switch in the file that turns an option off yields to the command line's value for it."""
    config = tmp_path / "c.yaml"
    config.write_text("api-key:\ntokenizer: ~\nenable-prefix-caching: false\nenforce-eager: true\n")
    args = parse_args(["serve", "/ckpt", "--config", str(config)])
    assert args.api_key is None and args.tokenizer is None
    assert engine_options(args) == {"radix_cache": False, "cuda_graph_max_bs": 0}
    args = parse_args(["serve", "/ckpt", "--config", str(config), "--enable-prefix-caching"])
    assert engine_options(args) == {"radix_cache": True, "cuda_graph_max_bs": 0}
    args = parse_args(["serve", "/ckpt", "--config", str(config), "--cuda-graph-max-bs", "8"])
    assert engine_options(args) == {"radix_cache": False, "cuda_graph_max_bs": 8}
    config.write_text("stop: [a, b]\n")
    assert parse_args(["chat", "/ckpt", "--config", str(config)]).stop == ["a", "b"]
    config.write_text("served-model-name: no\n")  # (YAML 1.1's false)
    with pytest.raises(SystemExit):
        parse_args(["serve", "/ckpt", "--config", str(config)])


def test_a_bare_O_leaves_the_model_to_be_the_model():
    """vLLM's `-O` takes the next word only as a level (0-3) or JSON: `gapless serve -O /ckpt` serves
    /ckpt (it served the default model, /ckpt read as -O's value)."""
    from gapless.cli import chosen_model

    for argv in (["-O", "/ckpt"], ["-O", "3", "/ckpt"], ["/ckpt", "-O"], ["-O", '{"level": 3}', "/ckpt"]):
        assert chosen_model(parse_args(["serve", *argv])) == "/ckpt", argv


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (None, "No such file or directory"),
        ("- port\n- 9000\n", "not a YAML mapping of flags to values but a list"),
        ("port: [9000\n", "not valid YAML: "),
        ("port: http\n", "argument --port: 'http' is not a port number"),
        (
            "frob: 1\nmax-num-seq: 3\n",
            "unknown flags --frob (see gapless serve --help); --max-num-seq; did you",
        ),
        ("frob: false\n", "unknown flag --frob (see gapless serve --help)"),
        ("port: [9000, 9001]\n", "unexpected argument(s): 9001"),
        ("config: other.yaml\n", "names another config file (config: other.yaml)"),
    ],
)
def test_a_config_file_that_cannot_be_read_is_one_error_naming_it(tmp_path, text, said, capsys):
    config = tmp_path / "config.yaml"
    if text is not None:
        config.write_text(text)
    with pytest.raises(SystemExit) as exit:
        main(["serve", "/ckpt", "--config", str(config)])
    assert exit.value.code == 2
    usage, error = capsys.readouterr().err.strip().split("\n")
    assert usage == "usage: gapless serve [MODEL] [options]"
    assert error.startswith(f"gapless serve: error: --config {config}: ") and said in error, error


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        # every unknown flag at once, each with what to use here, or the nearest flag that turns nothing
        # the other way (--disable-log-foo is no --enable-log-requests)
        (
            ["--is-embedding", "--frob", "--max-num-seq", "2"],
            "unknown flags --is-embedding (SGLang's; here --task embed); --frob (see gapless serve --help); "
            "--max-num-seq; did you mean --max-num-seqs?",
        ),
        (["--no-enforce-eager"], "unknown flag --no-enforce-eager (the default here: leave it out)"),
        (
            ["--disable-custom-all-reduce"],
            "unknown flag --disable-custom-all-reduce (see gapless serve --help)",
        ),
        (
            ["--enable-hierarchical-cache"],
            "unknown flag --enable-hierarchical-cache (see gapless serve --help)",
        ),
        (["--max-model-len", "3.5K"], "invalid int value: '3.5K' (an integer: 4096, 4k, 4K)"),
    ],
)
def test_unknown_flags_are_all_named_with_what_to_use(argv, said, capsys):
    with pytest.raises(SystemExit):
        parse_args(["serve", *argv])
    error = capsys.readouterr().err.strip().split("\n")[-1]
    assert error.startswith("gapless serve: error: ") and said in error, error


def test_trust_remote_code_is_taken_with_a_warning_once(ckpt_factory, caplog):
    """vLLM's command lines carry --trust-remote-code: gapless runs its own implementation of the
    architecture as vLLM does where it has one, saying so once (the checked config no longer asks)."""
    from gapless.engine.preflight import check_engine_config

    cfg = config_from_args(parse_args(["serve", str(ckpt_factory("qwen3")), "--trust-remote-code"]))
    checked, _ = check_engine_config(cfg)
    assert not checked.trust_remote_code and "runs no code from a checkpoint" in caplog.text
    caplog.clear()
    check_engine_config(checked)
    assert "trust-remote-code" not in caplog.text


def test_the_serving_docs_name_every_alias():
    readme = (ROOT / "docs" / "serving.md").read_text()
    flags = [*FLAG_ALIASES, *(flag for names in _PARALLEL_FLAGS.values() for flag in names)]
    assert not [f for f in flags if f"`{f}`" not in readme], "docs/serving.md's alias table lacks some flags"


def _refused(argv: list[str], capsys) -> str:
    """Run `gapless ARGV`, which must refuse to start: status 2, one `gapless: ...` line, no process."""
    capsys.readouterr()  # (what came before: a checkpoint written for this worker prints its progress)
    before, start = descendants(os.getpid()), time.monotonic()
    assert main(argv) == 2
    assert time.monotonic() - start < 10
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(("gapless: ", "gapless chat: ")), err
    assert descendants(os.getpid()) <= before, "a process was started"
    return err


def test_serve_refuses_bad_arguments_before_starting_anything(tmp_path, ckpt_factory, capsys):
    assert "no config.json" in _refused(["serve", str(tmp_path)], capsys)
    ckpt = str(ckpt_factory("qwen3"))
    capsys.readouterr()  # the checkpoint's making may have written a progress bar
    assert "page_size=0" in _refused(["serve", "--model", ckpt, "--page-size", "0"], capsys)
    assert "two models given" in _refused(["serve", ckpt, "--model", str(tmp_path)], capsys)
    err = _refused(["serve", ckpt, "--pp-size", "2"], capsys)
    assert "pipeline parallelism is not supported yet (--pipeline-parallel-size 2)" in err
    # the tiny qwen3 has 4 attention heads: 3 ranks cannot split them
    err = _refused(["serve", ckpt, "--tp-size", "3"], capsys)
    assert "tensor_parallel_size=3: the model's num_attention_heads (4) is not divisible by it" in err


def test_several_served_names_need_the_model_named(ckpt_factory, capsys):
    """vLLM's `--served-model-name A B` takes every word after it: with no model named, the model's path
    written after it may have been taken for a name, so the server refuses rather than serve the default."""
    ckpt = str(ckpt_factory("qwen3"))
    capsys.readouterr()
    assert parse_args(["serve", ckpt, "--served-model-name", "a", "b"]).served_model_name == ["a", "b"]
    err = _refused(["serve", "--served-model-name", "a", ckpt], capsys)
    assert f"--served-model-name a {ckpt}: several names and no model named; name it first" in err, err


def test_serve_refuses_a_bad_environment_variable_by_name(ckpt_factory, capsys, monkeypatch):
    ckpt = str(ckpt_factory("qwen3"))
    capsys.readouterr()  # the checkpoint's making may have written a progress bar
    monkeypatch.setenv("GAPLESS_LOG_LEVEL", "loud")
    assert "GAPLESS_LOG_LEVEL='loud': not one of" in _refused(["serve", ckpt], capsys)
    monkeypatch.delenv("GAPLESS_LOG_LEVEL")
    monkeypatch.setenv("GAPLESS_DISABLE_OVERLAP", "maybe")
    assert "GAPLESS_DISABLE_OVERLAP='maybe': not a boolean" in _refused(["serve", ckpt], capsys)


def test_a_checkpoint_refused_as_the_worker_loads_it_ends_the_server_in_one_line(tmp_path, ckpt_factory):
    """The checks above read configs; a tensor that contradicts its config (here a packed AWQ weight
    stored as floats) is found as the scheduler worker loads it. The server then ends as a refusal does:
    status 2 and one line naming the tensor, its traceback only at debug level."""
    from safetensors.torch import load_file, save_file

    from gapless.testing.quant_checkpoints import write_quantized

    qdir, _ = write_quantized(ckpt_factory("qwen3"), tmp_path, "awq", group=32)
    tensors = load_file(str(qdir / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.qweight"
    tensors[name] = tensors[name].float()
    save_file(tensors, str(qdir / "model.safetensors"), metadata={"format": "pt"})
    done = _python(["-m", "gapless", "serve", str(qdir), "--device", "cpu", "--port", "0"])
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "failed to start" not in done.stderr, done.stderr
    assert "resource_tracker" not in done.stderr, done.stderr  # (the worker's exit is not cut short)
    assert f"gapless: {name}: float32 [" in done.stderr and "int32 words" in done.stderr, done.stderr


def test_an_unsupported_architecture_is_refused_by_name(tmp_path, ckpt_factory, capsys):
    ckpt = shutil.copytree(ckpt_factory("qwen3"), tmp_path / "gpt2")
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    for argv in (["serve", str(ckpt)], ["chat", str(ckpt)]):
        err = _refused(argv, capsys)
        assert "unsupported architecture 'GPT2LMHeadModel'" in err and "Qwen3ForCausalLM" in err, err


def test_a_device_this_machine_lacks_is_refused(ckpt_factory, capsys):
    # cuda:99 exists on no machine: without CUDA it says so, with it there is no 100th device
    err = _refused(["serve", str(ckpt_factory("qwen3")), "--device", "cuda:99"], capsys)
    assert err.startswith("gapless: device 'cuda:99': "), err


def test_a_port_in_use_is_refused_before_the_model_loads(ckpt_factory, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = _refused(["serve", str(ckpt_factory("qwen3")), "--port", str(port), "--device", "cpu"], capsys)
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use; another server runs there?" in err
