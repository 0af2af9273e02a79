"""On-device sampling: penalties, temperature, top-k/top-p/min-p and a seeded draw, in bulk tensor ops.

The sampler runs inside the device stream right after the forward, so it must never wait for the
host: no ``.item()``, no boolean-mask indexing, no per-request Python. Every per-request decision is
made on the host once, when the request is admitted (`gapless.sampling.rows`): its values live in the
sampler's per-row state on the device, and each batch brings only its rows, their step counts and a few
Python flags that let whole stages be skipped when no row needs them.

Randomness is counter-based: the noise for (request seed, output step, vocab column) is a hash of
those three numbers, so a seeded request draws the same tokens whatever else shares its batch,
whichever row it sits in, and after being retracted and resumed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from gapless.sampling.filters import (
    PARTIAL_SORT_MAX_K,
    NucleusKernel,
    apply_min_p,
    apply_top_k,
    apply_top_k_top_p,
    apply_top_k_top_p_partial,
    apply_top_k_top_p_searched,
)
from gapless.sampling.logprobs import PromptScores
from gapless.sampling.mask import TokenMask, apply_token_mask
from gapless.sampling.rows import FLOAT_FIELDS, INT_FIELDS, RowParams, SampleFlags
from gapless.sampling_params import SamplingParams
from gapless.tensors import to_device

_MASK32 = 0xFFFFFFFF
# lowbias32 (Chris Wellons' hash prospector): a 32-bit mixer with very low avalanche bias. The second
# multiplier is >= 2**31, so it is used as its negative twin (same residue mod 2**32): a 32-bit value
# times a constant of magnitude <= 2**31 always fits in int64, so no product ever overflows; held as the
# bits of int32 values, the products wrap around, which keeps the same low 32 bits.
_MUL1 = 0x7FEB352D
_MUL2 = 0x846CA68B - (1 << 32)
_GOLDEN = 0x9E3779B9  # odd, so multiplying by it permutes 32-bit values
_UNIFORM_BITS = 23  # n + 0.5 with n < 2**23 is exact in float32, so u lies strictly inside (0, 1)
# `apply_penalties`' signature: (logits, counts, prompt_mask, rows, repetition, frequency, presence)
PenaltyKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    torch.Tensor,
]


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """Hash 32-bit values in place (lowbias32): values in [0, 2**32) held in an int64 tensor, or the
    values' bits held in an int32 tensor (a quarter of the memory, for the [batch, vocab] hashes)."""
    wide = x.dtype == torch.int64
    x.bitwise_xor_(_shr(x, 16))
    x.mul_(_MUL1)
    if wide:
        x.bitwise_and_(_MASK32)
    x.bitwise_xor_(_shr(x, 15))
    x.mul_(_MUL2)
    if wide:
        x.bitwise_and_(_MASK32)
    return x.bitwise_xor_(_shr(x, 16))


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """32-bit values shifted right by `n` as unsigned (int32 shifts in the sign bit: masked off)."""
    return (x >> n).bitwise_and_((1 << (32 - n)) - 1)


def _bits_as_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) as int32 tensors holding the same 32 bits."""
    return (x - ((x >> 31) << 32)).to(torch.int32)


def _row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One well-mixed 32-bit key per row from its (seed, step): the row's random stream for this token."""
    key = _mix32_((seeds >> 32).bitwise_and(_MASK32).bitwise_xor_(_GOLDEN))
    key = _mix32_(key.bitwise_xor_(seeds.bitwise_and(_MASK32)))
    return _mix32_(key.bitwise_xor_(steps.bitwise_and(_MASK32)))


def _column_hashes(vocab_size: int, device: torch.device) -> torch.Tensor:
    """A fixed hash per vocab column; xor-ing it with a row key gives independent inputs per column."""
    cols = torch.arange(vocab_size, dtype=torch.int64, device=device)
    return _mix32_(cols.mul_(_GOLDEN).add_(1).bitwise_and_(_MASK32))


def gumbel_noise(keys: torch.Tensor, column_hashes: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise [B, V] as a pure function of each row's key and the column index.

    ``argmax(logits + gumbel)`` is a draw from ``softmax(logits)``; it is the same exponential race as
    ``argmax(probs / Exp(1))`` taken in log space, where masked (-inf) tokens simply never win.

    The hashes are int32 (`keys` int64 [B] as `_row_keys` makes them, `column_hashes` int32 [V] as
    `_bits_as_int32` of `_column_hashes`), and their [B, V] tensor becomes the noise in place, so the noise
    costs one 4-byte [B, V] buffer (with int64 hashes: two 8-byte ones and the float32 noise).
    """
    x = _mix32_(_bits_as_int32(keys)[:, None] ^ column_hashes[None, :])
    n = x.bitwise_right_shift_(32 - _UNIFORM_BITS).bitwise_and_((1 << _UNIFORM_BITS) - 1)
    u = n.view(torch.float32)
    u.copy_(n)  # int -> float over the same memory, element by element (n < 2**23: exact)
    return u.add_(0.5).mul_(2.0**-_UNIFORM_BITS).log_().neg_().log_().neg_()


def gumbel_argmax(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    keys: torch.Tensor,
    column_hashes: torch.Tensor,
    scale: bool,
    any_greedy: bool = True,
) -> torch.Tensor:
    """The seeded draw in torch: each row's argmax of ``logits / temperature`` (`scale`; else logits
    already scaled and filtered) plus its Gumbel noise (`gumbel_noise` of `keys`, `_row_keys` of the
    rows); rows of temperature 0 take the argmax of `logits` (computed only when `any_greedy`).
    `gapless.sampling.triton_sample.draw` hashes the same noise in its kernel."""
    is_greedy = temperature == 0
    greedy_tokens = logits.argmax(dim=-1) if any_greedy else None
    if scale:  # the division computes in fp32 whatever the logits' dtype, into a new tensor
        logits = logits / temperature.masked_fill(is_greedy, 1.0).unsqueeze(1)
    tokens = gumbel_noise(keys, column_hashes).add_(logits).argmax(dim=-1)
    return tokens if greedy_tokens is None else torch.where(is_greedy, greedy_tokens, tokens)


def apply_penalties(
    logits: torch.Tensor,
    counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    rows: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """The penalised logits in torch: a new float32 [B, V] tensor, `logits` [B, V] (any float dtype) left
    as they are. Row i reads the state of request-table row ``rows[i]`` (`counts` int32 and `prompt_mask`
    bool, both [max_rows, V]) and its penalties ([B] float32 each).

    Repetition (Hugging Face, over prompt + output tokens): ``x * rep`` where x < 0, else ``x / rep``; then
    ``x - frequency * count`` and ``x - presence * (count > 0)`` (OpenAI, output tokens only), each op
    rounded on its own. Neutral rows (1, 0, 0) come out bit-identical. The repetition is applied as a
    multiplication then a division by a factor that is 1 where the row does not take that branch (x * 1 and
    x / 1 are exact): the same bits as choosing between ``x * rep`` and ``x / rep``, with one float32 [B, V]
    buffer, reused for every factor, beside the result. `gapless.sampling.triton_penalties` makes the same
    bits in one pass."""
    out = logits.to(torch.float32, copy=True)
    counts = counts.index_select(0, rows)
    in_output = counts > 0
    seen = prompt_mask.index_select(0, rows).logical_or_(in_output)
    negative = out < 0
    rep, one = repetition.unsqueeze(1), repetition.new_ones(())
    factor = torch.where(seen & negative, rep, one)
    out.mul_(factor)
    out.div_(torch.where(seen.logical_and_(negative.logical_not_()), rep, one, out=factor))
    out.sub_(torch.mul(counts, frequency.unsqueeze(1), out=factor))
    return out.sub_(torch.mul(in_output, presence.unsqueeze(1), out=factor))


@dataclass(frozen=True, kw_only=True)
class SamplingBatch(SampleFlags):
    """Per-row sampling settings of one batch, as device tensors, with the flags (`SampleFlags`) that say
    which stages run. In the engine the sampler gathers them from its per-row state (`Sampler.batch`);
    `build` makes one from params directly (tests, tools).

    Greedy rows carry temperature 0 and neutral filter settings (`gapless.sampling.rows.row_values`), so
    the device can tell them apart without another tensor and their settings never trigger a stage. The
    flags are computed on the host, which is what lets the sampler skip stages without a device sync.
    """

    temperature: torch.Tensor  # [B] float32; 0 marks a greedy row
    top_k: torch.Tensor  # [B] int64; "disabled" is vocab_size (or larger; clamped on the device)
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64
    steps: torch.Tensor  # [B] int64: output tokens the request had before this one
    rows: torch.Tensor  # [B] int64: request-table rows, index the penalty state
    repetition_penalty: torch.Tensor  # [B] float32
    presence_penalty: torch.Tensor  # [B] float32
    frequency_penalty: torch.Tensor  # [B] float32
    penalised: torch.Tensor  # [B] int32: 1 where the row's sampled tokens must be counted

    @property
    def size(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def from_values(
        cls,
        floats: torch.Tensor,
        ints: torch.Tensor,
        steps: torch.Tensor,
        rows: torch.Tensor,
        flags: SampleFlags,
    ) -> SamplingBatch:
        """From per-row values (`floats` [len(FLOAT_FIELDS), B], `ints` [len(INT_FIELDS), B], in the order
        of `gapless.sampling.rows`) already on the device, with the batch's `steps`, `rows` and flags."""
        temperature, top_p, min_p, repetition, presence, frequency = floats.unbind(0)
        top_k, seeds, penalised = ints.unbind(0)
        return cls(
            temperature=temperature,
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=repetition,
            presence_penalty=presence,
            frequency_penalty=frequency,
            top_k=top_k,
            seeds=seeds,
            steps=steps,
            rows=rows,
            penalised=penalised.to(torch.int32),
            **dataclasses.asdict(flags),
        )

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        steps: Sequence[int],
        rows: Sequence[int],
        seeds: Sequence[int],
        device: torch.device | str,
        vocab_size: int | None = None,
    ) -> SamplingBatch:
        """The batch of `params` on ``device``, its values copied there in two tensors.

        ``seeds`` are the effective seeds (the engine picks one for requests without ``params.seed``);
        ``steps[i]`` is how many output tokens request i already has. ``vocab_size``, when given, lets
        top_k >= vocab count as disabled on the host, so such rows do not force the sort stage.
        """
        n = len(params)
        if not (len(steps) == len(rows) == len(seeds) == n):
            lengths = (n, len(steps), len(rows), len(seeds))
            raise ValueError(f"params, steps, rows, seeds differ in length: {lengths}")
        device = torch.device(device)
        values, stages, logprobs = RowParams.build(params, rows, seeds, vocab_size)
        ints = torch.cat([values.ints, torch.tensor([list(steps)], dtype=torch.int64).reshape(1, n)])
        ints = to_device(torch.cat([ints, values.rows[None]]), device)
        floats = to_device(values.floats, device)
        flags = SampleFlags.of(stages, logprobs, values.ints[0].numpy())
        return cls.from_values(floats, ints[:3], ints[3], ints[4], flags)


# the sampler's whole draw as kernels (`gapless.sampling.triton_sample` through `gapless.sampling.fused`)
DrawKernel = Callable[[torch.Tensor, SamplingBatch], torch.Tensor]


@dataclass
class SampleOutput:
    """One batch's sampled tokens and, when asked for, their logprobs (device tensors)."""

    tokens: torch.Tensor  # [S] int64
    logprobs: torch.Tensor | None = None  # [S] float32: log p(sampled token)
    top_ids: torch.Tensor | None = None  # [S, k] int64: the k most likely tokens, most likely first
    top_logprobs: torch.Tensor | None = None  # [S, k] float32
    prompt: PromptScores | None = None  # prompt logprobs, when the batch scores prompt positions
    pooled: torch.Tensor | None = None  # [pooled requests, H or K] float32 (gapless.engine.pooling)

    def tensors(self) -> list[torch.Tensor]:
        own = [t for t in (self.tokens, self.logprobs, self.top_ids, self.top_logprobs) if t is not None]
        pooled = [self.pooled] if self.pooled is not None else []
        return own + (self.prompt.tensors() if self.prompt is not None else []) + pooled


def compute_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> SampleOutput:
    """Logprobs of the sampled tokens and the top `k` of each row, from the raw logits (fp32)."""
    logprobs = logits.float().log_softmax(dim=-1)
    top_lps, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (logprobs[:, :0], tokens[:, None][:, :0])
    return SampleOutput(tokens, logprobs.gather(1, tokens[:, None]).squeeze(1), top_ids, top_lps)


class Sampler:
    """Turns a batch of last-position logits into next tokens, on the device, without host syncs.

    Per-row state lives here, on the device, so a step costs no host work per request: the sampling
    values of each request-table row (``write_rows`` when a request enters a row, ``batch`` gathers a
    step's), and the penalty state (token counts per row: ``init_rows`` fills a row when its request
    (re)enters the running set, ``sample`` adds each sampled token). All of it changes in device-stream
    order (as part of the submitted jobs), so a row is filled before the first batch that reads it.
    """

    def __init__(self, vocab_size: int, max_rows: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.max_rows = max_rows
        self.device = torch.device(device)
        self._column_hashes = _bits_as_int32(_column_hashes(vocab_size, self.device))
        # per-row sampling values (gapless.sampling.rows' order), written when a request enters a row
        self.row_floats = torch.zeros(len(FLOAT_FIELDS), max_rows, dtype=torch.float32, device=self.device)
        self.row_ints = torch.zeros(len(INT_FIELDS), max_rows, dtype=torch.int64, device=self.device)
        # Allocated on first use: [max_rows, vocab] is large, and most workloads never use penalties.
        self.output_counts: torch.Tensor | None = None  # int32: times each token was sampled
        self.prompt_mask: torch.Tensor | None = None  # bool: token occurs in the prompt
        # float32 [max_rows, vocab]: each row's logit_bias (0 elsewhere); allocated when a request has one
        self.logit_bias: torch.Tensor | None = None
        # the whole seeded draw of a batch (temperature, top-k, top-p, min-p, noise; no sort) as a few
        # kernels, `(logits, batch) -> tokens` (`gapless.sampling.fused.draw_kernel` picks it); None: torch
        self.draw_kernel: DrawKernel | None = None
        # the penalties as one kernel, with `apply_penalties`' signature and bits
        # (`gapless.sampling.fused.penalty_kernel` picks it); None: torch ops
        self.penalty_kernel: PenaltyKernel | None = None
        # each row's top-p floor without a sort, for the torch draw (the draw kernel needs none)
        # (`gapless.sampling.fused.nucleus_kernel` picks it); None: top-p no top-k bounds sorts the vocabulary
        self.nucleus_kernel: NucleusKernel | None = None

    def write_rows(self, values: RowParams) -> None:
        """Keep the sampling values of requests entering `values.rows` (on this device)."""
        self.row_floats[:, values.rows] = values.floats
        self.row_ints[:, values.rows] = values.ints
        table = self.logit_bias
        if values.logit_bias and table is None:
            table = self.logit_bias = torch.zeros(
                self.max_rows, self.vocab_size, dtype=torch.float32, device=self.device
            )
        if table is not None:  # a row's bias is its own request's, or none
            table.index_fill_(0, values.rows, 0.0)
        if values.logit_bias and table is not None:
            entries = [
                (r, t, b) for r, bias in values.logit_bias for t, b in bias.items() if t < self.vocab_size
            ]
            rows, toks, vals = zip(*entries) if entries else ((), (), ())
            index = to_device(torch.tensor([rows, toks], dtype=torch.int64).reshape(2, -1), self.device)
            vals_t = to_device(torch.tensor(vals, dtype=torch.float32), self.device)
            table.index_put_((index[0], index[1]), vals_t)

    def batch(self, rows: torch.Tensor, steps: torch.Tensor, flags: SampleFlags) -> SamplingBatch:
        """The `SamplingBatch` of `rows` (each at output step `steps`), gathered from the per-row state."""
        return SamplingBatch.from_values(self.row_floats[:, rows], self.row_ints[:, rows], steps, rows, flags)

    def reset(self) -> None:
        """Every row's values and penalty state as new (after memory-measuring dummies used them)."""
        for state in (self.row_floats, self.row_ints, self.output_counts, self.prompt_mask, self.logit_bias):
            if state is not None:
                state.zero_()

    def _penalty_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.output_counts is None or self.prompt_mask is None:
            shape = (self.max_rows, self.vocab_size)
            self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        return self.output_counts, self.prompt_mask

    def init_rows(
        self, rows: Sequence[int], prompt_ids: Sequence[Sequence[int]], output_ids: Sequence[Sequence[int]]
    ) -> None:
        """Reset the penalty state of ``rows`` and fill it from each request's prompt and output so far.

        Needed only for requests with penalties (``params.has_penalties``), every time one enters the
        running set: on admission (``output_ids`` empty) and when a retracted request resumes (its
        outputs so far). Token ids outside the vocabulary are ignored, as in Hugging Face.
        """
        counts, prompt_mask = self._penalty_state()
        vocab = self.vocab_size
        p_rows = [r for r, ids in zip(rows, prompt_ids, strict=True) for t in ids if 0 <= t < vocab]
        p_toks = [t for ids in prompt_ids for t in ids if 0 <= t < vocab]
        o_rows = [r for r, ids in zip(rows, output_ids, strict=True) for t in ids if 0 <= t < vocab]
        o_toks = [t for ids in output_ids for t in ids if 0 <= t < vocab]
        host = torch.tensor([*rows, *p_rows, *p_toks, *o_rows, *o_toks], dtype=torch.int64)
        flat = to_device(host, self.device)
        row_t, p_rows_t, p_toks_t, o_rows_t, o_toks_t = flat.split(
            [len(rows), len(p_rows), len(p_toks), len(o_rows), len(o_toks)]
        )
        counts.index_fill_(0, row_t, 0)
        prompt_mask.index_fill_(0, row_t, False)
        prompt_mask.index_put_((p_rows_t, p_toks_t), torch.ones_like(p_toks_t, dtype=torch.bool))
        counts.index_put_((o_rows_t, o_toks_t), torch.ones_like(o_toks_t, dtype=torch.int32), accumulate=True)

    def constrain(self, logits: torch.Tensor, batch: SamplingBatch, mask: TokenMask | None) -> torch.Tensor:
        """The logits the batch samples from (and reports logprobs of): each row's token mask (grammar,
        min_tokens) and logit_bias applied; `logits` itself when no row has either."""
        if mask is None and not batch.need_bias:
            return logits
        logits = logits[:, : self.vocab_size]
        if mask is not None:
            logits = apply_token_mask(logits, mask)
        if batch.need_bias and self.logit_bias is not None:
            # the rows' bias is a fresh float32 copy: adding the logits into it (a bf16 operand widens
            # exactly; IEEE addition commutes) gives `logits.float() + bias` bit for bit with one [B, V]
            logits = self.logit_bias.index_select(0, batch.rows).add_(logits)
        return logits

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Return one token id per row (int64 [B], on the device) and record it for penalised rows.

        Order follows vLLM / Hugging Face: penalties on raw logits, greedy rows take the argmax of
        those, then temperature, top-k, top-p, min-p, and a seeded draw for the rest.
        """
        if logits.shape[-1] > self.vocab_size:  # padded lm_head: the extra columns are not tokens
            logits = logits[:, : self.vocab_size]
        if batch.need_penalties:
            logits = self.apply_penalties(logits, batch)
        if batch.all_greedy:
            tokens = logits.argmax(dim=-1)
        else:  # the penalised logits are a fresh float32 copy of the sampler's own: the draw may change it
            tokens = self._draw(logits, batch, owned=batch.need_penalties)
        if batch.need_penalties:
            counts, _ = self._penalty_state()
            counts.index_put_((batch.rows, tokens), batch.penalised, accumulate=True)
        return tokens

    def apply_penalties(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Repetition penalty (HF: over prompt + output) then presence/frequency (OpenAI: output only), into
        a new float32 [B, V] tensor (`logits`, any float dtype, are left as they are): the fused
        `penalty_kernel` when set, else torch ops (`apply_penalties`), the same bits either way.

        Rows without penalties carry neutral values (1, 0, 0), which leave their logits bit-identical.
        """
        counts, prompt_mask = self._penalty_state()
        penalise = self.penalty_kernel if self.penalty_kernel is not None else apply_penalties
        return penalise(
            logits,
            counts,
            prompt_mask,
            batch.rows,
            batch.repetition_penalty,
            batch.frequency_penalty,
            batch.presence_penalty,
        )

    def _draw(self, logits: torch.Tensor, batch: SamplingBatch, owned: bool = False) -> torch.Tensor:
        """Sample the non-greedy rows; greedy rows in a mixed batch get their plain argmax. The draw kernel
        when set: it reads the logits as they come and does every step itself. Else torch ops: without
        filters the temperature is left to `gumbel_argmax`. `owned`: `logits` is a float32 copy the
        sampler made this step (the penalised logits), which may be scaled in place; never the caller's."""
        if self.draw_kernel is not None:
            return self.draw_kernel(logits, batch)
        keys = _row_keys(batch.seeds, batch.steps)
        filters = batch.need_top_k or batch.need_top_p or batch.need_min_p
        scale = True  # the draw divides by the temperature (into a copy)
        if filters or owned:
            temperature = batch.temperature.masked_fill(batch.temperature == 0, 1.0).unsqueeze(1)
            # the step's float32 [B, V] working copy: the division computes in fp32 whatever the logits'
            # dtype, into a new tensor (or in place on an owned copy) the filters then change in place;
            # `x / t` either way, so the same bits as the draw's own scaling
            logits = logits.div_(temperature) if owned else logits / temperature
            scale = False
            if filters:
                logits = self.apply_filters(logits, batch)
        return gumbel_argmax(logits, batch.temperature, keys, self._column_hashes, scale, batch.any_greedy)

    def apply_filters(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Apply top-k, top-p and min-p to temperature-scaled logits (in place); masked tokens are -inf.
        A partial sort (`torch.topk`) where the host knows the batch's k bound what the filters keep; the
        nucleus kernel where they are not (and the host knows the batch's largest top-k); else the sort."""
        k_bounded = 0 < batch.max_top_k <= PARTIAL_SORT_MAX_K or not batch.need_top_k
        top_k = batch.top_k if batch.need_top_k else None
        vocab = logits.shape[-1]
        if batch.need_top_p:
            p_bounded = 0 < batch.max_top_p_k <= PARTIAL_SORT_MAX_K < vocab
            k_known = batch.max_top_k > 0 or not batch.need_top_k
            if p_bounded and k_bounded:
                logits = apply_top_k_top_p_partial(logits, batch.top_k, batch.top_p)
            elif self.nucleus_kernel is not None and k_known and vocab > PARTIAL_SORT_MAX_K:
                logits = apply_top_k_top_p_searched(
                    logits, top_k, batch.top_p, batch.max_top_k, self.nucleus_kernel
                )
            else:
                logits = apply_top_k_top_p(logits, top_k, batch.top_p)
        elif batch.need_top_k:
            if k_bounded:
                logits = apply_top_k(logits, batch.top_k, batch.max_top_k)
            else:
                logits = apply_top_k_top_p(logits, top_k, None)
        if batch.need_min_p:
            logits = apply_min_p(logits, batch.min_p)
        return logits
