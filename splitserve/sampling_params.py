"""Per-request sampling parameters, with vLLM's names and defaults.

Torch-free: the frontend builds these from an OpenAI request and ships them over gRPC.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # most alternatives a request may ask for at each position
# Most samples (`n`, `best_of`) one request may draw: they share one prefill, but each decodes in
# a state slot of its own on one decode worker, so a request never needs more than this many there.
MAX_SAMPLES = 16


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    Greedy when `temperature` is below 1e-5 (vLLM's rule; 0 is the usual spelling). `top_k` of 0 or -1 means no top-k cut. `seed` makes the
    request's draws depend only on the seed and the position of the token in the output, never
    on what else shares the batch or on which worker runs the step. Validation runs at
    construction: an out-of-range value raises `ValueError` naming the field and the range.

    `n` samples (`best_of` drawn, the `n` with the highest cumulative logprob kept) share one
    prefill; sample i draws like a request of its own with `for_sample(i)` (vLLM's rule: seed +
    i when seeded, else independent draws).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    best_of: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", [self.stop])
        object.__setattr__(self, "stop", list(self.stop or []))
        object.__setattr__(self, "stop_token_ids", [int(t) for t in (self.stop_token_ids or [])])
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        checks: list[tuple[bool, str]] = [
            (
                1 <= self.n <= MAX_SAMPLES,
                f"n must be in [1, {MAX_SAMPLES}] (got {self.n}); each sample decodes in a slot of its own",
            ),
            (
                self.best_of is None or self.n <= self.best_of <= MAX_SAMPLES,
                f"best_of must be in [n, {MAX_SAMPLES}] (got {self.best_of} with n {self.n})",
            ),
            (self.temperature >= 0.0, f"temperature must be >= 0 (got {self.temperature})"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1] (got {self.top_p})"),
            (self.top_k >= 0, f"top_k must be -1, 0 (off) or a positive count (got {self.top_k})"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1] (got {self.min_p})"),
            (
                -2.0 <= self.presence_penalty <= 2.0,
                f"presence_penalty must be in [-2, 2] (got {self.presence_penalty})",
            ),
            (
                -2.0 <= self.frequency_penalty <= 2.0,
                f"frequency_penalty must be in [-2, 2] (got {self.frequency_penalty})",
            ),
            (
                self.repetition_penalty > 0.0,
                f"repetition_penalty must be > 0 (got {self.repetition_penalty})",
            ),
            (
                self.max_tokens is None or self.max_tokens >= 1,
                f"max_tokens must be at least 1 (got {self.max_tokens})",
            ),
            (self.min_tokens >= 0, f"min_tokens must be >= 0 (got {self.min_tokens})"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"logprobs must be in [0, {MAX_LOGPROBS}] (got {self.logprobs})",
            ),
            (self.seed is None or 0 <= self.seed < 2**63, f"seed must be in [0, 2**63) (got {self.seed})"),
            (
                self.seed is None or self.seed + self.num_samples <= 2**63,
                f"seed must be below 2**63 - {self.num_samples - 1} with {self.num_samples} samples "
                f"(sample i draws with seed + i; got {self.seed})",
            ),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be non-negative token ids"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def num_samples(self) -> int:
        """How many samples are drawn: `best_of` when given, else `n`."""
        return self.best_of or self.n

    @property
    def ranks_samples(self) -> bool:
        """Whether more samples are drawn than returned (the best `n` by cumulative logprob)."""
        return self.num_samples > self.n

    def for_sample(self, index: int) -> SamplingParams:
        """The parameters sample `index` draws with, as a request of its own: one sample, seed +
        index when seeded (as vLLM's parallel sampling derives them), so it equals a separate
        request with that seed. Ranked samples carry the sampled token's logprob (`logprobs` 0
        when none were asked for), which ranking needs."""
        if not 0 <= index < self.num_samples:
            raise ValueError(f"sample index {index} is outside [0, {self.num_samples})")
        seed = None if self.seed is None else self.seed + index
        logprobs = 0 if self.ranks_samples and self.logprobs is None else self.logprobs
        return self.replace(n=1, best_of=None, seed=seed, logprobs=logprobs)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def replace(self, **changes: object) -> SamplingParams:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def sample_request_id(request_id: str, index: int) -> str:
    """The id sample `index` of a request with several samples runs under (vLLM's spelling)."""
    return f"{index}_{request_id}"
