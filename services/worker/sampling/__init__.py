"""Turning logits into tokens: per-row sampling state kept across steps, and the sampler."""

from services.worker.sampling.state import SamplerOutput, SamplingState

__all__ = ["SamplerOutput", "SamplingState"]
