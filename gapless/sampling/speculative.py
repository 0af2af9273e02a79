"""Verifying drafted tokens so that the output is exactly what decoding without them would give.

Every position of a verify batch is sampled by the ordinary sampler from the target model's logits, with
the output step it would have had without speculation (its random stream: `sampler._row_keys`). A draft
is accepted when it equals the token sampled at the position before it; the first mismatch ends the run,
and the token sampled there replaces it (the "bonus" token when all drafts pass).

For greedy rows that is exact greedy verification. For sampled rows it is rejection sampling with a point
mass as the draft distribution q = delta(d): the standard rule accepts d with probability
min(1, p(d)/q(d)) = p(d) and on rejection draws from (p - q)+ renormalised, which is p with d removed.
Drawing t ~ p and accepting when t == d does both at once: P(accept) = p(d), and a rejected t is p
conditioned on t != d. So the target distribution is preserved, and because t is drawn from the same
counter-based stream as without speculation, a seeded request gives the same tokens either way.
A draft model's drafts are its argmax (`gapless.engine.spec.draft`): deterministic given the tokens before
them, so their q is a point mass too and the same rule is exact. (Drafts sampled from the draft's own
distribution would need the general rule and the draft's probabilities: not built.)
"""

from __future__ import annotations

import torch


def accept_lengths(
    targets: torch.Tensor,
    inputs: torch.Tensor,
    batch_index: torch.Tensor,
    offsets: torch.Tensor,
    batch: int,
    max_drafts: int,
) -> torch.Tensor:
    """Accepted drafts per request [batch] (int64), on the device, without a sync.

    `inputs` [T] are a verify batch's tokens (per request: the last accepted token, then its drafts) and
    `targets` [T] the tokens sampled after each of them; token j's draft is confirmed when
    `targets[j] == inputs[j + 1]` within the same request. A request accepts its leading confirmed run."""
    grid = torch.zeros(batch, max_drafts + 1, dtype=torch.int64, device=targets.device)
    confirmed = (targets[:-1] == inputs[1:]) & (batch_index[:-1] == batch_index[1:])
    grid[batch_index[:-1], offsets[:-1]] = confirmed.to(torch.int64)
    return grid.cumprod(dim=1).sum(dim=1)
