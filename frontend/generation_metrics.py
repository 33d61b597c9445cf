"""What one generation reports to the gateway's metrics, and the clock those figures need."""

from __future__ import annotations

import time

from frontend.metrics import GatewayMetrics
from frontend.prefix_metrics import PrefixMetrics
from splitserve.v1 import decode_pb2, prefill_pb2


class GenerationMetrics:
    """Owns one generation's observations: it counts as running from its making to its release
    (when `counted`: a group's shared prefill is not, its samples are), its time to first token,
    the gaps between its tokens (ITL), its queue and state-transfer times, its prefix-cache hit,
    and at release how it ended. Owns the clock these need: the arrival, the last token's time,
    whether a first token arrived (ITL counts gaps after it), the prefill's unhidden put time."""

    def __init__(
        self, metrics: GatewayMetrics, prefix_metrics: PrefixMetrics | None, arrival_s: float, counted: bool
    ) -> None:
        self._metrics = metrics
        self._prefix = prefix_metrics
        self.arrival_s = arrival_s
        self.counted = counted
        self._last_token_s = arrival_s
        self._has_first_token = False
        self._transfer_s = 0.0  # the decode's wait for the state is added to it
        if counted:
            metrics.running.labels(metrics.model_name).inc()

    def first_token(self, observe_ttft: bool) -> None:
        """A first token reached the gateway: its TTFT (unless not `observe_ttft`: a failover's,
        or a sample's, whose group observed it), and the ITL's start."""
        now = time.monotonic()
        if observe_ttft:
            self._metrics.ttft.labels(self._metrics.model_name).observe(now - self.arrival_s)
        self._last_token_s, self._has_first_token = now, True

    def prompt_streamed(self, observe_ttft: bool, prefix_hit: tuple[int, int] | None) -> None:
        """A decode worker computed the prompt and streamed its first step: the ITL's clock
        restarts; the TTFT is observed when `observe_ttft`, the prefix hit (prompt tokens,
        cached ones) when given."""
        self._last_token_s = now = time.monotonic()
        if observe_ttft:
            self._metrics.ttft.labels(self._metrics.model_name).observe(now - self.arrival_s)
        if prefix_hit is not None and self._prefix is not None:
            self._prefix.observe_prefill(*prefix_hit)

    def prefilled(self, response: prefill_pb2.PrefillResponse, num_prompt_tokens: int) -> None:
        """A prefill worker answered: its prefix hit, queue time and state transfer."""
        metrics, timing = self._metrics, response.timing
        if self._prefix is not None:
            self._prefix.observe_prefill(num_prompt_tokens, response.num_cached_tokens)
        metrics.queue.labels(metrics.model_name, "prefill").observe(timing.queue_s)
        if timing.state_bytes:
            metrics.transfer_bytes.labels(metrics.model_name).observe(timing.state_bytes)
            metrics.transfer_stream_s.labels(metrics.model_name).observe(timing.state_stream_s)
        self._transfer_s = timing.state_put_s

    def delta(self, delta: decode_pb2.TokenDelta) -> None:
        """A decode delta arrived: the gaps since the last token (a Decode without state streams
        the first token too: no gap before it), and the decode's queue and state wait."""
        metrics = self._metrics
        now = time.monotonic()
        if delta.token_ids:
            if self._has_first_token:
                gap_s = (now - self._last_token_s) / len(delta.token_ids)
                for _ in delta.token_ids:
                    metrics.itl.labels(metrics.model_name).observe(gap_s)
            self._has_first_token = True
            self._last_token_s = now
        if delta.HasField("timing") and (delta.timing.queue_s or delta.timing.state_wait_s):
            metrics.queue.labels(metrics.model_name, "decode").observe(delta.timing.queue_s)
            metrics.transfer_s.labels(metrics.model_name).observe(
                self._transfer_s + delta.timing.state_wait_s
            )

    def released(
        self,
        reason: str,
        num_prompt_tokens: int,
        num_generated_tokens: int,
        *,
        processed: bool,
        finished: bool,
    ) -> None:
        """The generation let go of its workers, ended for `reason`. Only work a worker was given
        counts as processed: a request refused before any prefill (429, 503) is counted apart,
        by reason, where its error is answered (frontend.errors)."""
        if not self.counted:
            return
        metrics = self._metrics
        metrics.running.labels(metrics.model_name).dec()
        if processed:
            metrics.observe_finished(reason, num_prompt_tokens, num_generated_tokens)
        if finished:
            metrics.e2e.labels(metrics.model_name).observe(time.monotonic() - self.arrival_s)
