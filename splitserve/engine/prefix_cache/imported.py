"""A prefix's complete state fetched from elsewhere (a store), handed to `LLMEngine.add_request`."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.engine.state_transfer import LayerState


@dataclass
class ImportedPrefix:
    """The state of the first `num_tokens` tokens of a prompt, computed by another engine.

    `hash_chain` names the whole prefix units it covers (`splitserve.prefix_hash`, the same salt
    as the request's chain). `states` holds every MLA layer's KV rows 0..num_tokens (one piece or
    several, each with its token range) and every KDA layer's conv and recurrent state at
    `num_tokens`. The engine scatters it into the request's blocks and slot when it schedules the
    request, skips those tokens, and keeps the prefix in its own cache as if computed locally
    (without handing it to the retention listener: it came from there).
    It must leave at least one prompt token to compute (the sample needs that token's logits):
    one covering the whole prompt, or one the local cache beats, is ignored.
    """

    num_tokens: int
    hash_chain: list[bytes]
    states: list[LayerState]
