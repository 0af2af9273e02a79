"""TPOT at batch 1 of quantized weights against bf16, on a model's shape with random weights.

    python -m gapless.bench.quant make DIR      # DIR/qwen3-0.6b, qwen3-8b, ...: config + tokenizer
    python -m gapless.bench.quant run DIR/qwen3-8b --engine-option quantization=fp8 --json r.json
    python -m gapless.bench.quant run DIR/qwen3-8b-awq --json r.json       # int4 w4a16, AWQ g128
    python -m gapless.bench.quant report r1.json r2.json ...   # each run's TPOT and its ratio to bf16's
    python -m gapless.bench.quant gguf DIR/qwen3-8b [Q4_K_M]  # DIR/qwen3-8b-gguf/model.Q4_K_M.gguf
    python -m gapless.bench.quant run DIR/qwen3-8b-gguf --engine-option load_format=auto --json r.json

`make` writes each shape's config.json (Qwen3-0.6B's, Qwen3-8B's and the mixture Qwen3-30B-A3B's
published values) and the built-in tokenizer, no weights, and for each shape a `-awq` twin whose config
carries an AWQ int4 g128 `quantization_config` (the common int4 layout; every int4/int8 layout runs the
same GEMM), for the 8B and the mixture a `-gptq-act` twin, GPTQ int4 g128 with act-order (the same
GEMMs, x's columns in each layer's order: gathered for o and by the grouped GEMM for the experts' gate/up,
written so by the fused kernels for q/k/v and gate/up; down's order on gate/up's rows), and for the 0.6B an
`-int8` twin, GPTQ int8 per channel, and an `-int8-g128` one, in groups of 128 (Qwen's `*-GPTQ-Int8`);
for the 0.6B and the 8B an `-fp8` twin, Qwen's own `*-FP8` layout (e4m3, a scale per [128, 128] block),
and an `-nf4` twin, bitsandbytes NF4 (unsloth's `*-bnb-4bit`), its random weights NF4's in blocks of 64;
for the 8B an `-nvfp4` twin, ModelOpt's NVFP4 (FP4 codes in groups of 16, run weight-only).
`run` loads it with `load_format=dummy` (random weights made on the device, in the int4 form where the
config says so, e4m3 where it is FP8's, none read: a 16 GB checkpoint is neither built nor read) in
bfloat16, on CUDA graphs at batch 1, and times one request at a time: a 128-token prompt generating 1
token (its prefill) and generating 1 + `--tokens` (default 64); TPOT = the difference / `--tokens`, the
median of `--repeats` (default 3) after a warm-up, and the prefill's time (the one-token request's: a
mixture's 128 x top-k routed entries take the grouped GEMM's 64-row tiles, where FP8 experts multiply on
fp8's tensor cores). `--profile` then runs both once more under
torch.profiler: each kernel's device time a token (the same difference over `--tokens`), and their sum
against TPOT (the rest: the device idle between kernels, or the host behind it).
`gguf` writes a shape as a GGUF file of random weights (`gapless.testing.gguf_files.write_random_gguf`:
by default llama.cpp's Q4_K_M mix of Q4_K and Q6_K matrices, ~4.8 GB for the 8B), which `run` reads like
a real file with `--engine-option load_format=auto` (a GGUF's projections on the int4/int8 path on a GPU).
`--engine-option` adds an engine option (quantization=fp8: the bf16 weights quantized at load, one scale
per row). Each run in its own process, so the GPU holds one model at a time (bench/gpu_quant.sh).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from gapless import env
from gapless.bench import cli, timing

# over the qwen3-0.6b size (`gapless.testing.checkpoints`, which holds what Qwen3's published configs
# share: head dim, vocabulary, RoPE, norm epsilon), the larger models' untied head
_QWEN3 = dict(tie_word_embeddings=False)
# Qwen/Qwen3-8B's config.json (hidden 4096, 36 layers, 32 q / 8 kv heads of 128, MLP 12288, untied head)
QWEN3_8B = dict(
    _QWEN3,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
)
# Qwen/Qwen3-30B-A3B's (hidden 2048, 48 layers of 128 experts, 8 routed a token, expert MLP 768; ~61 GB
# in bf16: an H200, or an H100 for fp8 and barely for bf16)
QWEN3_30B_A3B = dict(
    _QWEN3,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    mlp_only_layers=[],
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
)
# shape -> (architecture, its config's values over the qwen3-0.6b size)
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-0.6b": ("qwen3", {}),
    "qwen3-8b": ("qwen3", QWEN3_8B),
    "qwen3-30b-a3b": ("qwen3_moe", QWEN3_30B_A3B),
}
_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# the quantized twins (suffix -> quantization_config, the shapes given one): AutoAWQ's GEMM layout, 4 bits,
# groups of 128, zero points; GPTQ's with act-order (desc_act), the same sizes; GPTQ's int8, one group a row
# and in groups of 128 (Qwen's own *-GPTQ-Int8) (the 0.6B's: the CPU's kernels, bench/results/int4_cpu);
# Qwen's own *-FP8, e4m3 with a scale per [128, 128] block (the targets' other FP8 runs quantize the bf16
# weights at load, one scale a row)
AWQ_G128 = dict(quant_method="awq", bits=4, group_size=128, zero_point=True, version="gemm")
GPTQ_ACT_G128 = dict(quant_method="gptq", bits=4, group_size=128, sym=True, desc_act=True)
# GPTQModel's `lm_head: true`: the LM head in 4 bits too (Qwen3-8B's: 1.24 GB in bf16, ~0.3 in int4)
GPTQ_HEAD_G128 = dict(quant_method="gptq", bits=4, group_size=128, sym=True, desc_act=False, lm_head=True)
GPTQ_INT8 = dict(quant_method="gptq", bits=8, group_size=-1, sym=True, desc_act=False)
GPTQ_INT8_G128 = {**GPTQ_INT8, "group_size": 128}
FP8_BLOCK = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[128, 128])
# ModelOpt's NVFP4 (`nvidia/*-FP4`): FP4 codes in groups of 16, run weight-only on a Hopper GPU
MODELOPT_NVFP4 = dict(quant_method="modelopt", quant_algo="NVFP4", group_size=16)
# unsloth's `*-bnb-4bit` (bitsandbytes NF4, double-quantized): kept in 4 bits where a kernel takes them
BNB_NF4 = dict(
    quant_method="bitsandbytes",
    load_in_4bit=True,
    bnb_4bit_quant_type="nf4",
    bnb_4bit_use_double_quant=True,
    bnb_4bit_compute_dtype="bfloat16",
)
TWINS = {
    "-awq": (AWQ_G128, ("qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b")),
    "-gptq-act": (GPTQ_ACT_G128, ("qwen3-8b", "qwen3-30b-a3b")),
    "-gptq-head": (GPTQ_HEAD_G128, ("qwen3-0.6b", "qwen3-8b")),
    "-int8": (GPTQ_INT8, ("qwen3-0.6b",)),
    "-int8-g128": (GPTQ_INT8_G128, ("qwen3-0.6b",)),
    "-fp8": (FP8_BLOCK, ("qwen3-0.6b", "qwen3-8b")),
    "-nf4": (BNB_NF4, ("qwen3-0.6b", "qwen3-8b")),
    "-nvfp4": (MODELOPT_NVFP4, ("qwen3-8b",)),
}
PROMPT_LEN = 128


GGUF_SUFFIX = "-gguf"  # (the directory `gguf` writes a shape's file into)


def _shape_of(name: str) -> str:
    """The bf16 shape a (twin's, or GGUF file's) directory name is of."""
    return next((name.removesuffix(s) for s in (*TWINS, GGUF_SUFFIX) if name.endswith(s)), name)


def gguf_file(shape: Path, qtype: str) -> Path:
    """`shape`'s directory as a GGUF file of random weights in `qtype` (the module's docstring), in a
    directory of its own beside it."""
    from gapless.testing.gguf_files import write_random_gguf

    out = shape.parent / f"{shape.name}{GGUF_SUFFIX}"
    out.mkdir(exist_ok=True)
    return write_random_gguf(shape, out / f"model.{qtype}.gguf", qtype)


def make(out: Path) -> list[Path]:
    """Each shape's weightless checkpoint directory under `out`."""
    from gapless.default_model.tokenizer import build_tokenizer
    from gapless.testing.checkpoints import model_config

    made = []
    for name, (arch, overrides) in SHAPES.items():
        path = out / name
        path.mkdir(parents=True, exist_ok=True)
        cfg = model_config(arch, "qwen3-0.6b", **overrides)
        cfg.architectures = [_ARCHITECTURES[arch]]  # (a model's save_pretrained writes it)
        cfg.save_pretrained(path)
        build_tokenizer().save_pretrained(path)
        made.append(path)
        for suffix, (qc, shapes) in TWINS.items():
            if name in shapes:
                twin = out / f"{name}{suffix}"
                shutil.copytree(path, twin, dirs_exist_ok=True)
                config = json.loads((path / "config.json").read_text()) | {"quantization_config": qc}
                (twin / "config.json").write_text(json.dumps(config, indent=2))
                made.append(twin)
    return made


KERNEL_VARIABLES = ("GAPLESS_FP8_", "GAPLESS_INT4_", "GAPLESS_PDL", "GAPLESS_DECODE_")


def run(
    path: Path,
    options: dict[str, Any],
    tokens: int,
    repeats: int,
    device: str = "cuda",
    profile: bool = False,
) -> dict[str, Any]:
    """One engine on `path`'s shape with random weights: its TPOT at batch 1, and with `profile` its
    `timing.decode_profile` (see the module's docstring)."""
    import torch

    from gapless import LLM, SamplingParams

    opts: dict[str, Any] = dict(
        device=device,
        dtype="bfloat16" if device.startswith("cuda") else "float32",
        load_format="dummy",
        cuda_graph_max_bs=1,
        max_model_len=1024,
        kv_cache_tokens=4096,
        radix_cache=False,
    )
    opts.update(options)
    prompt = [[(7 * i + 3) % 1000 + 10 for i in range(PROMPT_LEN)]]

    def timed(n: int) -> float:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        return time.perf_counter() - t0

    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    with LLM(str(path), **opts) as llm:
        # the most the load, the KV pool and the CUDA graphs' capture held at once (a quantized model's
        # layers never hold their float weights: `layers.deferred_weights`)
        start_peak = round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if cuda else None
        timed(1 + tokens)  # warm-up: kernels compiled, graphs replayed once
        pairs = [(timed(1 + tokens), timed(1)) for _ in range(repeats)]  # (long, then short, as before)
        tpots = [(long - short) / tokens for long, short in pairs]
        info = llm.engine.info
        prof = timing.decode_profile(timed, tokens, device) if profile else None
    # the kernel choices the environment made for this run (every variable of the quantized layers' kernels,
    # of PDL and of the decode kernel), where not the defaults
    chosen = [v for name, v in env.VARIABLES.items() if name.startswith(KERNEL_VARIABLES)]
    kernels = {v.name: v.get() for v in chosen if v.get() != v.default}
    return dict(
        shape=_shape_of(path.name),  # (an int4 twin's ratio is to its bf16 shape's)
        options=options,
        weights=info.weights,
        start_peak_gib=start_peak,
        quantization=info.quantization,
        tpot_ms=statistics.median(tpots) * 1e3,
        tpot_ms_all=[t * 1e3 for t in tpots],
        prefill_ms=statistics.median(short for _, short in pairs) * 1e3,
        machine=cli.machine(device),
        kernels=kernels,
        profile=prof,
    )


def report(results: list[dict[str, Any]]) -> str:
    """A table of each run's TPOT and prefill time, each with its ratio to the bf16 run of the same shape
    (a run from before the prefill was recorded: n/a)."""
    bf16 = [r for r in results if not r["quantization"]]
    base = {(r["shape"], key): r.get(key) for r in bf16 for key in ("tpot_ms", "prefill_ms")}
    rows = []
    for r in results:
        cells = []
        for key, digits in (("tpot_ms", 3), ("prefill_ms", 1)):
            ref, ms = base.get((r["shape"], key)), r.get(key)
            cells += [f"{ms:.{digits}f}" if ms else "n/a", f"{ms / ref:.2f}" if ms and ref else "n/a"]
        peak = f"; start-up peak {r['start_peak_gib']} GiB" if r.get("start_peak_gib") is not None else ""
        rows.append((r["shape"], _weights(r), *cells, r["weights"] + peak))
    header = ("shape", "weights", "TPOT ms (batch 1)", "ratio to bf16", "prefill ms (128 tokens)", "ratio")
    lines = cli.markdown_table((*header, "start-up line"), rows, "llrrrrl")
    if results:
        lines.insert(0, cli.machine_line(results[0]["machine"]))
    for r in results:
        lines += _profile_lines(r)
    return "\n".join(lines)


def _weights(r: dict[str, Any]) -> str:
    """A run's format, with the kernel choices its environment made (`GAPLESS_FP8_DECODE=fp16`)."""
    chosen = " ".join(f"{name}={value}" for name, value in r.get("kernels", {}).items())
    return f"{r['quantization'] or 'bf16'}{f' ({chosen})' if chosen else ''}"


def _profile_lines(r: dict[str, Any]) -> list[str]:
    """A run's `decode_profile` as a table, under a line of its kernels' sum against TPOT."""
    prof = r.get("profile")
    if not prof:
        return []
    tpot_us = r["tpot_ms"] * 1e3
    busy = prof["us_per_step"]
    name = f"{r['shape']} {_weights(r)}"
    kinds = ", ".join(f"{kind} {us:.0f}" for kind, us in prof["kinds"].items())
    return [
        f"\n{name}: kernels {busy:.0f} us a token of TPOT's {tpot_us:.0f} ({busy / tpot_us:.0%}; the rest "
        f"idle between kernels or waiting on the host): {kinds}",
        *timing.profile_table(prof, "token"),
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gapless.bench.quant", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("make").add_argument("dir", type=Path)
    r = sub.add_parser("run")
    r.add_argument("path", type=Path)
    r.add_argument("--tokens", type=cli.positive_int, default=64)
    r.add_argument("--repeats", type=cli.positive_int, default=3)
    r.add_argument("--json", type=Path)
    r.add_argument("--device", default="cuda", help="cuda (cpu: float32, a smoke test of the command)")
    r.add_argument("--profile", action="store_true", help="then each kernel's time a token (torch.profiler)")
    cli.add_engine_option_arg(
        r.add_argument_group("engine"), "extra LLM option, repeatable (quantization=fp8)"
    )
    sub.add_parser("report").add_argument("json", type=Path, nargs="+")
    g = sub.add_parser("gguf")
    g.add_argument("shape", type=Path)
    g.add_argument("qtype", nargs="?", default="Q4_K_M")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.cmd == "run":
        cli.take_engine_options(r, args)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.cmd == "make":
        print("\n".join(str(x) for x in make(args.dir)))
    elif args.cmd == "run":
        res = run(args.path, args.engine_options, args.tokens, args.repeats, args.device, args.profile)
        print(
            f"{res['shape']} {res['quantization'] or 'bf16'}: TPOT {res['tpot_ms']:.3f} ms, prefill "
            f"{res['prefill_ms']:.1f} ms; {res['weights']}"
        )
        if args.json:
            cli.write_json(args.json, res)
    elif args.cmd == "gguf":
        print(gguf_file(args.shape, args.qtype))
    else:
        print(report([json.loads(f.read_text()) for f in args.json if f.is_file()]))


if __name__ == "__main__":
    main()
