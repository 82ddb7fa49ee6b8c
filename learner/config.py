"""Config section owned by the learner role: `LearnerConfig`, its fields (learner/config_fields.py)
under its cross-field rules (learner/config_rules.py), with the KL and LoRA blocks it holds and the
parameter blocks its registered parts declare (learner/config_blocks.py; `KLConfig`, `LoRAConfig` and
`OverlongConfig` are imported from here)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, create_model, model_validator

from learner.config_blocks import KLConfig, LoRAConfig, OverlongConfig, block_of, part_blocks, refuse_moved
from learner.config_fields import LearnerFields
from learner.config_rules import check_learner

__all__ = ["KLConfig", "LearnerConfig", "LoRAConfig", "OverlongConfig"]

_BLOCKS = part_blocks()
_CLASH = _BLOCKS.keys() & LearnerFields.model_fields.keys()
if _CLASH:
    raise ValueError(f"registered parts named like fields of the learner's section: {sorted(_CLASH)}")

# The learner's fields and one block per registered part that declares one (learner.gae, learner.vtrace, ...).
_LearnerSection = create_model("LearnerSection", __base__=LearnerFields, __module__=__name__, **_BLOCKS)


class LearnerConfig(_LearnerSection):
    """The learner's section: every field of `LearnerFields` and the parts' blocks, checked together by
    `check_learner`."""

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        refuse_moved(data)
        return data

    @model_validator(mode="after")
    def _check(self) -> LearnerConfig:
        check_learner(self)
        return self

    def params(self, part: str) -> BaseModel | None:
        """The parameter block of the registered part `part` (`learner.<part>`): as set, else its
        defaults; None for a part that takes no parameters (`config.params(config.advantage)`: the
        selected estimator's)."""
        return block_of(self, part)
