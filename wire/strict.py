"""The base of every wire model that takes user input."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class _Strict(BaseModel):
    """Unknown fields are rejected so a typo is an error, not a silent default; NaN and infinities are
    rejected in every float (no time, bandwidth or speed is meaningful as one, and JSON cannot carry them
    back in an answer)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
