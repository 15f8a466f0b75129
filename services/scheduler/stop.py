"""Stop checks, run after each appended output token.

Order matters: a stop/eos token counts only once `min_tokens` outputs exist (the sampler masks
them before that, but a request must not stop early if one slips through); length limits apply
regardless, and a token that is both a stop token and the last allowed one reports "stop", so
the client learns which token ended it.
"""

from __future__ import annotations

from collections.abc import Container

from services.scheduler.request import Request
from shared.protocol import FinishReason

StopDecision = tuple[FinishReason, int | None]
"""(finish reason, the stop/eos token that caused it or None)."""


def check_stop(
    request: Request, eos_token_ids: Container[int], max_model_len: int
) -> StopDecision | None:
    sampling = request.sampling
    num_out = len(request.output_token_ids)
    if num_out >= sampling.min_tokens and num_out:
        last = request.output_token_ids[-1]
        if not sampling.ignore_eos and last in eos_token_ids:
            return "stop", last
        if last in sampling.stop_token_ids:
            return "stop", last
    if num_out >= sampling.max_tokens or len(request.all_token_ids) >= max_model_len:
        return "length", None
    return None
