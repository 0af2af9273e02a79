"""What `python -m gapless.bench.gpu` runs and reports: its runs (how each samples, overlap or not), the
derived figures of a run (idle fraction, ms per step, decode bytes read against a copy), the ratios, and
the markdown table."""

from __future__ import annotations

import dataclasses
from typing import Any

from gapless.bench import cli, timing


@dataclasses.dataclass(frozen=True)
class Run:
    """One gapless run of the workload: its table label, the engine's `overlap`, and how it samples (the
    `SamplingParams` fields besides `max_tokens` and `ignore_eos`)."""

    label: str
    overlap: bool
    sampling: dict[str, Any]


GREEDY: dict[str, Any] = dict(temperature=0.0)
# Qwen3's generation_config.json: what a user of a Qwen3 checkpoint samples with by default
QWEN3_DEFAULTS: dict[str, Any] = dict(temperature=0.6, top_k=20, top_p=0.95)
# result key -> run, in the order they run: nano-vllm's and Mini-SGLang's bench.py first (temperature 0.6)
RUNS: dict[str, Run] = {
    "sampled": Run("gapless, temperature 0.6", True, dict(temperature=0.6)),
    "greedy": Run("gapless, greedy", True, GREEDY),
    "qwen3": Run("gapless, Qwen3 defaults (t 0.6, top-k 20, top-p 0.95)", True, QWEN3_DEFAULTS),
    "plain": Run("gapless, greedy, no overlap", False, GREEDY),
}
LABELS = {**{k: r.label for k, r in RUNS.items()}, "transformers": "transformers generate (greedy)"}
# Published anchors the issue compares with (nano-vllm's README, A800), and the targets at temperature 0.6.
ANCHORS = "vLLM 0.10.2 8,588 tok/s and nano-vllm's Triton variant 10,009 tok/s on an A800"
TARGET_TOK_S = {"H200": 28_000, "H100": 20_000}
TARGET_IDLE = 0.02


def derive(g: dict[str, Any], info: dict[str, Any], kv_read_tokens: int, copy_tb_s: float | None) -> None:
    """Idle fraction, per-step times and the bytes decode read (against `copy_tb_s`, a device copy's
    bandwidth measured in the same run), added to a `run_gapless` result."""
    busy, idle, host = g.get("device_busy_s"), g.get("device_idle_s"), g.get("host_s")
    steps = g.get("steps") or 0
    # The meter's idle: gaps between consecutive jobs while requests were pending. On CUDA each job's
    # duration comes from its events (exact), placed on the host clock where the host's wait returned, so
    # the gaps lean on when the host looked; busy / wall needs no placement (jobs run one at a time on the
    # forward stream) and bounds the idle share from above (it also counts the first launch and last wait).
    g["busy_fraction_of_wall"] = busy / g["wall_s"] if busy is not None and g["wall_s"] else None
    g["device_idle_fraction"] = (
        idle / (busy + idle) if busy is not None and idle is not None and busy + idle else None
    )
    g["host_ms_per_step"] = 1e3 * host / steps if host is not None and steps else None
    g["device_ms_per_step"] = 1e3 * busy / steps if busy is not None and steps else None
    g["kv_pool_gib"] = round(g["kv_pool_tokens"] * info["kv_bytes_per_token"] / 2**30, 2)
    read = kv_read_tokens * info["kv_bytes_per_token"] + g["decode_batches"] * info["weight_bytes"]
    g["decode_bytes_read"] = read
    g["decode_read_tb_per_s"] = read / 1e12 / g["wall_s"]  # a lower bound: the wall time includes prefill
    # the copy's TB/s counts the bytes it read and wrote, as `gapless.bench.kernels` compares attention
    g["decode_read_vs_copy"] = g["decode_read_tb_per_s"] / copy_tb_s if copy_tb_s else None
    # the decode jobs' own device time (the meter splits it by kind): each step's, and what they read in it
    meter = g.get("meter") or {}
    decode_s, decode_steps = meter.get("decode_device_s"), meter.get("decode_steps")
    g["decode_device_ms_per_step"] = 1e3 * decode_s / decode_steps if decode_s and decode_steps else None
    g["decode_read_tb_per_device_s"] = read / 1e12 / decode_s if decode_s else None


def target_tok_s(machine: dict[str, Any]) -> int | None:
    """The issue's target at temperature 0.6 for this machine's GPU (None: not an H100 or H200)."""
    gpu = machine.get("gpu") or ""
    return next((t for name, t in TARGET_TOK_S.items() if name in gpu), None)


def ratios(res: dict[str, Any]) -> dict[str, float | None]:
    def tok_s(key: str) -> float | None:
        r = res.get(key)
        return None if r is None or "error" in r else r["output_tokens_per_s"]

    s, o, q, p, h = (tok_s(k) for k in ("sampled", "greedy", "qwen3", "plain", "transformers"))
    return dict(
        sampled_vs_greedy=s / o if s and o else None,
        qwen3_vs_greedy=q / o if q and o else None,
        overlap_vs_plain=o / p if o and p else None,
        gapless_vs_transformers=o / h if o and h else None,
        plain_vs_transformers=p / h if p and h else None,
    )


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.2f}%"


def _sub1(x: float | None) -> float | None:
    return None if x is None else 1 - x


def _num(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def _failed_row(key: str, r: dict[str, Any]) -> list[str]:
    return [LABELS[key], *[""] * 8, f"FAILED: {r['error_line']}"]


def _gapless_row(key: str, g: dict[str, Any]) -> list[str]:
    vs_copy = g.get("decode_read_vs_copy")
    notes = (
        f"attention {g['attention_backend'] or '?'}; KV pool {g['kv_pool_tokens']:,} tokens "
        f"({g['kv_pool_gib']} GiB); {g['retractions']} retractions; decode read "
        f"{g['decode_bytes_read'] / 1e12:.1f} TB, {g['decode_read_tb_per_s']:.2f} TB/s"
        + ("" if vs_copy is None else f" ({vs_copy:.0%} of copy)")
    )
    if g.get("decode_device_ms_per_step"):
        notes += (
            f"; decode {g['decode_device_ms_per_step']:.2f} ms of device time a step, reading "
            f"{g['decode_read_tb_per_device_s']:.2f} TB/s"
        )
    if g.get("peak_gib") is not None:
        notes += f"; peak {g['peak_gib']} GiB"
    if g.get("triton_compiles"):  # (each one seconds of host time the warm-up should have taken)
        notes += f"; {len(g['triton_compiles'])} Triton compiles in the timed run"
    return [
        LABELS[key],
        str(g["requests"]),
        f"{g['output_tokens']:,}",
        f"{g['wall_s']:.2f}",
        f"{g['output_tokens_per_s']:,.0f}",
        f"{pct(g['device_idle_fraction'])} ({pct(_sub1(g['busy_fraction_of_wall']))})",
        _num(g["host_ms_per_step"], ".2f"),
        _num(g["device_ms_per_step"], ".2f"),
        f"{g['steps']} ({g['prefill_batches']} + {g['decode_batches']})",
        notes,
    ]


def _transformers_row(h: dict[str, Any]) -> list[str]:
    return [
        LABELS["transformers"],
        f"{h['requests']} (the first {h['requests']})",
        f"{h['output_tokens']:,}",
        f"{h['wall_s']:.2f}",
        f"{h['output_tokens_per_s']:,.0f}",
        *["n/a"] * 4,
        f"sdpa, {h['dtype']}; {h['batches']} left-padded static batch(es) of {h['batch_size']}; "
        f"{h['wasted_output_fraction']:.0%} of decoded tokens past their request's length",
    ]


def _rows(res: dict[str, Any]) -> list[list[str]]:
    """The table's rows: each gapless run and transformers, or the error that stopped one."""
    rows = []
    for key in (*RUNS, "transformers"):
        r = res.get(key)
        if r is None:
            continue
        if "error" in r:
            rows.append(_failed_row(key, r))
        else:
            rows.append(_transformers_row(r) if key == "transformers" else _gapless_row(key, r))
    return rows


def _verdict(res: dict[str, Any]) -> list[str]:
    """The ratios, the target check and any wrong-length warning, under the table."""
    lines = []
    r = res["ratios"]
    named = {
        "sampled_vs_greedy": "temperature 0.6 / greedy",
        "qwen3_vs_greedy": "Qwen3 defaults / greedy",
        "overlap_vs_plain": "overlap / no overlap (greedy)",
    }
    lines += [f"**{name}: {r[k]:.2f}x** output tokens/s" for k, name in named.items() if r.get(k) is not None]
    if r.get("gapless_vs_transformers") is not None:
        lines.append(
            f"**gapless (greedy, overlap) / transformers: {r['gapless_vs_transformers']:.1f}x** output "
            "tokens/s (transformers on its slice)"
        )
    g, target = res.get("sampled"), target_tok_s(res["machine"])
    if g is not None and "error" not in g:
        idle = g["device_idle_fraction"]
        met = target is not None and g["output_tokens_per_s"] >= target and idle is not None
        met = met and idle <= TARGET_IDLE
        aim = "no target for this device" if target is None else f">= {target:,} tok/s"
        lines.append(
            f"\nanchors: {ANCHORS}; target at temperature 0.6 (H200 >= {TARGET_TOK_S['H200']:,}, H100 >= "
            f"{TARGET_TOK_S['H100']:,} tok/s, GPU idle <= {TARGET_IDLE:.0%}): {aim}, "
            f"{'met' if met else 'NOT met'} here ({g['output_tokens_per_s']:,.0f} tok/s, {pct(idle)} idle)"
        )
    for key in RUNS:
        g = res.get(key)
        if g is not None and "error" not in g and g["wrong_length_requests"]:
            lines.append(
                f"\nWARNING ({key}): {g['wrong_length_requests']} requests did not get their length "
                f"({g['output_tokens']} tokens generated, {g['requested_output_tokens']} requested)"
            )
    return lines


def format_report(res: dict[str, Any]) -> str:
    """The markdown the command prints, ready for the README."""
    w, mi = res["workload"], res["model_info"]
    on_gpu = "gpu" in res["machine"]
    idle_name = "GPU idle" if on_gpu else "device idle"
    header = (
        "engine",
        "requests",
        "output tokens",
        "wall s",
        "output tok/s",
        f"{idle_name} (1 - busy/wall)",
        "host ms/step",
        "device ms/step",
        "steps (prefill + decode)",
        "notes",
    )
    copy = res.get("copy_tb_s")
    lines = [
        f"## Offline throughput{' on the GPU' if on_gpu else ''}: nano-vllm's workload (ignore_eos)",
        "",
        f"command: `{res['command']}`",
        cli.machine_line(res["machine"]),
        f"model: {res['model_name']}: {mi['num_hidden_layers']} layers, hidden {mi['hidden_size']}, "
        f"{mi['num_attention_heads']} q / {mi['num_key_value_heads']} kv heads x {mi['head_dim']}, vocab "
        f"{mi['vocab_size']}; {mi['params'] / 1e6:.0f}M parameters, random weights, {mi['dtype']} "
        f"({mi['weight_bytes'] / 1e9:.2f} GB, {mi['kv_bytes_per_token'] / 1024:.0f} KiB of "
        f"{mi.get('kv_cache_dtype', mi['dtype'])} KV per token)",
        f"{cli.workload_line(w)}; decode reads "
        f"{w['decode_kv_tokens_read'] * mi['kv_bytes_per_token'] / 1e12:.2f} TB of KV"
        + ("" if copy is None else f"; a device copy in this run: {copy:.2f} TB/s (read + written)"),
        "",
        *cli.markdown_table(header, _rows(res), "lrrrrrrrll"),
        "",
        f"{idle_name}: the engine's bubble meter, gaps between forward jobs while requests were pending over "
        "busy + gaps; in brackets 1 - (summed job time / wall), which also counts the first launch and the "
        "last wait. host ms/step: scheduling, batch building and result processing, waits excluded. "
        "decode read: KV and weights over the wall time (prefill included: a lower bound).",
        "",
        *_verdict(res),
        *_profiles(res),
    ]
    return "\n".join(lines)


def _profiles(res: dict[str, Any]) -> list[str]:
    """Each gapless run's `kernel_profile` (`--profile-steps`), a table under a line of its kinds."""
    lines = []
    for key in RUNS:
        prof = (res.get(key) or {}).get("kernel_profile")
        if prof:
            kinds = ", ".join(f"{kind} {us:.0f}" for kind, us in prof["kinds"].items())
            lines += [
                "",
                f"{LABELS[key]}: kernels {prof['us_per_step']:.0f} us a decode step of every request at once "
                f"(`--profile-steps`, after the timed run): {kinds}",
                *timing.profile_table(prof, "step"),
            ]
    return lines
