"""The `model` section: which checkpoint every pool serves."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from splitserve.config.section import Section

DEFAULT_MODEL_NAME = "tiny-kimi-linear"  # the folder name of splitserve.default_model's model


class ModelConfig(Section):
    """Which checkpoint every pool serves (one model for the whole cluster, so pools agree)."""

    path: str | None = None  # None: the embedded tiny model (built on first use)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    name: str | None = None  # the served model name; default: the checkpoint's folder name
    max_model_len: int | None = Field(default=None, ge=2)

    def resolved_path(self) -> str:
        """The checkpoint folder; for the default this builds the tiny model if it is missing."""
        if self.path is None:
            from splitserve.default_model import default_model_path

            return str(default_model_path())
        return str(Path(self.path).expanduser())

    @property
    def served_name(self) -> str:
        if self.name:
            return self.name
        if self.path is None:
            return DEFAULT_MODEL_NAME
        return Path(self.path).expanduser().name or self.path
