"""Config section owned by the learner role: `LearnerConfig`, its fields (learner/config_fields.py)
under its cross-field rules (learner/config_rules.py), with the KL and LoRA blocks it holds
(learner/config_blocks.py; `KLConfig` and `LoRAConfig` are imported from here)."""

from __future__ import annotations

from pydantic import model_validator

from learner.config_blocks import KLConfig, LoRAConfig
from learner.config_fields import LearnerFields
from learner.config_rules import check_learner

__all__ = ["KLConfig", "LearnerConfig", "LoRAConfig"]


class LearnerConfig(LearnerFields):
    """The learner's section: every field of `LearnerFields`, checked together by `check_learner`."""

    @model_validator(mode="after")
    def _check(self) -> LearnerConfig:
        check_learner(self)
        return self
