"""How a worker speculates: the method, K drafts per step, and the method's own knobs."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SpecMethod = Literal["", "ngram", "draft", "eagle", "eagle3", "mtp", "dflash"]
METHODS = ("ngram", "draft", "eagle", "eagle3", "mtp", "dflash")


class SpeculativeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    method: SpecMethod = ""  # "" = no speculation
    # K: drafts proposed per request and step (the scheduler caps what it schedules by it too).
    num_spec_tokens: int = Field(default=4, ge=1, le=64)
    # the draft model / EAGLE head / DFlash draft checkpoint ("draft", "eagle", "eagle3",
    # "dflash"); "mtp": the target's
    # own checkpoint directory, whose MTP layers draft
    model: str = ""
    # Prompt lookup: the longest suffix of n tokens (max..min) found earlier in the request.
    prompt_lookup_max: int = Field(default=4, ge=1)
    prompt_lookup_min: int = Field(default=2, ge=1)

    @model_validator(mode="after")
    def _check(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min={self.prompt_lookup_min} > "
                f"prompt_lookup_max={self.prompt_lookup_max}"
            )
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.method)
