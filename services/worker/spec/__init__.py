"""Speculative decoding in the worker: drafters propose, one forward verifies.

Reading order: `config` (the settings a worker runs with), `ngram` (prompt lookup: drafts
from the request's own tokens, no weights), `draft_model` (a small CausalLM with a private KV
cache), `vocab_map` (draft->target vocabulary, one rule for every drafter), `drafts` (staging a
plan's drafts into the persistent batch and proposing the next ones), `verify` (the acceptance
rule, exact for greedy and for seeded sampling), `verify_step` (the runner's speculative
sampling path).
"""

from services.worker.spec.config import SpecMethod, SpeculativeConfig

__all__ = ["SpecMethod", "SpeculativeConfig"]
