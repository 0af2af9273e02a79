"""Served accuracy of each quantized format (issue 36: "within 1 point of the unquantized model") with
lm-evaluation-harness: its `local-completions` model (token-id prompts, echo + logprobs) drives
`gapless serve --device cpu` over the rows of `quant_accuracy.py` (the default model dequantized to
float32, each weight format, and the FP8 KV cache), one server at a time.

    PYTHONPATH=. .venv/bin/python bench/experiments/quant_lm_eval.py [--work DIR] [--limit N] [--formats S ..]

lm-eval's datasets cannot be downloaded here, so the task is local: LAMBADA-style last-word prediction
(`output_type: loglikelihood`, metric `acc`: whether the sentence's last word is the greedy continuation,
every token of it) over English prose from Python's own documentation (the stdlib's `pydoc_data.topics`,
its code, grammar and headings dropped; it is the running Python's, so the task follows its version). 500
items by default, each context the same topic's text up to 700 characters back (117 tokens on average),
drawn with a fixed seed; the task's JSONL and YAML are written into the work directory. Each row prints
its accuracy (± lm-eval's stderr), the difference from float32 in points, the items whose correctness
differs from float32's, and its wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path

from quant_accuracy import formats  # (the script beside this one)

from gapless.testing.server import ServerProcess

TASK = "gapless_lastword"
SEED = 0
MAX_MODEL_LEN = 1024
CONTEXT_CHARS = 700  # a context starts at the first sentence within this many characters of its target
WORD = re.compile(r"[A-Za-z][a-z]*(?:['’-][a-z]+)*[,.;:]?")
TARGET = re.compile(r" ([a-z]{3,})\.(?= |$)")  # a sentence's last word: lower case, 3+ letters, before ". "
NOT_TARGETS = {"etc", "ones", "one", "its", "the"}
# rows also paired with another row than float32: the "FP8 KV against bf16 KV", the KV cache the
# one difference between them
BASELINES = {"fp8 KV cache (bfloat16 weights)": "bfloat16 weights and KV cache"}


def paragraphs(text: str) -> list[str]:
    """The prose paragraphs of one pydoc topic, each on one line: no headings, grammar, code or notes."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = [line for line in block.split("\n") if line.strip()]
        if len(lines) < 2 and not block.strip().endswith("."):
            continue
        if any(set(line.strip()) <= set("*=-~^") for line in lines):  # a heading's underline
            continue
        if any(line.lstrip().startswith((">>>", "...", "|")) or "::=" in line for line in lines):
            continue
        indents = {len(line) - len(line.lstrip()) for line in lines}
        if len(indents) > 1 and min(indents) == 0:  # prose wraps at one indent; code blocks do not
            continue
        para = " ".join(line.strip() for line in lines)
        para = re.sub(r"\*\*?([^*\s][^*]*?)\*\*?", r"\1", para)  # *emphasis*, **PEP 448**
        words = para.split()
        if len(words) < 12 or not para.endswith((".", ":")):
            continue
        if sum(bool(WORD.fullmatch(w)) for w in words) < 0.75 * len(words):  # mostly code or symbols
            continue
        out.append(para)
    return out


def items(n: int) -> list[dict[str, str]]:
    """`n` (context, target) pairs drawn with a fixed seed: each target is a prose sentence's last word,
    its context the same topic's text before it (from a sentence start at most CONTEXT_CHARS back)."""
    from pydoc_data.topics import topics

    found = []
    for name in sorted(topics):
        text = " ".join(paragraphs(topics[name]))
        starts = [0] + [m.end() for m in re.finditer(r"[.:] (?=[A-Z])", text)]
        for m in TARGET.finditer(text):
            word, at = m.group(1), m.start()
            if word in NOT_TARGETS or at < 200:
                continue
            sentence_start = max(s for s in starts if s <= at)
            if len(text[sentence_start:at].split()) < 6:  # the sentence itself gives some clue
                continue
            start = min(
                (s for s in starts if at - CONTEXT_CHARS <= s <= sentence_start), default=sentence_start
            )
            found.append({"topic": name, "context": text[start:at], "target": " " + word})
    random.Random(SEED).shuffle(found)
    return found[:n]


def write_task(dst: Path, n: int) -> int:
    """The task's JSONL and YAML under `dst`; the number of items."""
    dst.mkdir(parents=True, exist_ok=True)
    docs = items(n)
    (dst / f"{TASK}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (dst / f"{TASK}.yaml").write_text(
        f"# last-word prediction over Python's documentation (pydoc_data.topics), {len(docs)} items\n"
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {dst / TASK}.jsonl\n"
        "test_split: test\noutput_type: loglikelihood\n"
        'doc_to_text: "{{context}}"\ndoc_to_target: "{{target}}"\n'
        "metric_list:\n  - metric: acc\n  - metric: perplexity\n"
    )
    return len(docs)


def serve_args(path: Path, options: dict[str, object]) -> tuple[list[str], dict[str, str]]:
    """`gapless serve` flags of one row (its checkpoint on the CPU in float32, and its engine options),
    and the variables its server runs with (a row's "int4_kernel", `GAPLESS_INT4_KERNEL`; its "env")."""
    options = dict(options)
    env = {"GAPLESS_INT4_KERNEL": str(options.pop("int4_kernel", "auto"))}
    env.update({k: str(v) for k, v in dict(options.pop("env", {})).items()})  # type: ignore[call-overload]
    engine = {"device": "cpu", "dtype": "float32", "model": path, "max_model_len": MAX_MODEL_LEN, **options}
    return [f for k, v in engine.items() for f in (f"--{k.replace('_', '-')}", str(v))], env


def evaluate(url: str, model: str, tokenizer: str, tasks: Path, limit: int | None) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "base_url": f"{url}/v1/completions",
            "model": model,
            "tokenizer": tokenizer,
            "tokenizer_backend": "huggingface",
            "tokenized_requests": True,
            "max_length": MAX_MODEL_LEN,
            "max_retries": 1,
        },
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        batch_size=8,
        limit=limit,
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )


def main() -> None:
    p = argparse.ArgumentParser(prog="python bench/experiments/quant_lm_eval.py")
    p.add_argument("--work", help="checkpoints and the task go here (default: a temporary directory)")
    p.add_argument("--items", type=int, default=500, help="the task's size (default: 500)")
    p.add_argument("--limit", type=int, help="score only the first N items (a quick run)")
    p.add_argument("--formats", nargs="+", help="the rows whose label contains one of these (float32 always)")
    args = p.parse_args()
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ[var] = "1"  # the task and the metrics are local: never wait on the network
    work = Path(args.work or tempfile.mkdtemp(prefix="quant_lm_eval-")).resolve()
    os.environ.setdefault("HF_DATASETS_CACHE", str(work / "hf_datasets"))
    tasks = work / "task"
    n = write_task(tasks, args.items)
    rows = formats(work)
    if args.formats:
        rows = {k: v for k, v in rows.items() if k == "float32" or any(s in k for s in args.formats)}
    tokenizer = str(rows["float32"][0])
    print(f"task {TASK}: {n} items from pydoc_data.topics ({tasks}), scored {args.limit or n}", flush=True)
    results: dict[str, tuple[float, float, float, dict[int, float], float]] = {}
    for label, (path, options) in rows.items():
        t0 = time.monotonic()
        flags, env = serve_args(path, options)
        srv = ServerProcess(*flags, env=env)
        try:
            out = evaluate(srv.url, str(path), tokenizer, tasks, args.limit)
        finally:
            rc = srv.stop()
        wall = time.monotonic() - t0
        if rc != 0:
            print(f"{label}: the server exited {rc}:\n{srv.output}", flush=True)
        r = out["results"][TASK]
        per_item = {s["doc_id"]: s["acc"] for s in out["samples"][TASK]}
        results[label] = (r["acc,none"], r["acc_stderr,none"], r["perplexity,none"], per_item, wall)
        ref = results["float32"]
        flips = sum(per_item[i] != ref[3][i] for i in per_item)
        print(
            f"{label}: acc {r['acc,none'] * 100:.2f} ± {r['acc_stderr,none'] * 100:.2f}, "
            f"{(r['acc,none'] - ref[0]) * 100:+.2f} points vs float32, {flips} items differ, "
            f"target perplexity {r['perplexity,none']:.3f}, {wall:.0f} s",
            flush=True,
        )
    ref = results["float32"]
    print("\n| format | acc (%) | vs float32 (points) | items differing | target perplexity | wall |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, (acc, err, ppl, per_item, wall) in results.items():
        flips = sum(per_item[i] != ref[3][i] for i in per_item)
        diff = "" if label == "float32" else f"{(acc - ref[0]) * 100:+.2f}"
        cells = [label, f"{acc * 100:.2f} ± {err * 100:.2f}", diff, str(flips), f"{ppl:.3f}", f"{wall:.0f} s"]
        print("| " + " | ".join(cells) + " |")
    for label, base in BASELINES.items():
        if label in results and base in results:
            print(paired(label, results[label][3], base, results[base][3]))


def paired(label: str, items: dict[int, float], base: str, base_items: dict[int, float]) -> str:
    """`label`'s accuracy against `base`'s on the same items: the difference in points, its paired
    standard error sqrt(d - (g - l)^2 / n) / n (d items differing, g gained, l lost), and g / l."""
    n = len(items)
    gained = sum(items[i] > base_items[i] for i in items)
    lost = sum(items[i] < base_items[i] for i in items)
    d = gained + lost
    err = (d - (gained - lost) ** 2 / n) ** 0.5 / n
    return (
        f"{label} vs {base}: {(gained - lost) / n * 100:+.2f} points, paired stderr {err * 100:.2f}, "
        f"{d} items differing ({gained} gained / {lost} lost)"
    )


if __name__ == "__main__":
    sys.exit(main())
