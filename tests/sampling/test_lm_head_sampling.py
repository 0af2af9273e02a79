"""Issue 11 item 4, the LM head and sampling: fewer float32 [batch, vocab] tensors a step, greedy without
the sampling pipeline, top-k by a partial sort; the same tokens as before, seeded draws included."""

from __future__ import annotations

import dataclasses

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gapless.sampling.sampler import Sampler, SamplingBatch
from gapless.sampling_params import SamplingParams

CPU = torch.device("cpu")
VOCAB = 300


class _Watch(TorchDispatchMode):
    """Records each op and counts the new float32 tensors of `shape` the ops make (in-place results and
    views of their inputs are not new)."""

    def __init__(self, shape: tuple[int, int]) -> None:
        super().__init__()
        self.shape, self.new_fp32, self.ops = shape, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append(func.__name__)
        inputs = {
            a.untyped_storage().data_ptr() for a in (*args, *(kwargs or {}).values()) if torch.is_tensor(a)
        }
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if torch.is_tensor(t) and t.dtype == torch.float32 and tuple(t.shape) == self.shape:
                self.new_fp32 += t.untyped_storage().data_ptr() not in inputs
        return out


def _batch(params: list[SamplingParams], steps: int = 0) -> SamplingBatch:
    n = len(params)
    resolved = [p.resolved() for p in params]  # as the engine queues them: no knob unset
    return SamplingBatch.build(resolved, [steps] * n, list(range(n)), list(range(100, 100 + n)), CPU, VOCAB)


def test_greedy_batch_takes_the_argmax_of_the_model_dtype_logits():
    """A greedy batch makes no float32 copy of bf16 logits (nor any other [B, V] tensor): one argmax."""
    logits = torch.randn(4, VOCAB).to(torch.bfloat16)
    batch = _batch([SamplingParams(temperature=0.0)] * 4)
    sampler = Sampler(VOCAB, 4, CPU)
    with _Watch((4, VOCAB)) as watch:
        tokens = sampler.sample(logits, batch)
    assert watch.new_fp32 == 0 and watch.ops == ["argmax.default"]
    assert torch.equal(tokens, logits.float().argmax(-1))


def test_greedy_step_of_a_bf16_model_makes_no_float32_logits(ckpt_factory):
    """The LM head's logits stay in the model's dtype (transformers upcasts them only after), so a greedy
    step, head and argmax, makes no float32 [B, V] tensor at all."""
    from gapless.model.loader import load_model

    model = load_model(ckpt_factory("qwen3"), torch.bfloat16, CPU)
    vocab = model.cfg.vocab_size
    hidden = torch.randn(3, model.cfg.hidden_size).to(torch.bfloat16)
    sampler = Sampler(vocab, 3, CPU)
    batch = SamplingBatch.build(
        [SamplingParams(temperature=0.0).resolved()] * 3, [0] * 3, [0, 1, 2], [0] * 3, CPU, vocab
    )
    with torch.inference_mode(), _Watch((3, vocab)) as watch:
        logits = model.logits(hidden)
        tokens = sampler.sample(logits, batch)
    assert logits.dtype == torch.bfloat16 and watch.new_fp32 == 0
    assert torch.equal(tokens, logits.float().argmax(-1))


def test_sampled_batch_makes_one_float32_working_copy_besides_the_noise():
    """Temperature + top-k over bf16 logits: the scaled fp32 copy the filters change in place and the
    Gumbel noise (before: the fp32 upcast, the scaled copy, the sort's sorted copy and the noise)."""
    logits = torch.randn(4, VOCAB).to(torch.bfloat16)
    batch = _batch([SamplingParams(temperature=0.7, top_k=20), SamplingParams(temperature=0.0)] * 2)
    sampler = Sampler(VOCAB, 4, CPU)
    with _Watch((4, VOCAB)) as watch:
        sampler.sample(logits, batch)
    assert watch.new_fp32 == 2, watch.ops
    assert "sort.default" not in watch.ops and "topk.default" in watch.ops


def test_top_k_partial_sort_draws_the_full_sorts_tokens():
    """The partial sort (`torch.topk`) masks exactly what the full sort masked, ties with the k-th largest
    kept: seeded draws over many steps are token for token the same, greedy rows and rows without top-k
    beside them."""
    torch.manual_seed(3)
    logits = torch.randn(6, VOCAB)
    logits[:, 100:140] = logits[:, 100:101]  # a wide tie around the k-th largest of row 0
    logits[0, 100:140] = logits[0].sort(descending=True).values[9]
    params = [
        SamplingParams(temperature=1.3, top_k=10),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=1),
        SamplingParams(temperature=1.0),  # top-k off in a top-k batch
        SamplingParams(temperature=2.0, top_k=VOCAB - 1),  # a k near the vocabulary size
        SamplingParams(temperature=0.5, top_k=3, min_p=0.1),
    ]
    sampler = Sampler(VOCAB, 6, CPU)
    for step in range(40):
        partial = _batch(params, step)
        assert partial.max_top_k == VOCAB - 1
        small = _batch([p for i, p in enumerate(params) if i != 4], step)
        assert small.max_top_k == 10
        full_small = dataclasses.replace(small, max_top_k=0)  # 0: unknown, the full sort
        rows = [0, 1, 2, 3, 5]
        assert torch.equal(sampler.sample(logits[rows], small), sampler.sample(logits[rows], full_small))
        full = dataclasses.replace(partial, max_top_k=0)
        assert torch.equal(sampler.sample(logits, partial), sampler.sample(logits, full))
