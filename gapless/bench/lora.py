"""Multi-LoRA throughput: a batch whose rows run 1, 4 or 16 distinct adapters against the base model alone,
on one engine.

    python -m gapless.bench.lora                                  # bench-size random qwen3 on the CPU
    python -m gapless.bench.lora --device cuda --size qwen3-0.6b --batch 64 --dtype bfloat16

The adapters are random PEFT adapters of rank `--rank` on every attention and MLP projection (q/k/v/o,
gate/up/down), made once per run (the first with `peft`, the others its copies with new weights). One
engine with `enable_lora` and `max_loras` >= the adapters runs every mode on the same prompts, greedily,
the modes alternating round by round so that a shared machine's load hits all alike; a mode's figure is
its output tokens over its seconds (prefill and decode) summed over the rounds.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from gapless import LLM, LoRARequest, SamplingParams
from gapless.bench import cli, timing

ADAPTER_COUNTS = (1, 4, 16)


def make_adapters(base: Path, out: Path, n: int, rank: int) -> list[LoRARequest]:
    """`n` random adapters of `base` on every projection: one made with peft, the rest copies of it with
    weights drawn anew."""
    from safetensors.torch import load_file, save_file

    from gapless.testing.lora import ATTENTION, MLP, make_adapter

    first = make_adapter(base, out / "lora-0", ATTENTION + MLP, r=rank, alpha=2 * rank, seed=0)
    tensors = load_file(str(first / "adapter_model.safetensors"))
    loras = [LoRARequest("lora-0", 1, str(first))]
    for i in range(1, n):
        path = out / f"lora-{i}"
        shutil.copytree(first, path)
        g = torch.Generator().manual_seed(i)
        fresh = {k: torch.randn(v.shape, generator=g) * 0.3 / v.shape[-1] ** 0.5 for k, v in tensors.items()}
        save_file(fresh, str(path / "adapter_model.safetensors"))
        loras.append(LoRARequest(f"lora-{i}", i + 1, str(path)))
    return loras


def _round(llm: LLM, prompts: list[list[int]], params: SamplingParams, loras: list) -> tuple[int, float]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    return sum(len(o.token_ids) for o in outs), time.perf_counter() - start


def measure(args: argparse.Namespace) -> dict[str, Any]:
    path, _ = cli.model_path(args, args.dtype)
    g = torch.Generator().manual_seed(0)
    options = dict(device=args.device, dtype=args.dtype, enable_lora=True, max_running_requests=args.batch)
    options |= dict(max_loras=max(ADAPTER_COUNTS), max_lora_rank=args.rank, **args.engine_options)
    with tempfile.TemporaryDirectory() as tmp:
        cli.progress(f"making {max(ADAPTER_COUNTS)} adapters of rank {args.rank}")
        loras = make_adapters(path, Path(tmp), max(ADAPTER_COUNTS), args.rank)
        llm = LLM(str(path), **options)
        vocab = llm.engine.vocab_size
        prompts = [
            torch.randint(3, vocab, (args.input_len,), generator=g).tolist() for _ in range(args.batch)
        ]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        modes: dict[str, list] = {"base": [None] * args.batch}
        modes |= {f"{n} adapters": [loras[i % n] for i in range(args.batch)] for n in ADAPTER_COUNTS}
        for mode in modes.values():  # warm-up: reads every adapter once, and the kernels' first launches
            _round(llm, prompts[: len(loras)], SamplingParams(max_tokens=2), mode[: len(loras)])
        totals = {name: [0, 0.0] for name in modes}
        for r in range(args.rounds):
            for name, mode in modes.items():
                tokens, seconds = _round(llm, prompts, params, mode)
                totals[name][0] += tokens
                totals[name][1] += seconds
                cli.progress(f"round {r + 1}: {name}: {tokens / seconds:.1f} output tok/s")
        profiles = {name: _profile(llm, prompts, params, modes[name], args.device) for name in args.profile}
        llm.shutdown()
    tok_s = {name: n / s for name, (n, s) in totals.items()}
    return dict(
        command=cli.command_line("gapless.bench.lora", sys.argv[1:]),
        machine=cli.machine(args.device),
        model=str(args.model or f"random qwen3 ({args.size})"),
        dtype=args.dtype,
        rank=args.rank,
        batch=args.batch,
        input_len=args.input_len,
        max_tokens=args.max_tokens,
        rounds=args.rounds,
        tok_s=tok_s,
        vs_base={name: v / tok_s["base"] for name, v in tok_s.items()},
        profiles=profiles,
    )


def _profile(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, mode: list, device: str
) -> list[tuple[str, float, int]]:
    """One more round of `mode` under torch.profiler: its 15 costliest ops by self device time (CPU time
    on a CPU), as (name, ms, calls)."""
    ops = timing.op_times(lambda: _round(llm, prompts, params, mode), device)
    top = sorted(ops.items(), key=lambda kv: kv[1][0], reverse=True)[:15]
    return [(name[:90], us / 1e3, calls) for name, (us, calls) in top]


def report(res: dict[str, Any]) -> list[str]:
    rows = [(name, f"{v:.1f}", f"{res['vs_base'][name]:.2f}x") for name, v in res["tok_s"].items()]
    return [
        res["command"],
        cli.machine_line(res["machine"]),
        f"model {res['model']} ({res['dtype']}), batch {res['batch']} x {res['input_len']} prompt tokens, "
        f"{res['max_tokens']} output tokens each, LoRA rank {res['rank']} on q/k/v/o and gate/up/down, "
        f"{res['rounds']} rounds",
        *cli.markdown_table(["rows run", "output tok/s", "vs base"], rows, "lrr"),
        *(
            line
            for name, top in res["profiles"].items()
            for line in (
                f"\n{name}, one round profiled, costliest ops:",
                *cli.markdown_table(["op", "ms", "calls"], [(k, f"{ms:.2f}", n) for k, ms, n in top], "lrr"),
            )
        ),
    ]


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    cli.add_model_args(p, "bench", ("tiny", "bench", "qwen3-0.6b"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", help="float32 (default) or bfloat16")
    p.add_argument("--batch", type=cli.positive_int, default=16, help="requests run together (default 16)")
    p.add_argument("--input-len", type=cli.positive_int, default=64, help="prompt tokens (default 64)")
    p.add_argument("--max-tokens", type=cli.positive_int, default=64, help="output tokens (default 64)")
    p.add_argument("--rank", type=cli.positive_int, default=16, help="the adapters' rank (default 16)")
    p.add_argument("--rounds", type=cli.positive_int, default=2)
    p.add_argument(
        "--profile",
        nargs="*",
        default=[],
        metavar="MODE",
        help='after the rounds, profile one more of each mode named ("base", "16 adapters")',
    )
    p.add_argument("--json", help="also write the results here")
    cli.add_engine_option_arg(p.add_argument_group("engine"), "e.g. page_size=16")
    args = p.parse_args(argv)
    modes = ["base", *(f"{n} adapters" for n in ADAPTER_COUNTS)]
    if bad := [m for m in args.profile if m not in modes]:
        p.error(f"--profile: unknown mode(s) {bad}; the modes are {modes}")
    cli.take_engine_options(p, args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    res = measure(args)
    print("\n".join(report(res)))
    if args.json:
        cli.write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
