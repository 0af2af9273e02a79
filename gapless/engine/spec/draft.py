"""Draft-model speculation: a smaller model with the target's tokenizer proposes each request's next tokens.

The draft keeps its own weights, attention backend and KV pool, but no allocator or request table of its
own: its pool has as many slots as the target's and it reads the target's request table, so token j of
the request in row r has its draft K/V in the draft pool's slot `req_table[r, j]`, the slot that holds its
target K/V in the target's pool. Whatever owns a slot for the target owns it for the draft: a request's
draft KV is freed with its target KV (finish, abort, retraction), a radix-cache prefix brings its draft KV
along, and one integrity check covers both pools.

The draft sees every token the target sees: it runs every forward the target runs, on the same tokens,
positions and slots (`mirror`: a prefill chunk, a decode, a verify's K+1 tokens). So when a verify starts,
the draft's KV holds every committed token of its rows, and the catch-up on what the previous step
accepted (or the prompt after a prefill) is already done, in stream order, without the host. A verify
then proposes (`propose`): K greedy draft steps, one token per row each, from the row's last token at its
committed position read on the device (`SpecState`); the slots they write are the ones the host took for
the verify, which the verify's own mirror then rewrites with the same tokens, and rejected ones are
overwritten by the next step. Drafts are the draft's argmax, a point mass, so the target's acceptance rule
(`gapless.sampling.speculative`) is exact for greedy and sampled rows alike and needs no draft
probabilities.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from gapless.attention import Probe, make_backend
from gapless.attention.base import AttentionMetadata
from gapless.config import EngineConfig
from gapless.memory.kv_pool import KVPool, kv_cache_dtype
from gapless.memory.req_table import ReqTable
from gapless.model import parallel
from gapless.model.config import ModelConfig, load_model_config
from gapless.model.decoder import CausalLM, ForwardContext
from gapless.model.loader import load_model, resolve_dtype
from gapless.model.source import load_tokenizer, resolve_model

SPECIAL = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


def check_same_tokenizer(target: PreTrainedTokenizerBase, draft: PreTrainedTokenizerBase, name: str) -> None:
    """Raise ValueError naming the draft model unless it tokenizes as the target does: the same vocabulary
    (token -> id) and the same special ids. A draft's token ids are fed to the target as they are."""
    if target.get_vocab() != draft.get_vocab():
        size = f"{len(draft.get_vocab())} tokens vs the target's {len(target.get_vocab())}"
        raise ValueError(
            f"speculative_draft_model={name!r}: its tokenizer's vocabulary differs from the target "
            f"model's ({size}); a draft model must use the target's tokenizer"
        )
    for attr in SPECIAL:
        a, b = getattr(target, attr), getattr(draft, attr)
        if a != b:
            raise ValueError(
                f"speculative_draft_model={name!r}: its {attr} is {b}, the target model's is {a}; a draft "
                "model must use the target's tokenizer"
            )


def load_draft(
    cfg: EngineConfig, device: torch.device, max_positions: int, vocab_size: int
) -> DraftModel | None:
    """`cfg`'s draft model (weights and backend, no pool yet), or None without one."""
    if cfg.speculative_draft_model is None:
        return None
    return DraftModel(cfg, device, max_positions, vocab_size)


class DraftModel:
    """The draft's weights and backend (`load`), then its KV pool (`make_pool`, once the target's plan has
    sized both pools), and the two jobs it does on the device: `mirror` and `propose`."""

    def __init__(self, cfg: EngineConfig, device: torch.device, max_positions: int, vocab_size: int) -> None:
        assert cfg.speculative_draft_model is not None
        name = cfg.speculative_draft_model
        path = resolve_model(name, download_dir=cfg.download_dir)
        check_same_tokenizer(
            load_tokenizer(cfg),
            load_tokenizer(dataclasses.replace(cfg, model=str(path), tokenizer=None)),
            name,
        )
        # this rank's heads under tensor parallelism: the draft is sharded like the target, its pool too
        self.config: ModelConfig = parallel.rank_view(load_model_config(Path(path)), parallel.current())
        self.dtype = resolve_dtype(cfg.dtype, self.config, device, path)
        self.model: CausalLM = load_model(path, self.dtype, device, max_positions=max_positions)
        # its KV stored as the target's (`--kv-cache-dtype` names the engine's caches, as vLLM's), with
        # the draft checkpoint's own k/v scales where an fp8 cache has them
        self.kv_dtype = kv_cache_dtype(cfg.kv_cache_dtype, self.dtype, self.model.kv_cache_format)
        mc = self.config
        probe = Probe(
            mc.num_heads,
            mc.num_kv_heads,
            mc.head_dim,
            self.dtype,
            mc.sliding_window,
            mc.attn_logit_softcapping,
            self.kv_dtype,
        )
        self.backend = make_backend(cfg.attention_backend, device, probe)
        # drafts are target token ids: never a column past the target's vocabulary (or the draft's)
        self.vocab = min(vocab_size, mc.vocab_size)
        self.pool: KVPool | None = None

    @property
    def bytes_per_token(self) -> int:
        """Draft KV bytes per token: the target's plan sizes its pool with this added per token."""
        mc = self.config
        return KVPool.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, self.kv_dtype)

    def make_pool(self, num_pages: int, page_size: int, device: torch.device) -> None:
        """The draft's KV pool: as many pages as the target's, so the target's slots index it."""
        scales = self.model.kv_cache_scales
        self.pool = KVPool.for_model(self.config, num_pages, page_size, self.kv_dtype, device, scales)

    def forward(self, ids: Tensor, positions: Tensor, slots: Tensor, meta: AttentionMetadata) -> Tensor:
        """The draft decoder over a flat batch placed like the target's; hidden states [T, hidden]."""
        assert self.pool is not None
        return self.model(ids, ForwardContext.prepared(positions, slots, self.pool, self.backend, meta))

    def mirror(self, ids: Tensor, positions: Tensor, slots: Tensor, meta: AttentionMetadata) -> None:
        """Run the draft on what the target just ran, so its KV follows the target's token for token. A
        no-op before the pool exists (the target's memory measurement runs dummies then)."""
        if self.pool is not None:
            self.forward(ids, positions, slots, meta)

    def propose(
        self,
        rows: torch.Tensor,
        starts: torch.Tensor,
        first: torch.Tensor,
        num_drafts: torch.Tensor,
        k: int,
        table: ReqTable,
        max_seq_len: int,
    ) -> torch.Tensor:
        """Drafts [B, k]: for each row, `num_drafts[b]` greedy draft tokens after `first[b]`, which sits at
        position `starts[b]` (the row's committed KV length). Step i runs each row's latest token at
        `starts + i`; a row past its own drafts writes the padding slot 0 and its columns are never read.
        All on the device: no sync."""
        b = rows.shape[0]
        ones = torch.ones(b, dtype=torch.int64, device=rows.device)
        q_start = torch.arange(b, dtype=torch.int64, device=rows.device)
        token, out = first, []
        device_table = table.device_table
        assert device_table is not None, "the draft's request table lives on its device"
        for i in range(k):
            live = num_drafts > i
            positions = torch.where(live, starts + i, 0)
            slots = torch.where(live, device_table[rows, positions].long(), 0)
            # max_seq_len bounds every row's length (the host knows no row's own): a capacity, `static`
            meta = AttentionMetadata(
                rows, positions, ones, q_start, device_table, 1, max_seq_len, True, static=True
            )
            hidden = self.forward(token, positions, slots, meta)
            token = self.model.logits(hidden)[:, : self.vocab].argmax(dim=-1)
            out.append(token)
        return torch.stack(out, dim=1)
