"""The one base of every config section, the learner's, the other roles' and the run's own: unknown keys
are refused (a misspelt field is an error, not a default) and assignments are validated like loading."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
