"""Issue 11 item 4, the LM head and sampling: fewer float32 [batch, vocab] tensors a step, greedy without
the sampling pipeline, top-k by a partial sort; the same tokens as before, seeded draws included."""

from __future__ import annotations

import dataclasses

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gapless.sampling import sampler as sampler_mod
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
        inputs = {  # (an opaque input, a CPU-packed oneDNN weight, has no storage to share)
            a.untyped_storage().data_ptr()
            for a in (*args, *(kwargs or {}).values())
            if torch.is_tensor(a) and a.layout == torch.strided
        }
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if torch.is_tensor(t) and t.dtype == torch.float32 and tuple(t.shape) == self.shape:
                self.new_fp32 += t.untyped_storage().data_ptr() not in inputs
        return out


def _batch(params: list[SamplingParams], steps: int = 0, device: torch.device = CPU) -> SamplingBatch:
    n = len(params)
    resolved = [p.resolved() for p in params]  # as the engine queues them: no knob unset
    seeds = list(range(100, 100 + n))
    return SamplingBatch.build(resolved, [steps] * n, list(range(n)), seeds, device, VOCAB)


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


def test_sampled_batch_makes_one_float32_working_copy():
    """Temperature + top-k over bf16 logits: one new float32 [B, V], the scaled copy the filters change in
    place; the Gumbel noise is made in place in an int32 [B, V] hash buffer (before: the fp32 upcast, the
    scaled copy, the sort's sorted copy and the noise, beside three int64 [B, V] buffers)."""
    logits = torch.randn(4, VOCAB).to(torch.bfloat16)
    batch = _batch([SamplingParams(temperature=0.7, top_k=20), SamplingParams(temperature=0.0)] * 2)
    sampler = Sampler(VOCAB, 4, CPU)
    with _Watch((4, VOCAB)) as watch:
        sampler.sample(logits, batch)
    assert watch.new_fp32 == 1, watch.ops
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


def _lowbias32(x: int) -> int:
    m = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


def test_gumbel_noise_is_the_documented_hash_bit_for_bit():
    """The int32 hashing (products wrapping around) gives the bits of the 32-bit hash the sampler's seeded
    streams are defined by, computed here on Python ints: the same noise as the int64 hashing gave."""
    golden, m = 0x9E3779B9, 0xFFFFFFFF
    seeds = torch.tensor([0, -1, 2**63 - 1, -(2**63), 12345678901234567])
    steps = torch.tensor([0, 7, 1, 2**31, 99])
    cols = [0, 1, 2, 150_000, 151_935]
    keys = sampler_mod._row_keys(seeds, steps)
    hashes = sampler_mod._bits_as_int32(sampler_mod._column_hashes(151_936, CPU))
    noise = sampler_mod.gumbel_noise(keys, hashes)[:, cols]
    want = []
    for seed, step in zip(seeds.tolist(), steps.tolist()):
        s = seed % 2**64
        key = _lowbias32(_lowbias32(_lowbias32((s >> 32) ^ golden) ^ (s & m)) ^ (step & m))
        want.append([(_lowbias32(key ^ _lowbias32((c * golden + 1) & m)) >> 9) + 0.5 for c in cols])
    u = torch.tensor(want, dtype=torch.float32).mul_(2.0**-23)
    assert torch.equal(noise, u.log_().neg_().log_().neg_())


def test_top_p_under_a_top_k_skips_the_full_sort_and_keeps_its_tokens():
    """Top-p rows with a top-k <= PARTIAL_SORT_MAX_K find their nucleus among their largest logits
    (`torch.topk`, no sort of the vocabulary): the tokens Hugging Face's warpers keep, and seeded draws
    token for token those of the full sort, in the batch or beside a top-p row without a top-k (which
    sorts the whole vocabulary for its batch): a row's tokens never depend on which path its batch took."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    vocab = 3 * sampler_mod.PARTIAL_SORT_MAX_K
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(5, vocab, generator=g) * 3
    logits[0, 7:12] = logits[0].topk(40).values[-1]  # ties around row 0's nucleus edge
    params = [
        SamplingParams(temperature=0.9, top_k=900, top_p=0.6),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.1, top_k=50),  # top-k alone beside top-p
        SamplingParams(temperature=0.7, top_k=1024, top_p=0.97, min_p=0.01),
        SamplingParams(temperature=1.5, top_k=3, top_p=0.3),
    ]

    def batch(ps: list[SamplingParams], step: int, seeds: list[int]) -> SamplingBatch:
        return SamplingBatch.build(
            [p.resolved() for p in ps], [step] * len(ps), list(range(len(ps))), seeds, CPU, vocab
        )

    sampler = Sampler(vocab, 6, CPU)
    seeds = list(range(100, 105))
    scaled = logits / torch.tensor([p.temperature or 1.0 for p in params])[:, None]
    with _Watch((5, vocab)) as watch:
        kept = sampler.apply_filters(scaled.clone(), batch(params, 0, seeds))
    assert "sort.default" not in watch.ops and "topk.default" in watch.ops
    nucleus = [SamplingParams(temperature=0.9, top_k=900, top_p=0.6), SamplingParams(temperature=0.0)] * 2
    with _Watch((4, vocab)) as watch:  # bf16 logits: one float32 [B, V], the scaled copy, and no sort
        sampler.sample(logits[:4].to(torch.bfloat16), batch(nucleus, 0, seeds[:4]))
    assert watch.new_fp32 == 1 and "sort.default" not in watch.ops, watch.ops
    for i in (0, 2, 4):
        p = params[i]
        ref = TopKLogitsWarper(p.top_k)(None, TemperatureLogitsWarper(p.temperature)(None, logits[i : i + 1]))
        ref = TopPLogitsWarper(p.top_p)(None, ref) if p.top_p is not None else ref
        assert torch.equal(torch.isfinite(kept[i]), torch.isfinite(ref[0])), i
    assert int(torch.isfinite(kept[0]).sum()) > 5  # the ties are kept together
    unbounded = SamplingParams(temperature=1.0, top_p=0.9)  # no top-k: the full sort for its batch
    extra_row = torch.randn(1, vocab, generator=g)
    for step in range(30):
        partial = batch(params, step, seeds)
        assert partial.max_top_p_k == 1024
        want = sampler.sample(logits, partial)
        full = dataclasses.replace(partial, max_top_p_k=0)  # 0: unknown, the full sort
        assert torch.equal(sampler.sample(logits, full), want)
        mixed = batch([*params, unbounded], step, [*seeds, 7])
        assert mixed.max_top_p_k == vocab
        assert torch.equal(sampler.sample(torch.cat([logits, extra_row]), mixed)[:5], want)


class _OldSampler(Sampler):
    """The sampler's penalties and scaling as they were before the step kept to one float32 [B, V] copy
    (`torch.where` over two float32 branches, then a second copy for the temperature): the reference the
    seeded draws must keep matching, and the count the new code must beat."""

    def apply_penalties(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        logits = logits.float()
        counts_all, prompt_all = self._penalty_state()
        counts = counts_all.index_select(0, batch.rows)
        in_output = counts > 0
        seen = prompt_all.index_select(0, batch.rows).logical_or_(in_output)
        rep = batch.repetition_penalty.unsqueeze(1)
        logits = torch.where(seen, torch.where(logits < 0, logits * rep, logits / rep), logits)
        logits -= batch.frequency_penalty.unsqueeze(1) * counts
        logits -= batch.presence_penalty.unsqueeze(1) * in_output
        return logits

    def _draw(self, logits: torch.Tensor, batch: SamplingBatch, owned: bool = False) -> torch.Tensor:
        keys = sampler_mod._row_keys(batch.seeds, batch.steps)
        scale = not (batch.need_top_k or batch.need_top_p or batch.need_min_p)
        if not scale:
            temperature = batch.temperature.masked_fill(batch.temperature == 0, 1.0)
            logits = self.apply_filters(logits / temperature.unsqueeze(1), batch)
        hashes = self._column_hashes
        return sampler_mod.gumbel_argmax(logits, batch.temperature, keys, hashes, scale, batch.any_greedy)


PENALISED = [
    SamplingParams(temperature=0.8, repetition_penalty=1.3, top_k=30),
    SamplingParams(temperature=0.0, frequency_penalty=0.4),  # greedy, penalised
    SamplingParams(temperature=1.1, top_p=0.9, presence_penalty=0.6, frequency_penalty=-0.2),
    SamplingParams(temperature=0.7),  # no penalties beside penalised rows: neutral (1, 0, 0)
    SamplingParams(temperature=1.4, repetition_penalty=0.8, presence_penalty=0.3, frequency_penalty=0.3),
]
# top-k alone (no full sort, whose sorted copy is a float32 [B, V] of its own): what the counts measure
PENALISED_TOP_K = [*PENALISED[:2], dataclasses.replace(PENALISED[2], top_p=1.0, top_k=50), *PENALISED[3:]]
UNFILTERED = [  # no filter: the draw scales; an owned (penalised) copy is scaled in place first
    SamplingParams(temperature=0.9, repetition_penalty=1.2, frequency_penalty=0.5),
    SamplingParams(temperature=0.0, presence_penalty=1.0),
    SamplingParams(temperature=1.3),
]


def _seeded_penalised_runs(make: type[Sampler], params: list[SamplingParams], steps: int, dtype: torch.dtype):
    """`steps` tokens of each row of a `make` sampler whose rows start with prompts, over fresh logits each
    step; asserts the caller's logits come back unchanged."""
    n = len(params)
    sampler = make(VOCAB, n + 2, CPU)
    rows = list(range(n + 1, 0, -1))[:n]  # request-table rows out of batch order
    sampler.init_rows(rows, [[1, 2, 3, 3, 7 * i] for i in range(n)], [[]] * n)
    g = torch.Generator().manual_seed(11)
    resolved = [p.resolved() for p in params]
    out = []
    for step in range(steps):
        logits = (torch.randn(n, VOCAB, generator=g) * 3).to(dtype)
        before = logits.clone()
        seeds = [1000 + i for i in range(n)]
        batch = SamplingBatch.build(resolved, [step] * n, rows, seeds, CPU, VOCAB)
        out.append(sampler.sample(logits, batch))
        assert torch.equal(logits, before)
    return torch.stack(out)


def test_penalised_seeded_draws_are_the_old_samplers():
    """Penalties (torch path) + temperature + top-k/top-p, and without filters (the penalised copy scaled in
    place): over 30 steps, in fp32 and bf16, each row's tokens are those the old sampler drew."""
    for params in (PENALISED, UNFILTERED):
        for dtype in (torch.float32, torch.bfloat16):
            want = _seeded_penalised_runs(_OldSampler, params, 30, dtype)
            got = _seeded_penalised_runs(Sampler, params, 30, dtype)
            assert torch.equal(got, want), (params, dtype)
            assert len(set(want[:, 0].tolist())) > 5  # the draws are not degenerate


def _penalised_step(sampler: Sampler, params: list[SamplingParams]) -> tuple[_Watch, torch.Tensor]:
    n = len(params)
    sampler.init_rows(list(range(n)), [[1, 2, 3]] * n, [[4, 4, 5]] * n)
    logits = (torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(1)) * 2).to(torch.bfloat16)
    logits = logits.to(sampler.device)
    with _Watch((n, VOCAB)) as watch:
        tokens = sampler.sample(logits, _batch(params, steps=3, device=sampler.device))
    return watch, tokens.cpu()


def test_penalised_step_makes_fewer_float32_copies():
    """A penalised sampled step over bf16 logits, torch path: the penalised copy and one buffer for the
    penalties' factors (top-k and the draw work in place on the copy); the old code made more."""
    for params in (PENALISED_TOP_K, UNFILTERED):
        old, old_tokens = _penalised_step(_OldSampler(VOCAB, 8, CPU), params)
        new, tokens = _penalised_step(Sampler(VOCAB, 8, CPU), params)
        assert torch.equal(tokens, old_tokens)
        assert new.new_fp32 == 2, new.ops
        assert old.new_fp32 > new.new_fp32


def test_penalised_step_with_the_kernel_makes_one_float32_copy():
    """With the fused penalties (Triton: on the GPU where there is one, else under the interpreter) a
    penalised sampled step over bf16 logits makes exactly one float32 [B, V]: the kernel's output, which
    temperature and filters change in place."""
    from gapless.testing.triton import import_kernels_or_skip

    kernels = import_kernels_or_skip("gapless.sampling.triton_penalties")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for params in (PENALISED_TOP_K, UNFILTERED):
        sampler = Sampler(VOCAB, 8, device)
        sampler.penalty_kernel = kernels.apply_penalties
        watch, tokens = _penalised_step(sampler, params)
        assert watch.new_fp32 == 1, watch.ops
        assert torch.equal(tokens, _penalised_step(_OldSampler(VOCAB, 8, CPU), params)[1])


def test_logit_bias_adds_into_the_gathered_bias_bit_for_bit():
    """`constrain` adds the logits into the rows' gathered bias: the bits of `logits.float() + bias`, for
    fp32, bf16 and fp16 logits, with one new float32 [B, V] (the old sum made three from bf16)."""
    params = [
        SamplingParams(logit_bias={3: 5.0, 10: -100.0, 299: 0.3}),
        SamplingParams(),
        SamplingParams(logit_bias={0: -0.7, 3: 1e-3}),
    ]
    sampler = Sampler(VOCAB, 6, CPU)
    rows = [4, 1, 2]
    values, _, _ = sampler_mod.RowParams.build([p.resolved() for p in params], rows, [0, 0, 0], VOCAB)
    sampler.write_rows(values)
    batch = SamplingBatch.build([p.resolved() for p in params], [0] * 3, rows, [0] * 3, CPU, VOCAB)
    assert batch.need_bias
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        logits = (torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
        with _Watch((3, VOCAB)) as watch:
            got = sampler.constrain(logits, batch, None)
        with _Watch((3, VOCAB)) as old:
            want = logits.float() + sampler.logit_bias.index_select(0, batch.rows)
        assert got.dtype == torch.float32 and torch.equal(got, want), dtype
        assert watch.new_fp32 == 1 and old.new_fp32 > watch.new_fp32, (watch.ops, old.ops)
        assert got[0, 10] < logits[0, 10].float() - 99 and torch.equal(got[1], logits[1].float())


def test_min_p_in_log_space_keeps_transformers_tokens_with_no_float_copy():
    """min-p decided as ``logit >= max + log(min_p)``: the kept sets of transformers' `MinPLogitsWarper`
    (which compares probabilities) on random rows, ties at the max included; no new float32 [B, V] tensor
    (the softmax made one); rows with min_p 0 (rows without min-p, greedy ones among them) untouched, and
    a row of -inf logits (masked earlier) stays -inf without a NaN."""
    from transformers import MinPLogitsWarper

    g = torch.Generator().manual_seed(8)
    logits = torch.randn(8, VOCAB, generator=g)
    logits[2, [5, 50, 120]] = logits[2].max() + 1.0  # three tokens tied at the max
    logits[3, :] = 0.5  # all tied
    logits[4, ::2] = float("-inf")  # masked by an earlier filter
    min_ps = [0.01, 0.1, 0.5, 1.0, 0.1, 0.05, 0.5, 0.2]
    for i, m in enumerate(min_ps):
        want = torch.isfinite(MinPLogitsWarper(m)(None, logits[i : i + 1].clone()))[0]
        got = sampler_mod.apply_min_p(logits[i : i + 1].clone(), torch.tensor([m]))
        assert torch.equal(torch.isfinite(got[0]), want), (i, m)
        assert torch.equal(got[0][want], logits[i][want])  # kept tokens keep their logits
    assert int(torch.isfinite(sampler_mod.apply_min_p(logits[2:3].clone(), torch.tensor([1.0]))).sum()) == 3
    kept = [
        int(torch.isfinite(sampler_mod.apply_min_p(logits[:1].clone(), torch.tensor([m]))).sum())
        for m in min_ps
    ]
    assert kept[0] > kept[1] > kept[2] > 1  # the threshold moves with min_p

    # in a batch: min_p 0 rows (as `rows.row_values` gives rows without min-p, and greedy ones) untouched
    params = [
        SamplingParams(min_p=0.3),
        SamplingParams(),
        SamplingParams(temperature=0.0),
        SamplingParams(min_p=0.9),
    ]
    batch = _batch(params)
    assert batch.min_p.tolist()[1:3] == [0.0, 0.0] and batch.need_min_p
    x = logits[[0, 1, 2, 5]].clone()
    x[1, :7] = float("-inf")
    x[2] = float("-inf")
    before = x.clone()
    with _Watch((4, VOCAB)) as watch:
        out = sampler_mod.apply_min_p(x, batch.min_p)
    assert watch.new_fp32 == 0, watch.ops
    assert torch.equal(out[1:3], before[1:3]) and not out.isnan().any()
    assert torch.isinf(out[0]).sum() > torch.isinf(before[0]).sum() and torch.isinf(out[3]).sum() > 0
