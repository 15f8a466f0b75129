"""What a prefill-role scheduler computes for a request.

The prefill side stops `max(1, lookahead)` tokens short of the prompt end (`lookahead` is the
one prefill-lookahead number: CONTRACTS.md). With a lookahead N > 0 it computes exactly
`prompt_len - N` tokens and the decode side prefills the last N itself (drafters that need the
target's hidden states there get them). With N = 0 it still leaves the last prompt token: the
decode side must run that position anyway to get the logits of the first output token, which is
what vLLM's P/D connectors do too (the decode instance recomputes the last prompt token of a
remote prefill). So the prefill side never samples: it sends no delta, and every output token
(index 0 on) comes from the decode side, under the request's own seed.

The job is the request with its prompt truncated to those tokens, `max_tokens=1` (peak KV: the
truncated prompt) and no grammar (nothing is sampled, so nothing is constrained). Its full
blocks hash exactly like the original prompt's (the chain covers the same tokens), so the decode
side finds them in the tier. Only full blocks can be shipped (the tier is keyed by block hash):
a prompt whose prefill part holds no full block goes to the decode side at once, as does a
routed-experts request, whose every prompt position must be computed where it is decoded.
The scheduler core runs a job like any request, except that it samples nothing
(`Scheduler.prefill_only`); `prefilled_in_step` tells when a step finished one.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.protocol import StepPlan, SubmitRequest


@dataclass(frozen=True, slots=True)
class PrefillPolicy:
    lookahead: int  # the one prefill-lookahead number (services.scheduler.spec)
    block_size: int

    def num_prefill_tokens(self, prompt_len: int) -> int:
        """Prompt tokens the prefill side computes: `prompt_len - max(1, lookahead)`."""
        return max(0, prompt_len - max(1, self.lookahead))

    def job_for(self, msg: SubmitRequest) -> SubmitRequest | None:
        """The prefill job for `msg`, or None when it goes to the decode side uncomputed."""
        num_tokens = self.num_prefill_tokens(len(msg.prompt_token_ids))
        # Routed experts and prompt logprobs come from the forward of every prompt position:
        # the decode side computes such a prompt itself.
        every_position = msg.return_routed_experts or msg.sampling.prompt_logprobs is not None
        if every_position or num_tokens < self.block_size:
            return None
        sampling = msg.sampling.model_copy(update={"max_tokens": 1, "min_tokens": 0})
        return msg.model_copy(
            update={
                "prompt_token_ids": list(msg.prompt_token_ids[:num_tokens]),
                "sampling": sampling,
                "grammar": None,
            }
        )


def prefilled_in_step(plan: StepPlan, num_tokens: dict[str, int]) -> list[str]:
    """Requests (of `num_tokens`: id -> its job's token count) whose last job token `plan`
    computed. Read from the plan, not the request: with asynchronous scheduling the request's
    counter already includes steps planned after this one."""
    done = []
    for entry in (*plan.new_requests, *plan.cached_requests):
        rid = entry.request_id
        total = num_tokens.get(rid)
        scheduled = plan.num_scheduled_tokens.get(rid, 0)
        if total is not None and scheduled and entry.num_computed_tokens + scheduled >= total:
            done.append(rid)
    return done
