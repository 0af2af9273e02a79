"""Timed runs of one workload on gapless and on `transformers` batched `generate`, and how busy the
machine was meanwhile: the measurements the offline benchmarks (`offline`, `gpu`, `overlap`) share.

Both sides decode greedily and run every request to exactly its output length (`ignore_eos`), after an
untimed warm-up in the same engine; only each request's own output length counts as output on both sides.
"""

from __future__ import annotations

import cProfile
import dataclasses
import gc
import itertools
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from gapless.bench import timing
from gapless.bench.workload import Workload
from gapless.engine.heap import gc_pauses

# The warm-up both engines get by default: two short prompts, four tokens each.
WARMUP = Workload([[1, 2, 3], [4, 5, 6, 7, 8]], [4, 4])
# transformers `generate` options for greedy decoding to exactly `max_new_tokens`: the checkpoint's EOS
# overridden so no row stops early (`ignore_eos`, as gapless runs), its sampling defaults cleared.
HF_GREEDY_TO_LENGTH: dict[str, Any] = dict(
    do_sample=False, eos_token_id=None, temperature=None, top_p=None, top_k=None
)


def _busy_cpu_s() -> float | None:
    """CPU-seconds all processes have spent busy since boot (from /proc/stat), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    guest = sum(fields[8:10])  # already counted in user/nice
    return (sum(fields) - idle - guest) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """CPU-seconds of this process and its descendants so far (the engine's device process is ours)."""
    own = time.process_time()
    try:
        tick = os.sysconf("SC_CLK_TCK")
        parents: dict[int, int] = {}
        times: dict[int, float] = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()  # fields after the command name
            except OSError:
                continue
            pid = int(entry.name)
            parents[pid] = int(rest[1])
            times[pid] = (int(rest[11]) + int(rest[12])) / tick  # utime + stime
    except OSError:
        return own
    mine, frontier = set(), [os.getpid()]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in mine]
        mine.update(children)
        frontier += children
    return own + sum(times[pid] for pid in mine)


class OtherLoad:
    """How many cores other processes kept busy, on average, while a timed section ran.

    The dev machine is shared, and a neighbour's work does more than steal cycles: torch's OpenMP
    threads wait at every barrier for a descheduled sibling (with one of 2 cores busy, a 16-row linear ran
    6x slower on 2 threads than on 1). Measured per side, so a ratio skewed by a neighbour shows up.
    """

    def __enter__(self) -> OtherLoad:
        self.cores: float | None = None
        self._busy, self._own, self._t = _busy_cpu_s(), _own_cpu_s(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        busy, wall = _busy_cpu_s(), time.perf_counter() - self._t
        if busy is not None and self._busy is not None and wall > 0:
            others = busy - self._busy - (_own_cpu_s() - self._own)
            self.cores = round(max(0.0, others) / wall, 2)


def _stats_delta(after: Any, before: Any) -> dict[str, Any]:
    """Numeric fields of a stats dataclass for the timed run only (the warm-up's share subtracted)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(after):
        a, b = getattr(after, f.name), getattr(before, f.name)
        if isinstance(a, (int, float)) and not isinstance(a, bool):
            out[f.name] = a - b
    return out


def _sync(device: str | torch.device) -> None:
    """Wait for the GPU's queued work (so a timer brackets it); nothing to wait for on the CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _result(
    engine: str, work: Workload, output_tokens: int, wall: float, load_s: float, others: OtherLoad
) -> dict[str, Any]:
    """The figures every engine's result has, in the JSON's names."""
    return dict(
        engine=engine,
        requests=len(work),
        input_tokens=work.input_tokens,
        requested_output_tokens=work.output_tokens,
        output_tokens=output_tokens,
        wall_s=wall,
        output_tokens_per_s=output_tokens / wall,
        load_s=load_s,
        other_cores=others.cores,
    )


_METER = (
    "steps",
    "device_jobs",
    "device_busy_s",
    "device_idle_s",
    "host_s",
    "device_idle_fraction",
    "prefill_steps",
    "decode_steps",
    "decode_host_s",
    "prefill_device_s",
    "decode_device_s",
)


def _meter(llm: Any) -> dict[str, Any]:
    """The engine's bubble-meter figures since the meter's last reset, with the ratios they give (under
    the names the benchmark JSON has always used)."""
    figures = llm.engine.stats.as_dict()
    return {
        **{name: figures[name] for name in _METER},
        "host_ms_per_step": figures["mean_host_ms_per_step"],
        "host_ms_per_prefill_step": figures["mean_host_ms_per_prefill_step"],
        "host_ms_per_decode_step": figures["mean_host_ms_per_decode_step"],
        "device_ms_per_job": figures["mean_device_ms_per_job"],
    }


def run_gapless(
    path: Path,
    work: Workload,
    threads: int | None = None,
    kv_cache_tokens: int | None = None,
    profile: str | None = None,
    options: dict[str, Any] | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    warmup: Workload = WARMUP,
    sampling: dict[str, Any] | None = None,
    profile_steps: int = 0,
) -> dict[str, Any]:
    """One `LLM.generate` over the whole workload, each request to exactly its output length, greedy
    unless `sampling` says otherwise (more `SamplingParams` fields: a temperature, top-k, a grammar).
    With `profile_steps`, then `timing.decode_profile` of that many decode steps over every request at
    once (their prompts rotated, so the prefix cache holds none of them): `kernel_profile`.

    `threads` goes to the engine's device side (on a CPU it may run in its own process, which does not
    inherit this process's `torch.set_num_threads`); `options` are further `LLM` options (they win over
    `device` and `dtype`). `warmup` runs first, untimed, in the same engine: on a GPU give it prompts
    as long as the workload's, so kernels are compiled and picked before the clock starts (and different
    tokens from the workload's, so the prefix cache has nothing the timed run can reuse). The bubble
    meter is reset after the warm-up, so its figures (`meter`) and a `trace_path` trace hold the timed
    run alone; the engine's counters (`stats`) are the timed run's share of them.
    """
    from gapless import LLM, SamplingParams

    if kv_cache_tokens is None:
        kv_cache_tokens = work.input_tokens + work.output_tokens + 1024  # + warm-up and slack
    opts: dict[str, Any] = dict(
        device=device, dtype=dtype, kv_cache_tokens=kv_cache_tokens, device_threads=threads
    )
    opts.update(options or {})
    t0 = time.perf_counter()
    llm = LLM(str(path), **opts)
    load_s = time.perf_counter() - t0
    try:
        # Warm-up (not timed): first calls allocate, pick kernels and fault in the weights.
        # greedy unless `sampling` says otherwise; the warm-up samples as the timed run does (it also
        # compiles a grammar the timed requests share, and the sampler's kernels)
        extra = {"temperature": 0.0, **(sampling or {})}
        warm = [SamplingParams(max_tokens=n, ignore_eos=True, **extra) for n in warmup.output_lens]
        t0 = time.perf_counter()
        llm.generate(warmup.prompts, warm, use_tqdm=False)
        warmup_s = time.perf_counter() - t0
        params = [SamplingParams(max_tokens=n, ignore_eos=True, **extra) for n in work.output_lens]
        llm.engine.meter.reset()  # before the snapshot: it zeroes the meter's figures in place
        before = dataclasses.replace(llm.engine.stats)
        prof = cProfile.Profile() if profile else None
        gc.collect()
        gc_before = gc_pauses().pause_s
        _sync(llm.engine.info.device)
        with OtherLoad() as others, triton_compiles() as compiled:
            t0 = time.perf_counter()
            if prof is not None:
                prof.enable()
            outputs = llm.generate(work.prompts, params, use_tqdm=False)
            if prof is not None:
                prof.disable()
            _sync(llm.engine.info.device)
            wall = time.perf_counter() - t0
        stats = _stats_delta(llm.engine.stats, before)
        meter = _meter(llm)
        meter["gc_pause_s"] = gc_pauses().pause_s - gc_before  # this process's collections meanwhile

        shifts = itertools.count(1)

        def rotated(n: int) -> None:  # every request, n output tokens, its prompt rotated anew each call
            k = next(shifts)  # (so the prefix cache holds none of them: each run computes its prompts)
            prompts = [p[k % len(p) :] + p[: k % len(p)] for p in work.prompts]
            llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True, **extra), use_tqdm=False)

        kernel_profile = timing.decode_profile(rotated, profile_steps, device) if profile_steps else None
        info = dataclasses.asdict(llm.engine.info)
        runner = llm.engine.runner  # None when the device side runs in its own process
        backend = type(getattr(runner, "backend", None)).__name__ if runner is not None else None
    finally:
        llm.shutdown()
    if prof is not None and profile:  # (there is a profiler only with a path)
        prof.dump_stats(profile)
    generated = sum(len(o.token_ids) for o in outputs)
    return dict(
        _result("gapless", work, generated, wall, load_s, others),
        kv_cache_tokens=kv_cache_tokens,
        kv_pool_tokens=info["kv_tokens"],
        device=info["device"],
        attention_backend=backend,
        warmup_requests=len(warmup),
        warmup_s=warmup_s,
        wrong_length_requests=sum(
            len(o.token_ids) != n for o, n in zip(outputs, work.output_lens, strict=True)
        ),
        steps=stats.get("device_jobs", 0),  # batches run (the meter's loop iterations: `meter["steps"]`)
        prefill_batches=stats.get("prefill_batches", 0),
        decode_batches=stats.get("decode_batches", 0),
        retractions=stats.get("retractions", 0),
        device_busy_s=meter["device_busy_s"],
        device_idle_s=meter["device_idle_s"],
        device_jobs=meter["device_jobs"],
        host_s=meter["host_s"],
        triton_compiles=compiled,
        kernel_profile=kernel_profile,
        engine_options={k: v for k, v in opts.items() if k != "kv_cache_tokens"},
        stats=stats,
        meter=meter,
    )


@contextmanager
def triton_compiles() -> Iterator[list[str]]:
    """The names of the Triton kernels compiled inside the block, one per compilation (none recorded
    where this Triton has no `knobs.runtime.jit_cache_hook`). Triton compiles a kernel again for each new
    set of constexprs, argument types and pointer alignments, seconds of host time each: in a timed run,
    a stall the warm-up should have taken."""
    names: list[str] = []
    try:
        from triton import knobs

        runtime = knobs.runtime
        before = runtime.jit_cache_hook
    except (ImportError, AttributeError):
        yield names
        return

    def hook(*args: Any, **kwargs: Any) -> Any:
        fn = kwargs.get("fn")
        names.append(getattr(fn, "name", "?"))
        return before(*args, **kwargs) if before is not None else None  # None: compile it

    runtime.jit_cache_hook = hook
    try:
        yield names
    finally:
        runtime.jit_cache_hook = before


def hf_generate(model: Any, prompts: list[list[int]], max_new: int, pad: int) -> torch.Tensor:
    """One left-padded greedy `generate` that runs every row to `max_new` tokens; returns them, [B, max_new]
    (on the model's device).

    `HF_GREEDY_TO_LENGTH` overrides the checkpoint's EOS so no row stops early (`ignore_eos`, as gapless
    runs); the length check makes sure transformers really did, or the tokens/s would be a lie.
    """
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p) :] = torch.tensor(p)
        mask[i, longest - len(p) :] = 1
    ids, mask = ids.to(model.device), mask.to(model.device)
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=max_new, pad_token_id=pad, **HF_GREEDY_TO_LENGTH
    )
    if out.shape[1] != longest + max_new:
        raise RuntimeError(f"transformers generated {out.shape[1] - longest} tokens, asked for {max_new}")
    return out[:, longest:]


def run_transformers(
    path: Path,
    work: Workload,
    batch_size: int,
    device: str = "cpu",
    dtype: str | torch.dtype = torch.float32,
    warmup: Workload = WARMUP,
) -> dict[str, Any]:
    """transformers `generate` as a user batches it: left-padded static batches in workload order, greedy,
    EOS disabled so every batch runs to its longest requested output. sdpa attention, the model in `dtype`
    on `device` (on CUDA the timer brackets a `synchronize`). `warmup`'s prompts run first, untimed, as
    one batch to its longest output."""
    from transformers import AutoModelForCausalLM

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa")
    model.to(device).eval()  # type: ignore[arg-type]  # transformers' wrapped `to` types as unbound
    load_s = time.perf_counter() - t0
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    with torch.inference_mode():
        hf_generate(model, warmup.prompts, max(warmup.output_lens), pad)  # warm-up, not timed
        computed = 0
        gc.collect()
        _sync(device)
        with OtherLoad() as others:
            t0 = time.perf_counter()
            for start in range(0, len(work), batch_size):
                lens = work.output_lens[start : start + batch_size]
                hf_generate(model, work.prompts[start : start + batch_size], max(lens), pad)
                computed += len(lens) * max(lens)
            _sync(device)
            wall = time.perf_counter() - t0
    del model
    return dict(
        _result("transformers", work, work.output_tokens, wall, load_s, others),
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        batch_size=min(batch_size, len(work)),
        batches=-(-len(work) // batch_size),
        computed_output_tokens=computed,
        wasted_output_fraction=1 - work.output_tokens / computed,
    )
