"""Synthetic benchmark datasets, built from a seed alone (nothing is downloaded).

`build_dataset(config, tokenizer)` builds the one `config.name` names: `random`,
`shared-prefix`, `multi-turn` or `multi-turn-ids`. The same config and tokenizer give identical prompts and
lengths. Lengths are prompt token counts: measured with the tokenizer when there is one, else
the length of the token-id prompt.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from bench.datasets.base import BenchRequest, Dataset, Prompt, Session, Turn
from bench.datasets.config import DATASET_NAMES, DatasetConfig
from bench.datasets.multi_turn import Conversation, build_multi_turn
from bench.datasets.multi_turn_ids import TokenConversation, build_multi_turn_ids
from bench.datasets.random_dataset import build_random
from bench.datasets.shared_prefix import build_shared_prefix
from bench.tokenizer import BenchTokenizer

__all__ = [
    "DATASET_NAMES",
    "BenchRequest",
    "Conversation",
    "Dataset",
    "DatasetConfig",
    "Prompt",
    "Session",
    "TokenConversation",
    "Turn",
    "build_dataset",
]

_BUILDERS: dict[str, Callable[[DatasetConfig, BenchTokenizer | None], Dataset]] = {
    "random": build_random,
    "shared-prefix": build_shared_prefix,
    "multi-turn": build_multi_turn,
    "multi-turn-ids": build_multi_turn_ids,
}


def build_dataset(config: DatasetConfig | argparse.Namespace, tokenizer: BenchTokenizer | None) -> Dataset:
    """The dataset `config` describes (a `DatasetConfig`, or parsed `bench serve` arguments)."""
    if isinstance(config, argparse.Namespace):
        config = DatasetConfig.from_args(config)
    return _BUILDERS[config.name](config, tokenizer)
