"""Whether a request taken over after a fault may continue from its progress checkpoint (pure).

A scheduler that takes over a request entry delivered before (a dead group's, or its own
before a restart) reads the checkpoint its previous runner wrote (progress_book.py) and, when
it fits the request, adds the request with those tokens as already generated
(Scheduler.add_request `generated`): prompt + generated tokens are prefilled in one go (prefix
caching applies), and sampling continues at output index k. Nothing else needs carrying over:
- seeded sampling draws by (seed, sequence position) (CONTRACTS.md), so the token at index k
  is the one the run without the fault sampled there;
- max_tokens, min_tokens, penalties and the length check count the generated tokens as
  outputs (the worker splits NewRequestData's tokens at num_prompt_tokens);
- a structured-output request's grammar matcher is replayed over the generated tokens before
  sampling resumes (a replay the grammar rejects voids the checkpoint);
- stop strings and text are the gateway's (it has the text of the indexes it delivered), and
  logprobs of indexes below k were delivered with them (those from k on come with their
  tokens as usual; there are no prompt logprobs to recompute);
- n > 1: each choice is its own sub-request with its own entry and checkpoint.
A request asking for routed-expert rows never resumes: the rows of its first k tokens would be
recorded as prompt rows (it restarts from the prompt, as without checkpoints). Anything that
does not fit (another request's checkpoint, an id outside the vocabulary, no room left) means
a start from the prompt: the checkpoint is only ever a shortcut.
"""

from __future__ import annotations

from shared.protocol import ProgressCheckpoint, SubmitRequest


def resume_error(
    checkpoint: ProgressCheckpoint, msg: SubmitRequest, vocab_size: int, max_model_len: int
) -> str | None:
    """Why `checkpoint` cannot be resumed from for `msg`, or None when it can."""
    tokens = checkpoint.output_token_ids
    if checkpoint.request_id != msg.request_id:
        return f"checkpoint of request {checkpoint.request_id!r}"
    if checkpoint.num_prompt_tokens != len(msg.prompt_token_ids):
        return f"checkpoint of a {checkpoint.num_prompt_tokens}-token prompt"
    if msg.return_routed_experts:
        return "routed-expert rows are recorded from the prompt on"
    if not tokens:
        return "no tokens"
    if len(tokens) >= msg.sampling.max_tokens:
        return f"{len(tokens)} tokens reach max_tokens {msg.sampling.max_tokens}"
    if len(msg.prompt_token_ids) + len(tokens) >= max_model_len:
        return f"{len(tokens)} tokens reach max_model_len {max_model_len}"
    if vocab_size and any(not 0 <= t < vocab_size for t in tokens):
        return f"a token id outside the vocabulary of {vocab_size}"
    return None
