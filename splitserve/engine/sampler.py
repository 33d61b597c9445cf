"""The batched sampler: once per engine step, every row's logits become its next token.

The order is vLLM v1's: raw logprobs; min_tokens; repetition, frequency and presence penalties;
argmax for greedy rows; and for the others temperature, min_p, top_k, top_p and an exponential
race (`argmax(p / q)`, `q ~ Exp(1)`).

The cuts run on the top-K candidates of each row rather than on a full sort of the vocabulary:
K starts at the largest `top_k + 1` in the batch (64 for rows cut by top_p or min_p alone) and
grows 16-fold for the rows whose kept set reached the last candidate, up to the vocabulary. Every
cut is decided by value (tokens with equal logits are kept or cut together), so a row's kept set
does not depend on K, on the order `topk` gives ties, or on what else is in the batch. Growing K
reads a mask back to the host, so a sync-free sampler (CUDA's) takes another road to the same set:
the whole vocabulary sorted for rows with top_p, a threshold mask for the others.
"""

from __future__ import annotations

import array
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from splitserve.engine.host_staging import device_tensor, to_device
from splitserve.engine.sampler_output import LogprobTensors, SamplerOutput
from splitserve.engine.sampling_cuts import kept_candidates, threshold_keep
from splitserve.engine.seeded_noise import SeededNoise
from splitserve.sampling_params import SamplingParams

__all__ = ["Sampler", "SamplerOutput", "SamplingRow", "apply_penalties", "draw_seed", "kept_candidates"]

_MASK64 = (1 << 64) - 1
_FIRST_CANDIDATES = 64  # candidates tried first for a row cut only by top_p or min_p
_CANDIDATE_GROWTH = 16  # how much K grows for the rows whose kept set did not fit
_TINY = torch.finfo(torch.float32).tiny
_GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a lower temperature is greedy


@dataclass
class SamplingRow:
    """One request's view for this step; the token drawn is output token `output_index`:
    `len(output_token_ids)` plus the `num_pending` tokens sampled on the device whose ids the host
    does not know yet (async scheduling: they count, their values are never read)."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    num_pending: int = 0

    @property
    def output_index(self) -> int:
        return len(self.output_token_ids) + self.num_pending


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw_seed(seed: int, output_index: int) -> int:
    """Generator seed for drawing output token `output_index` of a request seeded with `seed`."""
    return _splitmix64(_splitmix64(seed) ^ output_index)


def _flat_positions(token_ids: Sequence[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """CPU int64 positions `row * vocab_size + id` in a flattened [rows, vocab] tensor, one per
    token (repeats kept); ids outside the vocabulary are dropped."""
    lengths = [len(ids) for ids in token_ids]
    if sum(lengths) == 0:
        return torch.empty(0, dtype=torch.int64)
    ids = torch.frombuffer(array.array("q", itertools.chain.from_iterable(token_ids)), dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(token_ids)), torch.tensor(lengths))
    return (rows * vocab_size + ids)[(ids >= 0) & (ids < vocab_size)]


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    repetition_penalties: Sequence[float],
    frequency_penalties: Sequence[float],
    presence_penalties: Sequence[float],
) -> torch.Tensor:
    """Penalize contiguous fp32 `logits` [rows, vocab] in place as vLLM does, and return them.

    The seen positions are built on the host and sent to the device without a stream sync.
    Repetition (the CTRL rule, over prompt and output tokens): a seen token's positive logit is
    divided by the penalty, a negative one multiplied. Then, over output tokens only (OpenAI's
    definition): `logits -= frequency * count + presence * (count > 0)`. Token ids outside the
    vocabulary are ignored. Only the seen positions are touched, never the whole vocabulary.
    """
    if not logits.is_contiguous():
        raise ValueError("apply_penalties needs contiguous logits; pass logits.contiguous()")
    vocab_size, device, flat = logits.shape[1], logits.device, logits.view(-1)
    output_positions = _flat_positions(output_token_ids, vocab_size)
    if any(p != 1.0 for p in repetition_penalties):
        prompt_positions = _flat_positions(prompt_token_ids, vocab_size)
        # Repeats are harmless: every copy of a position writes the same value.
        seen = torch.cat([prompt_positions, output_positions])
        penalty = to_device(
            torch.tensor(repetition_penalties, dtype=torch.float32)[seen // vocab_size], device
        )
        seen = to_device(seen, device)
        values = flat[seen]
        flat[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if any(f != 0.0 for f in frequency_penalties) or any(p != 0.0 for p in presence_penalties):
        positions, counts = torch.unique(output_positions, return_counts=True)
        rows = positions // vocab_size
        frequency = torch.tensor(frequency_penalties, dtype=torch.float32)[rows]
        presence = torch.tensor(presence_penalties, dtype=torch.float32)[rows]
        positions = to_device(positions, device)
        flat[positions] -= to_device(frequency * counts + presence, device)
    return logits


class Sampler:
    """Picks every row's next token for one engine step; owns the generator of unseeded rows.

    Promises: a seeded row's token depends only on its logits, its parameters, its seed and the
    index of the token it draws; never on the other rows, their order, earlier calls, `base_seed`
    or the process. Its noise comes from a CPU generator seeded with `draw_seed(seed, index)`, one
    value per token id, so the draws are the same on every device and a token's draw does not
    depend on which other tokens top-k / top-p / min-p kept. Unseeded rows share one generator seeded with
    `base_seed`, drawn in one batch. `vocab_size` is the width of the logits (the model's, which
    may exceed the tokenizer's). Stopping is the engine's business; this only masks stop tokens
    before `min_tokens`.

    Nothing is read back to the host inside a call: the output's ids stay on the device and reach
    the host once, asynchronously (sampler_output.py). With `sync_free` (the default on CUDA) the
    cuts decide without a read-back too: rows with top_p sort their whole vocabulary and the others
    keep by threshold (sampling_cuts.py); without it (the CPU's default, where a read-back costs
    nothing) they look at top-K candidates and grow K for rows whose kept set did not fit. Both
    keep the same tokens.
    """

    def __init__(
        self,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        device: torch.device | str = "cpu",
        base_seed: int = 0,
        noise_ahead: bool | None = None,
        sync_free: bool | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.device = torch.device(device)
        self.sync_free = self.device.type == "cuda" if sync_free is None else sync_free
        # meta (shapes only: the CPU's host-sync tests) has no generator; a CPU one stands in
        self._generator = torch.Generator(device=self.device if self.device.type != "meta" else "cpu")
        self._generator.manual_seed(base_seed)
        self._seeded_noise = SeededNoise(vocab_size, self.device, noise_ahead)

    def prepare(self, rows: Sequence[SamplingRow]) -> None:
        """Before the logits exist (the forward still running on the device): draw the seeded rows'
        noise now, so that host work overlaps the device's (engine/seeded_noise.py). Optional: a
        call without it draws the same noise itself."""
        self._seeded_noise.prepare(
            [
                draw_seed(row.params.seed, row.output_index)
                for row in rows
                if row.params.seed is not None and not _is_greedy(row.params)
            ]
        )

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        try:
            return self._sample(logits, rows)
        finally:
            self._seeded_noise.clear()  # prepared noise serves this call only

    def _sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        self._check(logits, rows)
        params = [row.params for row in rows]
        wants_logprobs = any(p.logprobs is not None for p in params)
        stop_masks = self._stop_masks(rows)
        penalized = any(has_penalty(p) for p in params)
        if all(_is_greedy(p) for p in params) and not (wants_logprobs or stop_masks[0] or penalized):
            return SamplerOutput(logits.argmax(dim=-1))
        if stop_masks[0] or penalized:  # changed in place: our own contiguous fp32 copy
            x = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
            if stop_masks[0]:
                mask_rows, mask_ids = (self._index(m) for m in stop_masks)
                x.index_put_((mask_rows, mask_ids), x.new_full((), -math.inf))
            if penalized:
                self._penalize(x, rows)
        else:
            x = logits.float()
        token_ids = torch.empty(len(rows), dtype=torch.int64, device=x.device)
        greedy = [i for i, p in enumerate(params) if _is_greedy(p)]
        random = [i for i, p in enumerate(params) if not _is_greedy(p)]
        if greedy:
            self._put(token_ids, greedy, self._take(x, greedy).argmax(dim=-1))
        if random:
            drawn = self._sample_random(self._take(x, random), [rows[i] for i in random])
            self._put(token_ids, random, drawn)
        return SamplerOutput(token_ids, self._logprobs(logits, token_ids, params) if wants_logprobs else None)

    def _check(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        if logits.dim() != 2 or logits.shape[0] != len(rows) or logits.shape[1] != self.vocab_size:
            raise ValueError(
                f"logits have shape {tuple(logits.shape)}; expected ({len(rows)}, {self.vocab_size}): "
                "one row per SamplingRow, as wide as the vocab_size the Sampler was built with"
            )
        if logits.device.type != self.device.type:
            raise ValueError(f"logits are on {logits.device} but this Sampler was built for {self.device}")

    def _stop_masks(self, rows: Sequence[SamplingRow]) -> tuple[list[int], list[int]]:
        """(row, token) pairs to mask: EOS and stop ids of rows short of `min_tokens` (ignore_eos
        or not: it only changes stopping, as in vLLM)."""
        mask_rows: list[int] = []
        mask_ids: list[int] = []
        for i, row in enumerate(rows):
            if row.output_index < row.params.min_tokens:
                ids = {t for t in (*self.eos_token_ids, *row.params.stop_token_ids) if t < self.vocab_size}
                mask_rows.extend([i] * len(ids))
                mask_ids.extend(sorted(ids))
        return mask_rows, mask_ids

    def _penalize(self, x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        """Penalties touch only the seen tokens of penalized rows; the others pass no tokens."""
        params = [row.params for row in rows]
        apply_penalties(
            x,
            [row.prompt_token_ids if p.repetition_penalty != 1.0 else () for row, p in zip(rows, params)],
            [row.output_token_ids if has_penalty(p) else () for row, p in zip(rows, params)],
            [p.repetition_penalty for p in params],
            [p.frequency_penalty for p in params],
            [p.presence_penalty for p in params],
        )

    def _sample_random(self, x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        params = [row.params for row in rows]
        seeds = [None if p.seed is None else draw_seed(p.seed, r.output_index) for p, r in zip(params, rows)]
        token_ids = torch.empty(len(rows), dtype=torch.int64, device=x.device)
        cut = [i for i, p in enumerate(params) if _is_cut(p)]
        whole = [i for i, p in enumerate(params) if not _is_cut(p)]
        if self.sync_free:  # rows without top_p race over the whole row, kept by threshold
            whole += [i for i in cut if params[i].top_p >= 1.0]
            cut = [i for i in cut if params[i].top_p < 1.0]
        if whole:  # the race runs over the whole vocabulary, noise indexed by token id
            logits = self._take(x, whole)
            temperature = self._floats([params[i].temperature for i in whole])[:, None]
            sub = [params[i] for i in whole]
            if any(_is_cut(p) for p in sub):
                rel, keep = threshold_keep(logits / temperature, sub)
                weight = rel.exp_().masked_fill_(~keep, 0.0)
            else:
                weight = (logits - logits.amax(dim=1, keepdim=True)).div_(temperature).exp_()
            q = self._exponentials([seeds[i] for i in whole], weight.shape[1])
            self._put(token_ids, whole, weight.div_(q).argmax(dim=1))
        if cut:
            drawn = self._sample_cut(self._take(x, cut), [params[i] for i in cut], [seeds[i] for i in cut])
            self._put(token_ids, cut, drawn)
        return token_ids

    def _sample_cut(
        self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int | None]
    ) -> torch.Tensor:
        """Race over each row's kept candidates, growing K for rows whose kept set did not fit
        (sync-free: K is the whole vocabulary at once, a sort). Temperature (positive) keeps the
        order, so it scales the candidates, not the vocabulary."""
        vocab_size = logits.shape[1]
        temperature = self._floats([p.temperature for p in params])[:, None]
        token_ids = torch.empty(len(params), dtype=torch.int64, device=logits.device)
        pending = list(range(len(params)))
        num_candidates = min(
            vocab_size, max(p.top_k + 1 if p.top_k > 0 else _FIRST_CANDIDATES for p in params)
        )
        if self.sync_free:
            num_candidates = vocab_size
        while pending:
            sub = self._take(logits, pending) if len(pending) < len(params) else logits
            vals, ids = sub.topk(num_candidates, dim=1)
            vals /= self._take(temperature, pending)
            keep = kept_candidates(vals, sub, [params[i] for i in pending])
            fits = [True] * len(pending) if num_candidates == vocab_size else (~keep[:, -1]).tolist()
            done = [j for j, ok in enumerate(fits) if ok]
            if done:
                drawn = self._race(
                    self._take(vals, done),
                    self._take(ids, done),
                    self._take(keep, done),
                    [seeds[pending[j]] for j in done],
                )
                self._put(token_ids, [pending[j] for j in done], drawn)
            pending = [i for i, ok in zip(pending, fits) if not ok]
            num_candidates = min(vocab_size, num_candidates * _CANDIDATE_GROWTH)
        return token_ids

    def _race(
        self, vals: torch.Tensor, ids: torch.Tensor, keep: torch.Tensor, seeds: list[int | None]
    ) -> torch.Tensor:
        """Exponential race among kept candidates. A seeded row's noise is indexed by token id, so
        it depends neither on how many candidates were looked at nor on which were kept: a float
        wobble at the top-p / min-p boundary changes the sample only if the boundary token wins."""
        weight = (vals - vals[:, :1]).exp_().masked_fill_(~keep, 0.0)
        q = self._exponentials(seeds, vals.shape[1], ids)
        return ids.gather(1, weight.div_(q).argmax(dim=1, keepdim=True)).squeeze(1)

    def _exponentials(
        self, seeds: list[int | None], width: int, ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Exp(1) noise [rows, width]. Unseeded rows share one generator. Seeded row i draws one
        value per vocabulary token from its own generator; column c gets token `ids[i, c]`'s value
        (token c's when `ids` is None, so `width` is then the vocabulary size)."""
        seeded = [i for i, s in enumerate(seeds) if s is not None]
        q = torch.empty(len(seeds), width, dtype=torch.float32, device=self.device)
        if len(seeded) < len(seeds):
            q.uniform_(generator=self._generator).log_().neg_().clamp_min_(_TINY)
        if seeded:
            noise = self._seeded_noise.draw([seeds[i] for i in seeded])  # type: ignore[misc]
            if ids is not None:
                noise = noise.gather(1, self._take(ids, seeded))
            q = noise if len(seeded) == len(seeds) else q.index_copy_(0, self._index(seeded), noise)
        return q

    def _logprobs(
        self, logits: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams]
    ) -> LogprobTensors:
        """Top-n of the raw model distribution and the sampled token's, for each row that asked."""
        asked = [i for i, p in enumerate(params) if p.logprobs is not None]
        logprobs = self._take(logits, asked).float().log_softmax(dim=-1)
        sampled = logprobs.gather(1, self._take(token_ids, asked)[:, None]).squeeze(1)
        top_n = [params[i].logprobs or 0 for i in asked]
        top_vals, top_ids = logprobs.topk(max(top_n), dim=1)
        return LogprobTensors(asked, top_n, sampled, top_vals, top_ids)

    def _index(self, indices: list[int]) -> torch.Tensor:
        return device_tensor(indices, torch.int64, self.device)

    def _floats(self, values: list[float]) -> torch.Tensor:
        return device_tensor(values, torch.float32, self.device)

    def _take(self, x: torch.Tensor, indices: list[int]) -> torch.Tensor:
        """Rows `indices` of x; x itself when that is every row in order."""
        if len(indices) == x.shape[0]:
            return x
        return x.index_select(0, self._index(indices))

    def _put(self, dst: torch.Tensor, indices: list[int], src: torch.Tensor) -> None:
        if len(indices) == dst.shape[0]:
            dst.copy_(src)
        else:
            dst.index_copy_(0, self._index(indices), src)


def _is_greedy(p: SamplingParams) -> bool:
    return p.temperature < _GREEDY_BELOW


def _is_cut(p: SamplingParams) -> bool:
    return p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0


def has_penalty(p: SamplingParams) -> bool:
    """Whether a row's logits depend on its output ids (repetition, frequency, presence penalties)."""
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
