"""The physical KV cache: per layer, one K and one V tensor indexed directly by slot id."""

from __future__ import annotations

import torch


class KVPool:
    """Per-layer K and V storage of shape ``[num_pages * page_size, num_kv_heads, head_dim]``.

    Slot ids (``page * page_size + offset``) index the first dimension directly, so attention
    kernels gather with the request table and never translate addresses. Each side is one
    allocation (``k_buffer``/``v_buffer``, ``[num_layers, slots, kvh, hd]``); ``k[layer]`` and
    ``v[layer]`` are views of it, for kernels that want a single base pointer.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_slots = num_pages * page_size
        shape = (num_layers, self.num_slots, num_kv_heads, head_dim)
        # Zeros, not empty: padding tokens and masked-out reads touch slot 0 and unwritten slots, and a
        # NaN there would survive a zero attention weight (0 * NaN = NaN).
        self.k_buffer = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v_buffer = torch.zeros(shape, dtype=dtype, device=self.device)
        self.k: list[torch.Tensor] = list(self.k_buffer.unbind(0))
        self.v: list[torch.Tensor] = list(self.v_buffer.unbind(0))

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """KV bytes one token costs across all layers (K and V), for sizing the pool from free memory."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * itemsize

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``/``v`` (``[n, kvh, hd]``) into ``slots`` (int64 ``[n]``, on the pool's device) in place.

        Enqueued in stream order like any kernel, so a forward already in flight never sees it.
        """
        self.k[layer].index_copy_(0, slots, k.to(self.dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.dtype))
