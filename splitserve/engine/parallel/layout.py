"""How a model splits over N ranks and what one step sends between them, from config.json alone.

Torch-free, so `splitserve config plan` answers on a GPU-less head node. The arithmetic follows
the layers (engine/model/): a tensor-parallel rank holds 1/N of the heads, MLP columns and
vocabulary; the sublayers' partial outputs are summed by one all-reduce each (attention, MLP or
MoE), plus one for the vocabulary-parallel embedding; the logits are gathered on rank 0, which
samples and broadcasts the tokens. With expert parallelism the tokens are on every rank already
(attention stays tensor parallel), so the experts' outputs ride in the MoE sublayer's all-reduce:
no extra bytes. `all_to_all_bytes_per_token` is the alternative the engine does not build (data-
parallel attention, tokens dispatched to their experts' ranks and back), for comparison.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.engine.model_config import KimiLinearModelConfig
from splitserve.engine_config import DTYPE_BYTES

LOGITS_BYTES = 4  # fp32
TOKEN_ID_BYTES = 8  # int64


def split_counts(model: KimiLinearModelConfig, expert_parallel: bool) -> dict[str, int]:
    """Every size the ranks split evenly, by the name an error gives it."""
    counts = {
        "vocab_size": model.vocab_size,
        "num_attention_heads": model.num_attention_heads,
        "linear_num_heads": model.linear_num_heads,
        "intermediate_size": model.intermediate_size,
        "the shared experts' intermediate size": model.moe_intermediate_size * model.n_shared_experts,
    }
    if expert_parallel:
        counts["num_local_experts (expert_parallel)"] = model.num_local_experts
    else:
        counts["moe_intermediate_size"] = model.moe_intermediate_size
    return counts


def check_splits(model: KimiLinearModelConfig, num_ranks: int, expert_parallel: bool) -> None:
    """Raise ValueError naming the first size `num_ranks` ranks cannot split evenly."""
    for what, count in split_counts(model, expert_parallel).items():
        if count % num_ranks:
            raise ValueError(
                f"{what} ({count}) does not split evenly over tensor_parallel_size {num_ranks}; "
                "pick a size that divides it"
            )


@dataclass(frozen=True)
class StepTraffic:
    """What one engine step sends between its ranks, per token and per sampled row.

    `allreduce_payload_bytes_per_token`: the bytes summed across ranks per token of the step (each
    all-reduce's tensor). A ring all-reduce sends and receives `2 (N - 1) / N` times that per rank
    (`allreduce_ring_bytes_per_token`). `num_allreduces` per step whatever its size: at decode
    batch sizes their latency, not their bytes, is the cost.
    """

    num_ranks: int
    num_allreduces: int
    allreduce_payload_bytes_per_token: int
    logits_gather_bytes_per_row: int  # into rank 0, from the others
    token_broadcast_bytes_per_row: int
    all_to_all_bytes_per_token: int  # the unbuilt alternative for expert parallelism (see module)

    @property
    def allreduce_ring_bytes_per_token(self) -> int:
        n = self.num_ranks
        return self.allreduce_payload_bytes_per_token * 2 * (n - 1) // n if n > 1 else 0


def step_traffic(model: KimiLinearModelConfig, dtype: str, num_ranks: int) -> StepTraffic:
    """The traffic of one step of `model` in `dtype` on `num_ranks` ranks (0 bytes on one rank)."""
    if num_ranks == 1:
        return StepTraffic(1, 0, 0, 0, 0, 0)
    hidden_bytes = model.hidden_size * DTYPE_BYTES[dtype]
    num_allreduces = 2 * model.num_hidden_layers + 1  # attention, MLP or MoE, and the embedding
    others = num_ranks - 1
    gather = model.vocab_size * LOGITS_BYTES * others // num_ranks
    # each choice whose expert is elsewhere (N-1 of N on average) travels out and its result back
    num_moe = sum(t == "sparse" for t in model.mlp_layer_types)
    all_to_all = 2 * num_moe * model.num_experts_per_tok * hidden_bytes * others // num_ranks
    return StepTraffic(
        num_ranks,
        num_allreduces,
        num_allreduces * hidden_bytes,
        gather,
        TOKEN_ID_BYTES * others,
        all_to_all,
    )
