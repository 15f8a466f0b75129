"""Speculative decoding in the worker: drafters propose, one forward verifies.

Reading order: `config` (the settings a worker runs with), `drafts` (staging a plan's drafts
into the persistent batch; the Drafter that proposes the next ones for each method), the
drafters: `ngram` (prompt lookup: drafts from the request's own tokens, no weights),
`draft_model` (a small CausalLM with a private KV cache, `row_kv`), `feature_drafter` (heads
fed the target's features: `eagle`, `eagle3`, `mtp`, read and written by `head_io`),
`block_drafter` (the DFlash draft of `dflash`: a whole block in one non-causal forward); how drafts
are drawn: `draws` (the counter RNG's positions for drafts and acceptances), `draft_sampler`
(greedy or sampled drafts and their q), `vocab_map` (draft->target vocabulary, one rule for
every drafter), `proposals` (what was proposed, kept until verified); verification: `verify`
(the two acceptance rules and why each), `verify_step` (the runner's speculative sampling
path), `rejection` (rejection sampling within it).

Under tensor parallelism (MESHLLM_TP=N, services/worker/parallel) every rank runs the whole
drafter, unsharded: drafters are small, and replicating one keeps every rank's proposals (the
drafts and the draft distributions q that rejection sampling reads) equal to rank 0's, whose
drafts come back in the plan, without sending proposals between ranks. The target's shard
plan never touches a drafter's weights (the draft model loads as a group of one, the heads
through their own loaders, MTP modules with the shapes of the checkpoint's config, not the
rank's). Each rank then drafts from the same inputs: the same verified tokens (the same plans,
the same seeded sampling), and the target's features, which are whole and bit-identical on
every rank (the final hidden state and EAGLE-3's auxiliary streams are residual streams, i.e.
sums of all-reduced outputs). Heads that share the target's embedding or LM head (EAGLE-1/2,
MTP without its own, DFlash) call the target's vocab-parallel modules, whose all-reduce / all-gather
return the whole lookup and logits; those collectives meet on every rank because every rank
drafts the same rows in the same order. Verification is the sharded target forward, as for any
step (tested: tests/unit/worker/parallel/test_tp_drafters.py).
"""

from services.worker.spec.config import SpecMethod, SpeculativeConfig

__all__ = ["SpecMethod", "SpeculativeConfig"]
