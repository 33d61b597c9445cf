"""Which tokens top_k, top_p and min_p keep (vLLM's order: min_p, then top_k, then top_p over the
renormalized survivors), decided by value: tokens with equal logits are kept or cut together.

Two ways to the same set. `kept_candidates` works on a row's top-K candidates sorted descending
(the sampler grows K until the kept set fits, or takes the whole vocabulary when it must not read
anything back). `threshold_keep` needs no sort for rows without top_p: min_p and top_k are each a
threshold on the value, so their kept set is a mask over the whole row.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from splitserve.engine.host_staging import device_tensor
from splitserve.sampling_params import SamplingParams


def _mass_strictly_above(vals: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """For sorted-descending candidates, the weight of candidates with a strictly larger value."""
    before = weight.cumsum(dim=1) - weight
    # Tied candidates take the mass before the first of them, so a tie is kept or cut as a whole.
    positions = torch.arange(vals.shape[1], device=vals.device).expand_as(vals)
    starts_tie = torch.ones_like(vals, dtype=torch.bool)
    starts_tie[:, 1:] = vals[:, 1:] != vals[:, :-1]
    tie_start = torch.where(starts_tie, positions, 0).cummax(dim=1).values
    return before.gather(1, tie_start)


def _log_min_p(params: Sequence[SamplingParams], device: torch.device) -> torch.Tensor:
    values = [math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params]
    return device_tensor(values, torch.float32, device)


def _kth(vals: torch.Tensor, params: Sequence[SamplingParams], vocab_size: int) -> torch.Tensor | None:
    """Each row's top_k-th largest of `vals` (sorted descending, at least max top_k wide) as [rows, 1],
    -inf for rows without top_k; None when no row has one."""
    top_k = [min(p.top_k, vocab_size) for p in params]
    if not any(top_k):
        return None
    device = vals.device
    kth_index = device_tensor([max(k, 1) - 1 for k in top_k], torch.long, device)[:, None]
    cut_by_k = device_tensor([k > 0 for k in top_k], torch.bool, device)[:, None]
    return torch.where(cut_by_k, vals.gather(1, kth_index), -math.inf)


def kept_candidates(
    vals: torch.Tensor, logits: torch.Tensor, params: Sequence[SamplingParams]
) -> torch.Tensor:
    """Which of the top-K candidates survive min_p, then top_k, then top_p (over the renormalized
    survivors), as a [rows, K] mask. `vals` are the candidates' logits divided by each row's
    temperature, sorted descending; `logits` the rows' whole unscaled logits.

    A token is kept by top_p when the probability of the tokens strictly more likely than it is
    below `top_p`; by min_p when its probability is at least `min_p` times the largest. With K the
    whole vocabulary nothing is read back to the host.
    """
    device, num_candidates, vocab_size = vals.device, vals.shape[1], logits.shape[1]
    top = vals[:, :1]
    log_min_p = _log_min_p(params, device)
    weight = (vals - top).exp()
    keep = ((vals - top) >= log_min_p[:, None]) & (weight > 0)
    kth = _kth(vals, params, vocab_size)
    if kth is not None:
        keep &= vals >= kth
    top_p = [p.top_p for p in params]
    if any(p < 1.0 for p in top_p):
        weight = weight * keep
        total = weight.sum(dim=1)
        top_p_t = device_tensor(top_p, torch.float32, device)
        spills = keep[:, -1] & (top_p_t < 1.0)
        # survivors past the candidates: renormalize over the whole row (a read-back; never at K = vocab)
        if num_candidates < vocab_size and bool(spills.any()):
            temperature = device_tensor([p.temperature for p in params], torch.float32, device)[spills, None]
            rows = logits[spills] / temperature
            rel = rows - top[spills]
            floor = torch.full_like(top, -math.inf) if kth is None else kth
            survives = (rel >= log_min_p[spills, None]) & (rows >= floor[spills])
            total[spills] = (rel.exp() * survives).sum(dim=1)
        inside = _mass_strictly_above(vals, weight) < (top_p_t * total)[:, None]
        keep &= inside | (top_p_t[:, None] >= 1.0)
    return keep


def threshold_keep(
    scaled: torch.Tensor, params: Sequence[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows without top_p: (the relative log-weights `scaled - max`, the kept mask), both
    [rows, vocab], from `scaled` (the whole rows' logits divided by their temperatures). The same set
    `kept_candidates` finds on candidates that hold it, whatever ties lie past them, with no sort and
    no read-back: min_p keeps `rel >= log(min_p)`, top_k keeps values at least the k-th largest."""
    assert all(p.top_p >= 1.0 for p in params), "top_p needs the sorted mass: kept_candidates"
    rel = scaled - scaled.amax(dim=1, keepdim=True)
    keep = rel >= _log_min_p(params, scaled.device)[:, None]
    max_k = max(min(p.top_k, scaled.shape[1]) for p in params)
    if max_k:
        kth = _kth(scaled.topk(max_k, dim=1).values, params, scaled.shape[1])
        assert kth is not None
        keep &= scaled >= kth
    return rel, keep
