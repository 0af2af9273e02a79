"""A checkpoint whose greedy output is scripted: after token `a` it emits `script[a]`, after any other
token it emits EOS. Server tests use it to produce exactly the tokens they need (a multi-byte character
split across byte tokens, a stop string across tokens) from a real model through the real engine.

How: every layer's output projections (attention `o_proj`, MLP `down_proj`) are zero, so the final
hidden state is the normed embedding of the current token. Embeddings are random except dimension 0,
a constant. The lm_head row of a scripted target `b = script[a]` is `a`'s embedding (its logit is then
about `hidden`, the other rows' about `sqrt(hidden)` in spread), and EOS's row reads only the constant
dimension, so it wins whenever the current token has no script.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import load_file, save_file

from gapless.default_model.tokenizer import build_tokenizer
from gapless.testing.checkpoints import make_checkpoint

HIDDEN = 256
# halfway to the scripted logit (~HIDDEN), 8 standard deviations above the others (~N(0, HIDDEN))
_EOS_LOGIT = HIDDEN / 2


def _byte_to_unicode() -> dict[int, str]:
    """Byte-level BPE's alphabet: printable bytes stand for themselves, the rest shift past 255."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_token_ids(data: bytes) -> list[int]:
    """The ids of the single-byte tokens spelling `data`, one token per byte (never merged)."""
    tok = build_tokenizer()
    table = _byte_to_unicode()
    ids = [tok.convert_tokens_to_ids(table[b]) for b in data]
    assert all(isinstance(i, int) and i != tok.unk_token_id for i in ids), f"missing byte tokens for {data!r}"
    return cast(list[int], ids)  # (one token each: ints, as just asserted)


def make_scripted_checkpoint(
    path: str | Path, script: dict[int, int], seed: int = 0, **overrides: Any
) -> Path:
    """A llama-architecture checkpoint at `path` whose greedy next token after `a` is `script[a]` (EOS
    after tokens not in the script). Each token may have one successor, so a chain of tokens can
    revisit no token; the model forgets everything but the current token. `overrides` go to the config
    (a `vocab_size` past the tokenizer's adds filler tokens, whose text a test may rewrite)."""
    path = make_checkpoint(
        path,
        "llama",
        seed=seed,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_scaling=None,
        **overrides,
    )
    weights_file = path / "model.safetensors"
    weights = load_file(str(weights_file))
    eos = build_tokenizer().eos_token_id
    gen = torch.Generator().manual_seed(seed)
    embed = weights["model.embed_tokens.weight"]
    vocab = embed.shape[0]
    embed.copy_(torch.randn(vocab, HIDDEN, generator=gen))
    embed[:, 0] = 1.0  # the constant dimension EOS reads
    head = torch.zeros(vocab, HIDDEN)
    for a, b in script.items():
        if a == b:
            raise ValueError(f"token {a} cannot follow itself (the next step would repeat forever)")
        row = embed[a].clone()
        row[0] = 0.0
        head[b] = row
    head[eos, 0] = _EOS_LOGIT
    weights["lm_head.weight"] = head
    for name, w in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w.zero_()
        elif "norm" in name:
            w.fill_(1.0)
    save_file(weights, str(weights_file), metadata={"format": "pt"})
    return path
