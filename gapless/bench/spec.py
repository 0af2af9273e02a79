"""Speculative decoding's speed-up: output tok/s with speculation (n-gram, or a draft model) vs without,
same process.

    python -m gapless.bench.spec                      # SmolLM2-135M-Instruct on the CPU, batch 1
    python -m gapless.bench.spec --batch 32 --device cuda
    python -m gapless.bench.spec --algorithm draft --draft-model PATH   # a draft with the same tokenizer

The workload is copy-heavy, where prompt lookup pays: chat requests asking the model to repeat a
passage exactly. Both engines (speculation off and on) are loaded side by side and run the same requests
greedily, alternating round by round, so a shared machine's load hits both alike; the speed-up is the
ratio of their output tok/s over all rounds, and the tokens must be identical.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from gapless import LLM, SamplingParams
from gapless.bench import cli

PASSAGES = [
    "The river rose slowly through the night, and by morning the lower fields were under water. The farmers "
    "moved their animals to the hill behind the church, where the ground stayed dry, and waited for the rain "
    "to stop. It stopped on the third day, just after noon, and the water began to fall again.",
    "To build the project, install the requirements, run the test suite once, and then start the server with "
    "the default model. If the server does not start, check that the port is free and that the model was "
    "downloaded completely; the log prints one line for each step it finishes.",
    "A paged cache stores keys and values in fixed pages, so memory is handed out without fragmentation. A "
    "radix tree maps shared prompt prefixes to the pages that hold them, and a request that starts with a "
    "cached prefix skips the work of computing it again.",
    "She opened the letter at the kitchen table, read it twice, and folded it back into its envelope. Then "
    "she put on her coat, walked to the station, and bought a ticket for the first train to the coast, "
    "without telling anyone where she was going or when she would come back.",
]


def _messages(n: int) -> list[list[dict[str, str]]]:
    return [
        [{"role": "user", "content": f"Repeat the following text exactly: {PASSAGES[i % len(PASSAGES)]}"}]
        for i in range(n)
    ]


def _run(llm: LLM, convs: list, params: SamplingParams, batch: int) -> tuple[list[list[int]], float]:
    """Every conversation, `batch` at a time; their output tokens and the seconds it took."""
    tokens: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(convs), batch):
        tokens += [o.token_ids for o in llm.chat(convs[i : i + batch], params, use_tqdm=False)]
    return tokens, time.perf_counter() - start


def measure(args: argparse.Namespace) -> dict[str, Any]:
    options = dict(device=args.device, max_running_requests=max(args.batch, 1), **args.engine_options)
    algo = args.algorithm
    spec = dict(
        speculative_algorithm=algo,
        speculative_num_draft_tokens=args.num_draft_tokens,
        speculative_disable_batch_size=max(args.batch, 1),
        speculative_draft_model=args.draft_model,
    )
    cli.progress(f"loading {args.model} twice (speculation off and {algo})")
    engines = {"off": LLM(args.model, **options), algo: LLM(args.model, **options, **spec)}
    convs = _messages(max(args.batch, len(PASSAGES)))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    totals = {name: [0, 0.0] for name in engines}
    outputs: dict[str, list[list[int]]] = {}
    for llm in engines.values():  # warm-up: one request each
        _run(llm, convs[:1], params, 1)
    for r in range(args.rounds):
        for name, llm in engines.items():
            tokens, seconds = _run(llm, convs, params, args.batch)
            outputs[name] = tokens
            totals[name][0] += sum(len(t) for t in tokens)
            totals[name][1] += seconds
            cli.progress(f"round {r + 1}: {name}: {sum(len(t) for t in tokens) / seconds:.2f} output tok/s")
    stats = engines[algo].get_stats()
    for llm in engines.values():
        llm.shutdown()
    tok_s = {name: n / s for name, (n, s) in totals.items()}
    return dict(
        command=cli.command_line("gapless.bench.spec", sys.argv[1:]),
        machine=cli.machine(args.device),
        model=args.model,
        algorithm=algo,
        draft_model=args.draft_model,
        batch=args.batch,
        requests=len(convs),
        rounds=args.rounds,
        num_draft_tokens=args.num_draft_tokens,
        output_tokens=totals["off"][0],
        tok_s=tok_s,
        speedup=tok_s[algo] / tok_s["off"],
        identical=outputs["off"] == outputs[algo],
        acceptance_rate=stats["spec_acceptance_rate"],
        mean_accepted_length=stats["spec_mean_accepted_length"],
    )


def report(res: dict[str, Any]) -> list[str]:
    rows = [
        (name, f"{res['tok_s'][name]:.2f}", f"{res['tok_s'][name] / res['tok_s']['off']:.2f}x")
        for name in ("off", res["algorithm"])
    ]
    draft = f", drafted by {res['draft_model']}" if res["draft_model"] else ""
    return [
        res["command"],
        cli.machine_line(res["machine"]),
        f"model {res['model']}{draft}, batch {res['batch']}, {res['requests']} copy-heavy requests x "
        f"{res['rounds']} rounds, {res['output_tokens']} output tokens per engine, "
        f"K={res['num_draft_tokens']}",
        *cli.markdown_table(["speculation", "output tok/s", "vs off"], rows, "lrr"),
        f"tokens identical: {res['identical']}; acceptance rate {res['acceptance_rate']:.3f}, "
        f"mean accepted length {res['mean_accepted_length']:.2f} tokens per verify",
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="SmolLM2-135M-Instruct", help="model (default: the default model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=cli.positive_int, default=1, help="requests run together (default 1)")
    p.add_argument("--algorithm", choices=("ngram", "draft"), default="ngram", help="default ngram")
    p.add_argument("--draft-model", help="the draft model of --algorithm draft (the target's tokenizer)")
    p.add_argument("--num-draft-tokens", type=cli.positive_int, default=4, help="K (default 4)")
    p.add_argument("--max-tokens", type=cli.positive_int, default=128)
    p.add_argument("--rounds", type=cli.positive_int, default=2)
    p.add_argument("--json", help="also write the results here")
    cli.add_engine_option_arg(p.add_argument_group("engine"), "e.g. page_size=16")
    args = p.parse_args(argv)
    if (args.algorithm == "draft") != (args.draft_model is not None):
        p.error("--draft-model goes with --algorithm draft, which needs it")
    cli.take_engine_options(p, args)
    res = measure(args)
    print("\n".join(report(res)))
    if args.json:
        cli.write_json(args.json, res)
    return 0 if res["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
