"""The base of every config section: unknown keys are refused (a typo must not silently drop a setting)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["StrictModel"]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")
