"""The Kimi-Linear decoder stack: embeddings, KDA/MLA layers with dense or MoE MLPs, norm, LM head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.forward_batch import ForwardBatch
from splitserve.engine.model.kda import KimiDeltaAttention
from splitserve.engine.model.layers import GatedMLP, RMSNorm, VocabEmbedding
from splitserve.engine.model.mla import MultiHeadLatentAttention
from splitserve.engine.model.moe import SparseMoE
from splitserve.engine.model_config import FULL_ATTENTION, KimiLinearModelConfig
from splitserve.engine.parallel.group import SINGLE, TensorParallel
from splitserve.engine.parallel.shard import set_shard
from splitserve.engine.replay_ring import ReplayRing


@dataclass
class LayerCaches:
    """The cache tensors one forward reads and writes, indexed by model layer id."""

    mla_kv: dict[int, torch.Tensor]  # layer -> [num_blocks * block_size, rank + rope]
    kda_conv: dict[int, torch.Tensor]  # layer -> [num_slots, 3 * H * D, K - 1]
    kda_recurrent: dict[int, torch.Tensor]  # layer -> [num_slots, H, Dk, Dv] fp32
    replay: ReplayRing | None = None  # ReplaySSM rings (kda_recurrent then holds checkpoints)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: token mixer (KDA or MLA) then MLP (dense or MoE); each residual add
    runs with the norm after it (ops/norms.py). Under tensor parallelism each sublayer's output is a
    partial sum per rank, summed by one all-reduce before the residual add."""

    def __init__(self, config: KimiLinearModelConfig, layer_id: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.tp = tp
        self.is_mla = config.layer_types[layer_id] == FULL_ATTENTION
        self.self_attn: nn.Module = (
            MultiHeadLatentAttention(config, tp) if self.is_mla else KimiDeltaAttention(config, tp)
        )
        self.block_sparse_moe: nn.Module = (
            SparseMoE(config, tp)
            if config.mlp_layer_types[layer_id] == "sparse"
            else GatedMLP(config.hidden_size, config.intermediate_size, tp)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, caches: LayerCaches
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`hidden` is the previous sublayer's output, not yet added to the residual stream `residual`
        (None in the first layer, whose `hidden` is the embeddings). Returns this layer's MLP output and
        the stream before it: the next layer adds them in the same launch as its input norm."""
        h, residual = self.input_layernorm.add_and_norm(hidden, residual)
        if self.is_mla:
            h = self.self_attn(h, batch, caches.mla_kv[self.layer_id])
        else:
            lid = self.layer_id
            ring = caches.replay.layers[lid] if caches.replay is not None else None
            h = self.self_attn(h, batch, caches.kda_conv[lid], caches.kda_recurrent[lid], ring)
        h, residual = self.post_attention_layernorm.add_and_norm(self.tp.all_reduce(h), residual)
        return self.tp.all_reduce(self.block_sparse_moe(h)), residual


class KimiLinearModel(nn.Module):
    """The backbone; `model.` prefixed names in a checkpoint land here."""

    def __init__(self, config: KimiLinearModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class KimiLinearForCausalLM(nn.Module):
    """The whole network. `forward` returns the final hidden states of `batch.logits_indices`;
    `compute_logits` their logits (a rank's slice of the vocabulary under tensor parallelism)."""

    def __init__(self, config: KimiLinearModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = KimiLinearModel(config, tp)
        # a rank's rows of the vocabulary, as the embedding's: its logits are a slice, gathered on rank 0
        self.lm_head = nn.Linear(config.hidden_size, tp.split(config.vocab_size, "vocab_size"), bias=False)
        set_shard(self.lm_head.weight, tp.shard(0))

    def finalize(self) -> None:
        """Build fused and absorbed weights once the checkpoint is loaded."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        for module in self.modules():
            finalize = getattr(module, "finalize", None)
            if module is not self and callable(finalize):
                finalize()

    def forward(self, batch: ForwardBatch, caches: LayerCaches) -> torch.Tensor:
        hidden, residual = self.model.embed_tokens(batch.input_ids), None
        for layer_id, layer in enumerate(self.model.layers):
            hidden, residual = layer(hidden, residual, batch, caches)
            if batch.after_layer is not None:
                batch.after_layer(layer_id)
        x = hidden if residual is None else residual + hidden
        return self.model.norm(x[batch.logits_indices])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head.weight).float()
