"""`DatasetConfig`: every option of every synthetic dataset, validated, readable from argparse."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

DATASET_NAMES = ("random", "shared-prefix", "multi-turn", "multi-turn-ids")
DEFAULT_NUM_PROMPTS = 1000


@dataclass(frozen=True)
class DatasetConfig:
    """Which dataset to build and its sizes; the same config (seed included) builds the same prompts.

    `num_prompts` sizes the random dataset (default 1000). Shared-prefix sends
    `gsp_num_groups * gsp_prompts_per_group` prompts and multi-turn (and multi-turn-ids, the same
    conversations sent as token ids) `mt_num_sessions * mt_turns`; a `num_prompts` given with them
    must equal that product.
    """

    name: str = "random"
    seed: int = 0
    num_prompts: int | None = None
    vocab_size: int = 2048
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    gsp_num_groups: int = 64
    gsp_prompts_per_group: int = 16
    gsp_system_prompt_len: int = 2048
    gsp_question_len: int = 128
    gsp_output_len: int = 256
    mt_num_sessions: int = 16
    mt_turns: int = 4
    mt_user_len: int = 128
    mt_output_len: int = 128

    def __post_init__(self) -> None:
        if self.name not in DATASET_NAMES:
            raise ValueError(f"unknown dataset {self.name!r}; choose one of {', '.join(DATASET_NAMES)}")
        if not 0.0 <= self.random_range_ratio < 1.0:
            raise ValueError(f"random_range_ratio must be in [0, 1) (got {self.random_range_ratio})")
        if self.vocab_size <= 3:
            raise ValueError(
                f"vocab_size must be above 3: token ids are drawn from [3, vocab_size) (got {self.vocab_size})"
            )
        at_least_one = [
            "random_input_len", "random_output_len", "gsp_num_groups", "gsp_prompts_per_group",
            "gsp_question_len", "gsp_output_len", "mt_num_sessions", "mt_turns", "mt_user_len", "mt_output_len",
        ]  # fmt: skip
        for name in at_least_one:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1 (got {getattr(self, name)})")
        for name in ("random_prefix_len", "gsp_system_prompt_len"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative (got {getattr(self, name)})")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"num_prompts must be at least 1 (got {self.num_prompts})")
        fixed = self.fixed_num_requests()
        if self.num_prompts is not None and fixed is not None and self.num_prompts != fixed:
            raise ValueError(
                f"the {self.name} dataset sends {fixed} requests (its own size options); "
                f"drop --num-prompts {self.num_prompts} or change those options"
            )

    def fixed_num_requests(self) -> int | None:
        """The request count that shared-prefix and multi-turn fix by their own options."""
        if self.name == "shared-prefix":
            return self.gsp_num_groups * self.gsp_prompts_per_group
        if self.name in ("multi-turn", "multi-turn-ids"):
            return self.mt_num_sessions * self.mt_turns
        return None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DatasetConfig:
        """The config from parsed arguments named like the fields (`--dataset` gives `name`)."""
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        if hasattr(args, "dataset"):
            values["name"] = args.dataset
        return cls(**values)
