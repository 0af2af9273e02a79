"""Multi-LoRA serving: PEFT adapters on the decoder's linear layers, many of them in one batch.

`adapter.py` reads and checks a PEFT adapter against the base model and lays its weights out on gapless's
fused layers; `table.py` is the device's resident table (stacked A/B per layer, one slot per adapter) and
the delta each layer adds after its base output; `ops.py` computes that delta (torch, or Triton on CUDA);
`slots.py` is the host's side: which adapter sits in which slot (LRU) and what a batch loads first.
A row's slot is batch data (`ForwardBatch.lora_slots`, -1 for the base model).
"""

from gapless.lora.request import LoRARequest

__all__ = ["LoRARequest"]
