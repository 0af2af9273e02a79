"""Images through prefill, gapless against transformers on the same LLaVA-1.5, LLaVA-NeXT or Qwen2.5-VL
model, and the decode speed of image conversations against text-only ones of the same length.

    python -m gapless.bench.vision                      # a random "bench"-size LLaVA on the CPU
    python -m gapless.bench.vision --device cuda --images 64 --batch 16
    python -m gapless.bench.vision --family qwen2_5_vl  # Qwen2.5-VL: windowed ViT, M-RoPE decoder
    python -m gapless.bench.vision --family llava_next  # LLaVA-NeXT: 224-px tiles, up to 5 crops an image

Prefill: `--images` one-image chats, `--batch` at a time, one output token each (the processor, the
encoder and the prompt's prefill): images/s for gapless's `LLM.chat` and for transformers'
`LlavaForConditionalGeneration` (`LlavaNextForConditionalGeneration`,
`Qwen2_5_VLForConditionalGeneration`) forward over the processor's padded batch (processor included in
both).
Decode: `--batch` of the chats and as many text-only prompts of the same token counts, `--max-tokens`
greedy tokens each with EOS ignored, run together; decode tok/s counts the steps after every request has
its first token. The rounds alternate between the sides, and the best round of each counts.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch

from gapless import LLM, SamplingParams
from gapless.bench import cli
from gapless.engine.image_io import split_chat
from gapless.testing.qwen_vl_checkpoints import make_qwen_vl_checkpoint
from gapless.testing.vision_checkpoints import make_llava_checkpoint, make_llava_next_checkpoint

# family -> (its bench checkpoint's writer, what the report calls it)
_FAMILIES = {
    "llava": (make_llava_checkpoint, "bench-size LLaVA (CLIP 224 px"),
    "llava_next": (make_llava_next_checkpoint, "bench-size LLaVA-NeXT (CLIP over 224-px tiles"),
    "qwen2_5_vl": (make_qwen_vl_checkpoint, "bench-size Qwen2.5-VL (6-block ViT, images <= 448 px"),
}


def _chats(n: int) -> list[list[dict[str, Any]]]:
    from PIL import Image

    rng = np.random.default_rng(0)
    chats = []
    for i in range(n):
        h, w = (int(x) for x in rng.integers(64, 400, 2))
        image = Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
        parts = [{"type": "text", "text": f"Picture {i}:"}, {"type": "image", "image": image}]
        chats.append([{"role": "user", "content": [*parts, {"type": "text", "text": "What is in it?"}]}])
    return chats


def _best(fn: Any, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _hf_prefill(path: str, chats: list, batch: int, device: str) -> Any:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    processor.tokenizer.padding_side = "left"
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    model = model.to(device)

    texts = [processor.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    images = [c[0]["content"][1]["image"] for c in chats]

    def run() -> None:
        for i in range(0, len(chats), batch):
            inputs = processor(
                text=texts[i : i + batch], images=images[i : i + batch], padding=True, return_tensors="pt"
            ).to(device)
            with torch.inference_mode():
                model(**inputs, logits_to_keep=1)
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    return run


def _hf_qwen_prefill(path: str, chats: list, batch: int, device: str) -> Any:
    """transformers' Qwen2.5-VL prefill of `chats`, `batch` at a time: gapless's processor from parts (the
    image processor and tokenizer; `Qwen2_5_VLProcessor` needs torchvision), prompts left-padded, and the
    image-token types `get_rope_index` reads."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from gapless.model.vision.qwen2_5_vl import QwenVLProcessor

    processor = QwenVLProcessor(path)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    model = model.to(device)
    token, pad = model.config.image_token_id, processor.tokenizer.pad_token_id

    def run() -> None:
        for i in range(0, len(chats), batch):
            group = chats[i : i + batch]
            outs = [
                processor(
                    processor.apply_chat_template(c, add_generation_prompt=True),
                    [c[0]["content"][1]["image"]],
                )
                for c in group
            ]
            n = max(o["input_ids"].shape[1] for o in outs)
            ids = torch.full((len(outs), n), pad, dtype=torch.int64)
            mask = torch.zeros_like(ids)
            for row, o in enumerate(outs):
                ids[row, n - o["input_ids"].shape[1] :] = o["input_ids"][0]
                mask[row, n - o["input_ids"].shape[1] :] = 1
            inputs = dict(
                input_ids=ids,
                attention_mask=mask,
                mm_token_type_ids=(ids == token).int(),
                pixel_values=torch.cat([o["pixel_values"] for o in outs]),
                image_grid_thw=torch.cat([o["image_grid_thw"] for o in outs]),
            )
            with torch.inference_mode():
                model(**{k: v.to(device) for k, v in inputs.items()}, logits_to_keep=1)
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    return run


def _decode_tok_s(llm: LLM, prompts: list[tuple[list[int], tuple]], max_tokens: int) -> float:
    """Output tok/s of `prompts` (ids, images) run together, from the step after the last one's first
    token to the end: decode alone."""
    engine, params = llm.engine, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(ids, params, images=images) for ids, images in prompts]
    while any(not r.output_ids for r in reqs):
        engine.step()
    start, t0 = sum(len(r.output_ids) for r in reqs), time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return (sum(len(r.output_ids) for r in reqs) - start) / (time.perf_counter() - t0)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="gapless-vision-bench-")
    cli.progress(f"writing a random bench-size {args.family} checkpoint")
    path = str(_FAMILIES[args.family][0](tmp, size="bench"))
    chats = _chats(args.images)
    prefill_of = _hf_qwen_prefill if args.family == "qwen2_5_vl" else _hf_prefill
    hf = prefill_of(path, chats, args.batch, args.device)
    # no prefix cache: every round sends the same chats, whose image KV a cache would hand back
    # (transformers recomputes them), so the rounds after the first would time no encoder at all
    defaults = dict(device=args.device, max_running_requests=args.batch, dtype="float32", radix_cache=False)
    options = {**defaults, **args.engine_options}
    llm = LLM(path, **options)
    one = SamplingParams(max_tokens=1, temperature=0.0)

    def gapless_prefill() -> None:
        for i in range(0, len(chats), args.batch):
            llm.chat(chats[i : i + args.batch], one, use_tqdm=False)

    hf()  # warm-up, both
    gapless_prefill()
    prefill = {"transformers": float("inf"), "gapless": float("inf")}
    for _ in range(args.rounds):  # alternating, so a shared machine's load hits both alike
        prefill["transformers"] = min(prefill["transformers"], _best(hf, 1))
        prefill["gapless"] = min(prefill["gapless"], _best(gapless_prefill, 1))
    # text-only prompts of the same token counts: the chats' ids with their image tokens made text tokens
    prompter = llm.engine.image_prompter()
    made = [prompter.render(*split_chat(c, prompter.limits)) for c in chats]
    token = prompter.image_token_id
    text = [([t if t != token else 300 + k % 200 for k, t in enumerate(ids)], ()) for ids, _ in made]
    decode = {"image": 0.0, "text": 0.0}
    for _ in range(args.rounds):
        for name, prompts in (("image", made), ("text", text)):
            decode[name] = max(decode[name], _decode_tok_s(llm, prompts[: args.batch], args.max_tokens))
    llm.shutdown()
    ips = {name: len(chats) / t for name, t in prefill.items()}
    return dict(
        command=cli.command_line("gapless.bench.vision", sys.argv[1:]),
        machine=cli.machine(args.device),
        family=args.family,
        images=len(chats),
        batch=args.batch,
        image_tokens=max(im.length for _, ims in made for im in ims),
        max_tokens=args.max_tokens,
        rounds=args.rounds,
        images_per_s=ips,
        prefill_ratio=ips["gapless"] / ips["transformers"],
        decode_tok_s=decode,
        decode_ratio=decode["image"] / decode["text"],
    )


def report(res: dict[str, Any]) -> list[str]:
    ips, dec = res["images_per_s"], res["decode_tok_s"]
    return [
        res["command"],
        cli.machine_line(res["machine"]),
        f"{_FAMILIES[res.get('family', 'llava')][1]}, {res['image_tokens']} image tokens at most), "
        f"{res['images']} one-image "
        f"chats, batch {res['batch']}, best of {res['rounds']} rounds",
        *cli.markdown_table(
            ["prefill", "images/s", "vs transformers"],
            [
                (n, f"{ips[n]:.2f}", f"{ips[n] / ips['transformers']:.2f}x")
                for n in ("transformers", "gapless")
            ],
            "lrr",
        ),
        f"decode ({res['max_tokens']} tokens): image chats {dec['image']:.1f} tok/s, text-only "
        f"{dec['text']:.1f} tok/s, ratio {res['decode_ratio']:.3f}",
    ]


def _parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--family", choices=sorted(_FAMILIES), default="llava", help="the model's (default llava)")
    p.add_argument("--images", type=cli.positive_int, default=16)
    p.add_argument("--batch", type=cli.positive_int, default=8, help="chats run together (default 8)")
    p.add_argument("--max-tokens", type=cli.positive_int, default=32, help="decode length (default 32)")
    p.add_argument("--rounds", type=cli.positive_int, default=2)
    p.add_argument("--json", help="also write the results here")
    cli.add_engine_option_arg(p.add_argument_group("engine"), "e.g. page_size=16")
    args = p.parse_args(argv)
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
