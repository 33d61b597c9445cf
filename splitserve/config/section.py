"""The base of every config section: frozen once validated, unknown keys refused."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: immutable after validation; a key it does not declare is an error."""

    model_config = ConfigDict(frozen=True, extra="forbid")
