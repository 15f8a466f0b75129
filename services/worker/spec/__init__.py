"""Speculative decoding in the worker: drafters propose, one forward verifies.

Reading order: `config` (the settings a worker runs with), `drafts` (staging a plan's drafts
into the persistent batch; the Drafter that proposes the next ones for each method), the
drafters: `ngram` (prompt lookup: drafts from the request's own tokens, no weights),
`draft_model` (a small CausalLM with a private KV cache, `row_kv`), `feature_drafter` (heads
fed the target's features: `eagle`, `eagle3`, `mtp`, read and written by `head_io`); how drafts
are drawn: `draws` (the counter RNG's positions for drafts and acceptances), `draft_sampler`
(greedy or sampled drafts and their q), `vocab_map` (draft->target vocabulary, one rule for
every drafter), `proposals` (what was proposed, kept until verified); verification: `verify`
(the two acceptance rules and why each), `verify_step` (the runner's speculative sampling
path), `rejection` (rejection sampling within it).
"""

from services.worker.spec.config import SpecMethod, SpeculativeConfig

__all__ = ["SpecMethod", "SpeculativeConfig"]
