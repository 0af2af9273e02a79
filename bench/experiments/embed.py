"""Embeddings per second: gapless's `LLM.embed` against sentence-transformers' `encode` on the same
random-weight sentence-transformers checkpoint (a tiny random decoder of `--size`, made here) and the
same texts, and the smallest cosine between the two's vectors.

    PYTHONPATH=. python bench/experiments/embed.py --size bench --texts 256 --device cpu
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from gapless import LLM
from gapless.testing.pooling import sentence_transformers_checkpoint

WORDS = "the a cat dog sat ran on in station where is it blue green quickly slowly house river city".split()


def texts(n: int, lo: int, hi: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) for _ in range(n)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen3")
    ap.add_argument("--size", default="bench", help="gapless.testing.checkpoints size")
    ap.add_argument("--pooling", default="mean", choices=("last", "mean", "cls"))
    ap.add_argument("--texts", type=int, default=256)
    ap.add_argument("--words", type=int, nargs=2, default=(8, 64), metavar=("MIN", "MAX"))
    ap.add_argument("--batch", type=int, default=32, help="sentence-transformers' batch size")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="also write the result here as JSON")
    args = ap.parse_args(argv)
    from sentence_transformers import SentenceTransformer

    batch = texts(args.texts, *args.words)
    with tempfile.TemporaryDirectory() as tmp:
        path = sentence_transformers_checkpoint(
            Path(tmp) / "st", args.arch, size=args.size, pooling=args.pooling
        )
        st = SentenceTransformer(str(path), device=args.device, model_kwargs={"torch_dtype": torch.float32})
        if st.tokenizer.pad_token is None:
            st.tokenizer.pad_token = st.tokenizer.eos_token
        st.encode(batch[:4], batch_size=args.batch)  # warm-up
        start = time.perf_counter()
        ref = torch.as_tensor(st.encode(batch, batch_size=args.batch, convert_to_tensor=True)).float().cpu()
        st_s = time.perf_counter() - start
        del st
        with LLM(str(path), device=args.device, dtype="float32") as llm:
            llm.embed(batch[:4])  # warm-up
            start = time.perf_counter()
            got = torch.tensor([o.embedding for o in llm.embed(batch)])
            gapless_s = time.perf_counter() - start
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=1)
    result = {
        "arch": args.arch,
        "size": args.size,
        "pooling": args.pooling,
        "device": args.device,
        "texts": args.texts,
        "threads": torch.get_num_threads(),
        "sentence_transformers_texts_per_s": args.texts / st_s,
        "gapless_texts_per_s": args.texts / gapless_s,
        "gapless_over_sentence_transformers": st_s / gapless_s,
        "min_cosine": float(cos.min()),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
